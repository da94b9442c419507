"""Every kernel family is one complete registry row, and each row's reference computes the family's GEMM."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from helion_backend.kernels.family import FAMILIES, KernelFamily, _resolve, family
from helion_backend.layers.quantize import QUANT_FORMATS
from helion_backend.tuning.problems import TuneKey, quantized_site
from helion_backend.vocabulary import KERNEL_FAMILIES, MULTI_GEMM_FAMILIES

M, K, N = 5, 256, 128
FP8 = torch.float8_e4m3fn
TOL = dict(rtol=1e-4, atol=1e-4)  # an fp32 GEMM over K = 256 against float64


def key_of(row: KernelFamily) -> TuneKey:
    """A small key of the row's family as a compile records it."""
    if row.quant_format is not None:
        dtype, prologue, epilogue = quantized_site(row.name)
        return TuneKey(row.name, epilogue, dtype, K, N, 8, prologue=prologue)
    if FAMILIES[row.member].quant_format is not None:  # fused sites on quantized rows
        dtype = quantized_site(row.member)[0]
        widths = () if row.config_adapter_path.endswith("glu_kernel_config") else (N, N)
        return TuneKey(row.name, (), dtype, K, sum(widths) or N, 8, widths)
    widths = (N, N) if row.name in MULTI_GEMM_FAMILIES.values() else ()
    epilogue = ("silu", "up_mul") if "up_mul" in row.contract.needs_steps else ("bias",)
    return TuneKey(row.name, () if widths else epilogue, "bfloat16", K, sum(widths) or N, 8, widths)


def test_every_family_of_the_vocabulary_has_a_row():
    assert set(FAMILIES) == {*KERNEL_FAMILIES, *MULTI_GEMM_FAMILIES.values()}
    with pytest.raises(ValueError, match="unknown kernel family 'gemm_fp4'; known: .*gemm_int4"):
        family("gemm_fp4")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_row_is_complete(name):
    row = FAMILIES[name]
    assert callable(row.kernel) and callable(row.reference) and callable(_resolve(row.problem_path)), row
    default = row.default_config(16, 4096, 4096, torch.bfloat16)
    assert isinstance(default, dict) and len(default["block_sizes"]) == 3 and default["split_k"] >= 1, default
    candidates = row.candidates(key_of(row))
    assert candidates and all(c["block_sizes"] for c in candidates), name
    assert row.config_adapter_path is None or callable(row.config_adapter)
    if row.quant_format is not None:
        layer = QUANT_FORMATS[row.quant_format].from_linear(nn.Linear(K, N))
        w_kn, _ = row.layer_weight(layer)
        assert w_kn.shape[1] == N


@pytest.mark.slow  # a fresh interpreter: imports torch and the package again
def test_reading_a_row_imports_no_helion():
    code = ("import sys, torch\nfrom helion_backend.kernels.family import FAMILIES\n"
            "config = FAMILIES['gemm_int4'].default_config(8, 4096, 4096, torch.bfloat16)\n"
            "assert 'helion' not in sys.modules, 'helion imported'\nprint(config['block_sizes'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[16,", "32,", "128]"]  # the int4 K block counts packed bytes


# ---------------------------------------------------------------------------------------------------
# References against float64


def quantize_rows_by_hand(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization: (rows in ``dtype``, their [M, 1] fp32 scale)."""
    top = 448.0 if dtype == FP8 else 127.0
    scale = (x.abs().amax(dim=-1, keepdim=True) / top).clamp_min(1e-12)
    scaled = x / scale
    q = scaled.to(FP8) if dtype == FP8 else scaled.round().clamp(-128, 127).to(torch.int8)
    return q, scale


def quantized_weight(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(N, K)
    return quantize_rows_by_hand(w, dtype)  # [N, K] and a [N, 1] per-channel scale


def rows_and_weights(dtype: torch.dtype, outputs: int):
    xq, ts = quantize_rows_by_hand(torch.randn(M, K), dtype)
    weights = [quantized_weight(dtype) for _ in range(outputs)]
    expected = [(xq.double() @ w.double().t()) * ts.double() * cs.double().t() for w, cs in weights]
    return xq, ts, weights, expected


def check_single(row, dtype, steps, operands, expected, **call):
    out = row.reference(*call.pop("x_w"), steps, operands, [], dtype, *call.pop("rest", ()), **call)
    torch.testing.assert_close(out.double(), expected, **TOL)


def float_reference(name: str) -> None:
    row = FAMILIES[name]
    x, w, up, bias = torch.randn(M, K), torch.randn(N, K), torch.randn(N, K), torch.randn(N)
    if name in MULTI_GEMM_FAMILIES.values():
        outs = row.reference(x, [w.t(), up.t()], [("bias",), ()], [bias, ], [], torch.float32)
        expected = [x.double() @ w.double().t() + bias.double(), x.double() @ up.double().t()]
        for out, ref in zip(outs, expected):
            torch.testing.assert_close(out.double(), ref, **TOL)
    elif "up_mul" in KERNEL_FAMILIES[name].needs_steps:
        gate, upper = x.double() @ w.double().t(), x.double() @ up.double().t()
        out = row.reference(x, w.t(), ("silu", "up_mul"), [], [], torch.float32, None, up.t())
        torch.testing.assert_close(out.double(), torch.nn.functional.silu(gate) * upper, **TOL)
    else:
        out = row.reference(x, w.t(), ("bias", "gelu"), [bias], [], torch.float32)
        expected = torch.nn.functional.gelu(x.double() @ w.double().t() + bias.double())
        torch.testing.assert_close(out.double(), expected, **TOL)


def rows_reference(name: str) -> None:
    """fp8/int8 rows quantized before the call, rescaled by their token and channel scales."""
    row = FAMILIES[name]
    dtype = torch.int8 if "int8" in KERNEL_FAMILIES[row.member].dtypes else FP8
    steps = ("token_scale", "channel_scale")
    multi, glu = name in MULTI_GEMM_FAMILIES.values(), "up_mul" in KERNEL_FAMILIES.get(name, KERNEL_FAMILIES["gemm"]).needs_steps
    xq, ts, weights, expected = rows_and_weights(dtype, 2 if multi or glu else 1)
    ops = [[ts.expand(M, N), cs.reshape(N)] for _, cs in weights]
    if multi:
        outs = row.reference(xq, [w.t() for w, _ in weights], [steps, steps], [*ops[0], *ops[1]], [], torch.float32)
        for out, ref in zip(outs, expected):
            torch.testing.assert_close(out.double(), ref, **TOL)
    elif glu:
        out = row.reference(xq, weights[0][0].t(), (*steps, "silu", "up_mul"), [*ops[0], *ops[1]], [], torch.float32,
                            None, weights[1][0].t(), None, None, steps)
        torch.testing.assert_close(out.double(), torch.nn.functional.silu(expected[0]) * expected[1],
                                   **TOL)
    else:
        out = row.reference(xq, weights[0][0].t(), steps, ops[0], [], torch.float32)
        torch.testing.assert_close(out.double(), expected[0], **TOL)


def weight_only_reference(name: str) -> None:
    row = FAMILIES[name]
    x = torch.randn(M, K)
    layer = QUANT_FORMATS[row.quant_format].from_linear(nn.Linear(K, N, bias=False))
    w_kn, weight_scale = row.layer_weight(layer)
    if weight_scale is None:  # int8 weight-only: the weight converted, then its channel scale
        scale = layer.weight_scale.reshape(-1).float()
        out = row.reference(x, w_kn, ("channel_scale",), [scale], [], torch.float32)
        expected = (x.double() @ w_kn.double()) * scale.double()
    else:  # packed int4: nibbles low first, minus the zero point 8, times each group's scale
        packed = w_kn.t()
        q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(N, K).double() - 8
        groups = weight_scale.shape[1]
        dequantized = (q.reshape(N, groups, -1) * weight_scale.double().reshape(N, groups, 1)).reshape(N, K)
        out = row.reference(x, w_kn, (), [], [], torch.float32, None, None, weight_scale)
        expected = x.double() @ dequantized.t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def block_fp8_reference(name: str) -> None:
    """Block fp8 against the layer's own unfused forward (its activation groups are quantized by the graph)."""
    from helion_backend.tuning.problems import _trace

    row = FAMILIES[name]
    layer = QUANT_FORMATS[row.quant_format].from_linear(nn.Linear(K, N, bias=False))
    x = torch.randn(M, K)
    program = _trace(layer, x, fuse_activation_quant=True).quant_program
    w_kn, weight_scale = row.layer_weight(layer)
    out = row.reference(x, w_kn, (), [], [], torch.float32, program, None, weight_scale)
    with torch.no_grad():
        torch.testing.assert_close(out, layer(x), **TOL)


REFERENCES = {
    "gemm": float_reference, "gemm_glu": float_reference, "gemm_multi": float_reference,
    "gemm_fp8": rows_reference, "gemm_int8": rows_reference, "gemm_glu_fp8": rows_reference,
    "gemm_glu_int8": rows_reference, "gemm_multi_fp8": rows_reference, "gemm_multi_int8": rows_reference,
    "gemm_weight_only": weight_only_reference, "gemm_int4": weight_only_reference,
    "gemm_fp8_block": block_fp8_reference,
}


def test_every_row_has_a_reference_check():
    assert REFERENCES.keys() == FAMILIES.keys()


@pytest.mark.parametrize("name", list(REFERENCES))
def test_the_row_reference_matches_float64(name):
    torch.manual_seed(sorted(REFERENCES).index(name))
    REFERENCES[name](name)
