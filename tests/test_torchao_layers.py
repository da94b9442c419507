"""torchao's quantized layers (``torchao.quantization.quantize_``), compiled with the backend: each form fuses
with the kernel family its graph calls for, or the report says why not; fused, it computes what the unfused
quantized model (eager torchao) does, on fresh random inputs.

The model is a small MLP: a linear with a bias and a GELU, a second linear with a bias, and a residual. On the
CPU the fused sites run the reference path (``rewrite_on_cpu``); the ``gpu`` tests run the Helion kernels and
the layouts torchao picks on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import CPU_REWRITE, QUANT_IN_KERNEL, compile_run, sites, sqnr_db

import helion_backend

torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install '.[test]')")
from torchao.quantization import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8WeightOnlyConfig,
    PerRow,
    quantize_,
)
from torchao.quantization.quantize_.common import KernelPreference  # noqa: E402

K, HIDDEN = 256, 512
CUDA = torch.cuda.is_available()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(K, HIDDEN)
        self.down = nn.Linear(HIDDEN, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh")) + x


def quantized_mlp(config, dtype: torch.dtype, device: str = "cpu") -> MLP:
    torch.manual_seed(0)
    model = MLP().to(device=device, dtype=dtype).eval()
    quantize_(model, config)
    return model


@pytest.fixture(autouse=True)
def restore_inductor_config(monkeypatch):
    """torchao's configs set Inductor options process-wide when applied (``set_inductor_config=True``, their
    default: coordinate-descent tuning among them); the tests keep that default, as users get it, and put
    the options back afterwards."""
    from torch._inductor import config

    for name in ("coordinate_descent_tuning", "coordinate_descent_check_all_directions", "force_fuse_int_mm_with_mul",
                 "fx_graph_cache"):
        monkeypatch.setattr(config, name, getattr(config, name))
    monkeypatch.setattr(config.triton, "unique_kernel_names", config.triton.unique_kernel_names)


@pytest.fixture(autouse=True)
def int8_as_cuda_runs_it(monkeypatch):
    """torchao's int8 matmul on the CPU depends on the host: with AVX512-VNNI and no AMX (torch >= 2.12) it
    shifts the rows to uint8 and subtracts a correction after ``_int_mm`` (u8s8), else it multiplies the
    int8 rows as CUDA does (s8s8). The tests pin the s8s8 form, on any host;
    ``test_int8_dynamic_u8s8_form_stays_with_inductor_and_says_why`` runs the other."""
    from torchao.kernel import intmm

    monkeypatch.setattr(intmm, "_cpu_is_vnni_supported", lambda: False)


def fp8_per_row():
    """torchao's fp8 dynamic per-token activation / per-channel weight layer, through ``torch._scaled_mm``
    (``KernelPreference.TORCH``; AUTO would pick an MSLK kernel where that package is installed)."""
    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), kernel_preference=KernelPreference.TORCH)


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """torchao refuses to build fp8 layers without an fp8 GPU, though the CPU build runs their ``_scaled_mm``:
    its hardware check is bypassed for the CPU tests."""
    from torchao.quantization import quant_api

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)


def compile_and_compare(model: MLP, x: torch.Tensor, options: dict):
    """The compiled model's output on ``x``, its eager (unfused torchao) output, and the fused sites."""
    with torch.no_grad():
        expected = model(x)
        out, reports = compile_run(copy.deepcopy(model), x, options=options)
    return out, expected, sites(reports)


def assert_mlp_sites(found, kernel: str, up_steps: list[str], down_steps: list[str], prologue: list[str]) -> None:
    up, down = found
    assert (up.kernel, up.prologue, up.epilogue) == (kernel, prologue, up_steps), up
    assert (down.kernel, down.epilogue) == (kernel, down_steps), down


def test_fp8_per_row_fuses_with_the_scales_bias_gelu_and_residual(fp8_on_cpu):
    """The scale torchao hands ``_scaled_mm`` is a view of the computed one ([M, 1] -> [M, 1, 1] -> [M, 1]): the
    per-token quantization is still recognized (the note says so; with fuse_activation_quant the first site
    takes it as its prologue)."""
    model = quantized_mlp(fp8_per_row(), torch.bfloat16)
    x = torch.randn(4, K, dtype=torch.bfloat16)
    out, expected, found = compile_and_compare(model, x, CPU_REWRITE)
    assert_mlp_sites(found, "gemm_fp8", ["token_scale", "channel_scale", "bias", "gelu_tanh"],
                     ["token_scale", "channel_scale", "bias", "residual"], [])
    assert all(any("left to Inductor" in note for note in site.notes) for site in found), found
    assert sqnr_db(expected, out) >= 40

    out, expected, found = compile_and_compare(model, x, QUANT_IN_KERNEL)
    assert found[0].prologue == ["quant_fp8_per_token"] and found[0].epilogue[0] == "act_scale", found[0]
    assert sqnr_db(expected, out) >= 40


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_int8_dynamic_fuses_with_the_rounding_between_its_scales(dtype):
    """torchao 0.18 rescales ``_int_mm``'s result by the token scale, casts it to the model's dtype, then
    multiplies by the channel scale in fp32: ``cast, token_scale, cast, channel_scale``. The fused op keeps
    the product in fp32 where the graph rounds it once to bf16 (close at bf16's precision, as Inductor's own
    fused kernels compute it): it matches eager torchao at 40 dB and torch.compile at bf16's tolerance."""
    model = quantized_mlp(Int8DynamicActivationInt8WeightConfig(), dtype)
    x = torch.randn(4, K, dtype=dtype)
    out, expected, found = compile_and_compare(model, x, CPU_REWRITE)
    if dtype == torch.float32:  # no rounding: the casts to fp32 are no ops
        scales = ["cast", "token_scale", "channel_scale", "bias"]
        assert_mlp_sites(found, "gemm_int8", [*scales, "gelu_tanh"], [*scales, "residual"], [])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    scales = ["cast", "token_scale", "cast", "channel_scale", "bias"]
    assert_mlp_sites(found, "gemm_int8", [*scales, "gelu_tanh", "cast"], [*scales, "cast", "residual"], [])
    assert sqnr_db(expected, out) >= 40
    torch._dynamo.reset()
    with torch.no_grad():
        inductor = torch.compile(copy.deepcopy(model))(x)
    torch.testing.assert_close(out, inductor, rtol=1.6e-2, atol=1e-2)


def test_int8_dynamic_u8s8_form_stays_with_inductor_and_says_why(monkeypatch):
    """torchao's u8s8 CPU form (rows shifted by 128 to uint8, ``_int_mm``, then the weight's column sums times
    128 subtracted) is not an int8 x int8 GEMM: each site stays with Inductor, its report names the uint8
    input, and the model still computes what eager torchao does."""
    from torchao.kernel import intmm

    monkeypatch.setattr(intmm, "_cpu_is_vnni_supported", lambda: True)
    monkeypatch.setattr(intmm, "_cpu_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(intmm, "torch_version_at_least", lambda version: True)
    # The tensor subclass's matmul is traced by AOTAutograd, under the same Dynamo graph as the s8s8 form:
    # neither Dynamo's guards nor AOTAutograd's cache key see the host checks, so both are bypassed.
    torch._dynamo.reset()
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    model = quantized_mlp(Int8DynamicActivationInt8WeightConfig(), torch.float32)
    x = torch.randn(4, K)
    with torch.no_grad():
        expected = model(x)
        out, reports = compile_run(copy.deepcopy(model), x, options=CPU_REWRITE)
    assert sites(reports) == []
    unfused = [gemm for report in reports for gemm in report.unfused_gemms]
    assert [gemm.op for gemm in unfused] == ["aten._int_mm.default"] * 2, unfused
    assert all("torch.uint8" in gemm.reason for gemm in unfused), unfused
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_int8_dynamic_activation_quantization_says_why_it_stays_with_inductor():
    """torchao's int8 scale is max(-min(amin(x), 0), max(amax(x), 0)) / 127.5: two reductions, where the
    kernels replay one amax. With fuse_activation_quant the GEMM still fuses on the quantized rows, and the
    note names the reduction."""
    model = quantized_mlp(Int8DynamicActivationInt8WeightConfig(), torch.bfloat16)
    x = torch.randn(4, K, dtype=torch.bfloat16)
    out, expected, found = compile_and_compare(model, x, QUANT_IN_KERNEL)
    assert [site.prologue for site in found] == [[], []], found
    assert any("aten.amin.default" in note and "a single amax over K" in note for note in found[0].notes), found[0]
    assert sqnr_db(expected, out) >= 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weight_only_fuses_with_its_dequantization(dtype):
    model = quantized_mlp(Int8WeightOnlyConfig(), dtype)
    x = torch.randn(4, K, dtype=dtype)
    out, expected, found = compile_and_compare(model, x, CPU_REWRITE)
    assert_mlp_sites(found, "gemm_weight_only", ["channel_scale", "bias", "gelu_tanh"],
                     ["channel_scale", "bias", "residual"], ["dequant_int8"])
    assert sqnr_db(expected, out) >= (90 if dtype == torch.float32 else 40)


def assert_packed_int4_unfused(reports, op: str) -> None:
    unfused = [gemm for report in reports for gemm in report.unfused_gemms]
    assert [gemm.op for gemm in unfused] == [f"aten.{op}.default"] * 2, unfused
    assert all("no kernel family reads that layout" in gemm.reason for gemm in unfused), unfused
    assert not sites(reports)


def test_int4_weight_only_on_the_cpu_is_reported_unfused_with_why():
    """torchao's stable int4 layouts need CUDA (tinygemm) or MSLK; on the CPU its int4 layer packs the weight
    for ``_weight_int4pack_mm_for_cpu``, an opaque GEMM: it runs as it is and the report says why."""
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig

    model = quantized_mlp(PrototypeInt4WeightOnlyConfig(group_size=32), torch.bfloat16)
    x = torch.randn(4, K, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
        out, reports = compile_run(copy.deepcopy(model), x, options=CPU_REWRITE)
    assert_packed_int4_unfused(reports, "_weight_int4pack_mm_for_cpu")
    assert sqnr_db(expected, out) >= 40


# --------------------------------------------------------------------------------------------------
# On the GPU: the Helion kernels, and the layouts torchao takes on CUDA.

GPU_M = 32  # _int_mm on CUDA needs M > 16; within max_helion_size, so every site runs Helion


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["fp8_per_row", "int8_dynamic", "int8_weight_only"])
def test_gpu_torchao_layers_run_helion_and_match_eager(form):
    config = {"fp8_per_row": fp8_per_row, "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
              "int8_weight_only": Int8WeightOnlyConfig}[form]()
    kernel = {"fp8_per_row": "gemm_fp8", "int8_dynamic": "gemm_int8", "int8_weight_only": "gemm_weight_only"}[form]
    model = quantized_mlp(config, torch.bfloat16, "cuda")
    helion_backend.clear_reports()
    compiled = torch.compile(copy.deepcopy(model), backend="helion_inductor")
    for _ in range(2):
        x = torch.randn(GPU_M, K, dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            out, expected = compiled(x), model(x)
        assert sqnr_db(expected, out) >= 40
    found = sites(helion_backend.get_reports())
    assert [(site.kernel, site.runs_on) for site in found] == [(kernel, "helion")] * 2, found


@pytest.mark.gpu
def test_gpu_int4_tinygemm_layout_is_reported_unfused_with_why():
    """On CUDA torchao's int4 layer (tile-packed for tinygemm) calls ``_weight_int4pack_mm``: not fused, and
    the report says why; the model still matches eager."""
    model = quantized_mlp(Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d"),
                          torch.bfloat16, "cuda")
    x = torch.randn(GPU_M, K, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        expected = model(x)
        out, reports = compile_run(copy.deepcopy(model), x, options={})
    assert_packed_int4_unfused(reports, "_weight_int4pack_mm")
    assert sqnr_db(expected, out) >= 40
