"""Quantized linears on the CPU: what the matcher recognizes, what the report says, and that the rewritten
graph (run through the reference path, ``rewrite_on_cpu``) computes what the unfused one does.

The forms are the ones libraries write (see ``helion_backend.layers.quantize``), plus a seeded generator of
the variants they differ by: ``amax`` or ``max``, ``div`` or ``mul(reciprocal)``, optional clamps,
different epsilons, fp32 round trips, rounding for int8, and the epilogues after the GEMM.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import CPU_REWRITE, QUANT_IN_KERNEL, Spread, compile_run, diagonal, sites, slow_except, sqnr_db

import helion_backend
from helion_backend.compile.rules import RuleError, load_rule_file
from helion_backend.layers.quantize import (
    FP8_BLOCK,
    BlockFp8Linear,
    Fp8DynamicLinear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    quantize,
)
from helion_backend.semantics.reference import dequantize_int4

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
# Each format's prologue with fuse_activation_quant (the per-token quantizations in the kernel).
PROLOGUE = {"fp8_dynamic": ["quant_fp8_per_token"], "int8_dynamic": ["quant_int8_per_token"],
            "int8_weight_only": ["dequant_int8"], "int4_weight_only": ["dequant_int4"],
            "fp8_block": ["quant_fp8_per_group", "dequant_fp8_block"]}
KERNEL = {"fp8_dynamic": "gemm_fp8", "int8_dynamic": "gemm_int8", "int8_weight_only": "gemm_weight_only",
          "int4_weight_only": "gemm_int4", "fp8_block": "gemm_fp8_block"}
PER_TOKEN = ("fp8_dynamic", "int8_dynamic")  # the formats whose activation Inductor quantizes by default
# Every format as compiled by default, and the per-token ones also with their quantization in the kernel.
FORMATS = [*((fmt, False) for fmt in sorted(PROLOGUE)), *((fmt, True) for fmt in PER_TOKEN)]
FORMAT_IDS = [f"{fmt}-{'kernel_quant' if fused else 'default'}" for fmt, fused in FORMATS]
LEFT_TO_INDUCTOR = "left to Inductor, which fuses it with the op producing the activation"


def prologue_of(fmt: str, fused: bool) -> list[str]:
    """The prologue a site of ``fmt`` reports, with or without fuse_activation_quant."""
    return PROLOGUE[fmt] if fused or fmt not in PER_TOKEN else []


def options_of(fused: bool) -> dict:
    return QUANT_IN_KERNEL if fused else CPU_REWRITE


class Block(nn.Module):
    def __init__(self, k: int = 256, n: int = 128) -> None:
        super().__init__()
        self.proj = nn.Linear(k, n)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh") + residual


@pytest.mark.parametrize("fmt, fused, dtype, lead", slow_except(
    {("fp8_dynamic", False, torch.float32, (5,)), ("int8_dynamic", True, torch.bfloat16, (2, 3)),
     ("int4_weight_only", False, torch.bfloat16, (5,)), ("fp8_block", False, torch.float32, (2, 3))},
    [(fmt, fused, dtype, lead) for fmt, fused in FORMATS for dtype in (torch.float32, torch.bfloat16)
     for lead in ((5,), (2, 3))]))
def test_library_forms_fuse_with_their_prologue_and_match_eager(fmt, fused, dtype, lead):
    torch.manual_seed(0)
    model = quantize(Block().to(dtype).eval(), fmt)
    x, r = torch.randn(*lead, 256, dtype=dtype), torch.randn(*lead, 128, dtype=dtype)
    with torch.no_grad():
        out, reports = compile_run(copy.deepcopy(model), x, r, options=options_of(fused))
        expected = model(x, r)
    (site,) = sites(reports)
    assert (site.kernel, site.prologue, site.runs_on) == (KERNEL[fmt], prologue_of(fmt, fused), "reference")
    assert "gelu_tanh" in site.epilogue and site.epilogue[-1] == "residual", site.epilogue
    # The reference replays the graph's own quantization; only the epilogue's fp32 (vs bf16 steps) differs.
    assert sqnr_db(expected, out) >= (90 if dtype == torch.float32 else 40)


def record_fused_inputs(monkeypatch) -> list[tuple[torch.dtype, bool]]:
    """Per call of the fused op: the dtype of the activation it reads, and whether it quantizes it."""
    from helion_backend.runtime import dispatch

    run = dispatch.run_gemm_epilogue
    signature = inspect.signature(run)
    calls = []

    def recording(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        calls.append((arguments["x"].dtype, arguments["spec"].quant_program is not None))
        return run(*args, **kwargs)

    monkeypatch.setattr(dispatch, "run_gemm_epilogue", recording)
    return calls


@pytest.mark.parametrize("fmt, fused", diagonal(list(PER_TOKEN), [False, True]))
def test_per_token_quantization_runs_in_inductor_unless_the_option_fuses_it(fmt, fused, monkeypatch):
    """By default the fp8/int8 site reads the rows Inductor quantized (with the RMSNorm that produces them)
    and multiplies by their scale in its epilogue (``token_scale``), and the report says why; with
    ``fuse_activation_quant`` the op reads the float rows and quantizes them (``act_scale``). Either way it
    computes what the unfused graph does, on fresh inputs."""
    torch.manual_seed(19)
    model = quantize(nn.Sequential(nn.RMSNorm(256, eps=1e-6), nn.Linear(256, 128), nn.GELU(approximate="tanh")),
                     fmt).eval()
    with torch.no_grad():
        model[0].weight.copy_(torch.rand(256) + 0.5)
    calls = record_fused_inputs(monkeypatch)
    helion_backend.clear_reports()
    compiled = torch.compile(copy.deepcopy(model), backend="helion_inductor", options=options_of(fused))
    for _ in range(2):
        x = torch.randn(5, 256) * 3
        with torch.no_grad():
            out, expected = compiled(x), model(x)
        assert expected.abs().max() > 0.1
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    (site,) = sites(helion_backend.get_reports())
    assert (site.kernel, site.prologue, site.runs_on) == (KERNEL[fmt], prologue_of(fmt, fused), "reference"), site
    scale = "act_scale" if fused else "token_scale"
    assert scale in site.epilogue and site.epilogue[-1] == "gelu_tanh", site.epilogue
    note = f"activation quantization ({PROLOGUE[fmt][0]}) {LEFT_TO_INDUCTOR}"
    assert [note in n for n in site.notes] == ([] if fused else [True]), site.notes
    quantized = {"fp8_dynamic": FP8, "int8_dynamic": torch.int8}[fmt]
    assert calls == [(torch.float32, True) if fused else (quantized, False)] * 2


@pytest.mark.parametrize("fmt, fused", FORMATS, ids=FORMAT_IDS)
def test_trace_sites_names_each_format_prologue(fmt, fused):
    """``trace_sites`` (the tuner's and the kernel tests' view of a layer) names the prologue a compile
    reports, and by default the note on a quantization left to Inductor. make_fx reads a buffer through a
    node per use, and the int4 layer reads its packed bytes twice (``p & 15``, ``p >> 4``): they are still one
    tensor."""
    from helion_backend.compile.trace import trace_sites

    torch.manual_seed(0)
    layer = quantize(nn.Linear(256, 128).to(torch.bfloat16), fmt)
    (site,) = trace_sites(layer, torch.randn(4, 256, dtype=torch.bfloat16), fuse_activation_quant=fused)
    assert [step.name for step in site.prologue] == prologue_of(fmt, fused), site
    left = fmt in PER_TOKEN and not fused
    assert [LEFT_TO_INDUCTOR in note for note in site.notes] == ([True] if left else []), site.notes
    assert (site.quant_program is not None) == (fused or fmt == "fp8_block"), site


def test_rescale_after_form_takes_the_unit_scales_as_steps():
    """``_scaled_mm`` with unit scales and an fp32 output, rescaled after: the same site, more steps."""
    torch.manual_seed(1)
    layer = Fp8DynamicLinear.from_linear(nn.Linear(256, 64).to(torch.bfloat16), rescale_after=True)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_run(layer, x, options=QUANT_IN_KERNEL)
        expected = layer(x)
    (site,) = sites(reports)
    assert site.prologue == ["quant_fp8_per_token"]
    assert site.epilogue[:4] == ["tensor_scale", "tensor_scale", "act_scale", "channel_scale"], site.epilogue
    assert sqnr_db(expected, out) >= 40


@pytest.mark.parametrize("fused", [False, True], ids=["default", "kernel_quant"])
def test_int_mm_on_rows_padded_to_17_is_seen_through(monkeypatch, fused):
    """cuBLAS needs M > 16 for _int_mm, so libraries pad the rows and slice them back: one site, no pad."""
    from helion_backend.layers import quantize as quantize_module

    torch.manual_seed(2)
    layer = Int8DynamicLinear.from_linear(nn.Linear(256, 64))
    monkeypatch.setattr(quantize_module, "_int_mm_any_m", functools.partial(quantize_module._int_mm_any_m, pad_to=17))
    x = torch.randn(3, 256)
    with torch.no_grad():
        out, reports = compile_run(layer, x, options=options_of(fused))
        expected = layer(x)
    (site,) = sites(reports)
    assert site.m == 3 and site.prologue == prologue_of("int8_dynamic", fused), site
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_pre_quantized_input_fuses_without_a_prologue():
    """Static quantization (the activation arrives quantized, with its scale): the GEMM, its rescale and
    epilogue still fuse; the token scale is an operand."""
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    w_scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).t().contiguous()
    wq = (w / w_scale.t()).to(FP8)

    def fn(xq, x_scale):
        return F.silu(torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.float32))

    xq, x_scale = torch.randn(8, 256).clamp(-400, 400).to(FP8), torch.rand(8, 1) + 0.1
    out, reports = compile_run(fn, xq, x_scale)
    (site,) = sites(reports)
    assert site.prologue == [] and site.epilogue[:2] == ["token_scale", "channel_scale"], site
    torch.testing.assert_close(out, fn(xq, x_scale), rtol=1e-5, atol=1e-5)


def test_quantized_activation_with_another_reader_still_fuses():
    """The quantization is pure: the fused kernel recomputes it, Inductor keeps it for the other reader."""
    torch.manual_seed(4)
    layer = Fp8DynamicLinear.from_linear(nn.Linear(256, 64))

    def fn(x):
        scale = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out = torch._scaled_mm(xq, layer.qweight.t(), scale_a=scale, scale_b=layer.weight_scale,
                               out_dtype=torch.float32)
        return out, xq.float().sum()

    x = torch.randn(4, 256)
    (out, total), reports = compile_run(fn, x, options=QUANT_IN_KERNEL)
    (site,) = sites(reports)
    assert site.prologue == ["quant_fp8_per_token"]
    expected_out, expected_total = fn(x)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    assert total == expected_total


def test_scale_that_reads_x_beyond_the_amax_is_not_a_prologue():
    torch.manual_seed(5)
    layer = Fp8DynamicLinear.from_linear(nn.Linear(256, 64))

    def fn(x):
        scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX + x.mean(-1, keepdim=True).abs()).clamp(min=1e-12)
        xq = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return torch._scaled_mm(xq, layer.qweight.t(), scale_a=scale, scale_b=layer.weight_scale,
                                out_dtype=torch.float32)

    x = torch.randn(4, 256)
    out, reports = compile_run(fn, x)
    (site,) = sites(reports)
    assert site.prologue == [] and site.epilogue[0] == "token_scale", site
    torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)


def test_rule_without_the_prologue_keeps_the_gemm_and_notes_why(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "fp8_plain"\nanchor = ["scaled_mm"]\nkernel = "gemm_fp8"\n'
                     'epilogue = ["token_scale", "channel_scale", "bias?"]\n')
    torch.manual_seed(6)
    layer = Fp8DynamicLinear.from_linear(nn.Linear(256, 64))
    x = torch.randn(4, 256)
    with torch.no_grad():
        out, reports = compile_run(layer, x, options={**QUANT_IN_KERNEL, "builtin_rules": False, "rules": [str(rules)]})
        expected = layer(x)
    (site,) = sites(reports)
    assert site.rule == "fp8_plain" and site.prologue == [], site
    assert any("prologue [quant_fp8_per_token] not fused" in note for note in site.notes), site.notes
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("body, line, message", [
    ('anchor = ["scaled_mm"]\nkernel = "gemm_fp8"\ndtypes = ["bfloat16"]', 5,
     "kernel family 'gemm_fp8' multiplies ['float8_e4m3fn'], not ['bfloat16']"),
    ('anchor = ["mm"]\nprologue = ["quant_fp8_per_token"]', 4,
     "kernel family 'gemm' runs prologue steps ['rmsnorm'], not ['quant_fp8_per_token']"),
])
def test_rule_files_pair_kernel_families_with_their_dtypes_and_prologues(tmp_path, body, line, message):
    path = tmp_path / "rules.toml"
    path.write_text(f'[[rule]]\nname = "r"\n{body}\n')
    with pytest.raises(RuleError) as info:
        load_rule_file(path)
    assert f"{path}:{line}:" in str(info.value) and message in str(info.value), str(info.value)


@pytest.mark.parametrize("fmt, fused", [("fp8_dynamic", False), ("fp8_dynamic", True), ("int8_dynamic", False),
                                       ("int8_dynamic", True), ("fp8_block", False)])
def test_zero_rows_saturation_and_nan_behave_as_the_unfused_graph(fmt, fused):
    """All-zero rows take the clamped scale; values far past the format's range saturate; a NaN row
    stays NaN (and only that row)."""
    torch.manual_seed(7)
    layer = quantize(nn.Linear(256, FP8_BLOCK if fmt == "fp8_block" else 64), fmt)  # block fp8: N % 128 == 0
    x = torch.randn(5, 256)
    x[1] = 0
    x[2, :5] = 1e30
    x[3, 7] = float("nan")
    with torch.no_grad():
        out, _ = compile_run(copy.deepcopy(layer), x, options=options_of(fused))
        expected = layer(x)
    assert torch.equal(out.isnan(), expected.isnan())
    finite = ~expected.isnan()
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Generated variants of per-token quantization, as different libraries and versions write it.

PROGRAMS = int(os.environ.get("HELION_INDUCTOR_QUANT_FUZZ_PROGRAMS", "60"))
DEFAULT_PROGRAMS = 4  # in the default run; the others are marked slow (CI and --runslow run them)


def quantization_variant(rng: random.Random, qdtype: torch.dtype):
    """A per-token quantization ``x -> (xq, scale)`` written one of the ways libraries write it."""
    qmax = FP8_MAX if qdtype == FP8 else 127.0
    use_max = rng.random() < 0.5
    cast_first = rng.random() < 0.5
    scale_by_mul = rng.random() < 0.5
    eps = rng.choice([None, 1e-12, 1e-5])
    eps_as_clamp = rng.random() < 0.5
    quant_by = rng.choice(["div", "mul_reciprocal", "mul_inverse"])
    clamp = rng.random() < 0.7

    def fn(x):
        v = x.float() if cast_first else x
        amax = v.abs().max(dim=-1, keepdim=True)[0] if use_max else v.abs().amax(dim=-1, keepdim=True)
        amax = amax.float()
        scale = amax * (1.0 / qmax) if scale_by_mul else amax / qmax
        if eps is not None:
            scale = scale.clamp(min=eps) if eps_as_clamp else torch.clamp_min(scale, eps)
        xf = x.float()
        if quant_by == "div":
            q = xf / scale
        elif quant_by == "mul_reciprocal":
            q = xf * scale.reciprocal()
        else:
            q = xf * (1.0 / scale)
        if qdtype == torch.int8:
            q = q.round()
        if clamp:
            q = q.clamp(-qmax - (qdtype == torch.int8), qmax)
        return q.to(qdtype), scale

    fn.describe = (f"{qdtype} max={use_max} cast_first={cast_first} scale_by_mul={scale_by_mul} eps={eps} "
                   f"eps_as_clamp={eps_as_clamp} quant_by={quant_by} clamp={clamp}")
    return fn


def generated_program(seed: int):
    rng = random.Random(seed)
    qdtype = rng.choice([FP8, torch.int8])
    quant = quantization_variant(rng, qdtype)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    m, k, n = rng.choice([1, 3, 16, 17]), rng.choice([128, 256]), rng.choice([64, 96])
    lead = rng.choice([(), (2,)])
    epilogue = rng.choice(["none", "bias", "gelu", "silu_residual"])
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w_scale = (w.abs().amax(1) / (FP8_MAX if qdtype == FP8 else 127.0)).clamp(min=1e-6)
    wq = (w / w_scale[:, None]).round().clamp(-127, 127).to(qdtype)
    bias = torch.randn(n, generator=gen).to(dtype)

    def fn(x, residual):
        x2 = x.reshape(-1, k)
        xq, scale = quant(x2)
        if qdtype == FP8:
            use_bias = epilogue == "bias"
            y = torch._scaled_mm(xq, wq.t(), scale_a=scale, scale_b=w_scale.view(1, n),
                                 bias=bias if use_bias else None, out_dtype=dtype)
        else:
            y = (torch._int_mm(xq, wq.t()).float() * scale * w_scale)
            y = (y + bias.float() if epilogue == "bias" else y).to(dtype)
        y = y.reshape(*x.shape[:-1], n)
        if epilogue == "gelu":
            y = F.gelu(y)
        elif epilogue == "silu_residual":
            y = F.silu(y) + residual
        return y

    x = torch.randn(*lead, m, k, generator=gen).to(dtype)
    residual = torch.randn(*lead, m, n, generator=gen).to(dtype)
    describe = f"seed={seed} {quant.describe} {dtype} lead={lead} m={m} k={k} n={n} epilogue={epilogue}"
    return fn, (x, residual), describe


@pytest.mark.parametrize("seed", slow_except(range(DEFAULT_PROGRAMS), range(PROGRAMS)))
def test_generated_quantization_forms_fuse_and_match_eager(seed):
    """Each form is recognized and replayed in the kernel's prologue (the option that puts it there)."""
    fn, args, describe = generated_program(seed)
    helion_backend.clear_reports()
    torch._dynamo.reset()
    out, reports = compile_run(fn, *args, options=QUANT_IN_KERNEL)
    expected = fn(*args)
    (site,) = sites(reports)
    assert site.prologue and site.prologue[0].startswith("quant_"), f"{describe}\n{site}"
    tolerance = 1e-5 if args[0].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance, msg=describe)


def test_rule_that_stops_before_the_rescale_cannot_take_the_prologue(tmp_path):
    """A rule fusing only the int32 -> fp32 cast after _int_mm would leave the kernel's rescale out of
    place: the prologue is dropped and the site fuses the GEMM and the cast alone."""
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "int8_cast"\nanchor = ["int_mm"]\nkernel = "gemm_int8"\n'
                     'prologue = ["quant_int8_per_token?"]\nepilogue = ["cast"]\n')
    torch.manual_seed(8)
    layer = Int8DynamicLinear.from_linear(nn.Linear(256, 64))
    x = torch.randn(4, 256)
    with torch.no_grad():
        out, reports = compile_run(layer, x, options={**QUANT_IN_KERNEL, "builtin_rules": False, "rules": [str(rules)]})
        expected = layer(x)
    (site,) = sites(reports)
    assert site.rule == "int8_cast" and site.prologue == [] and site.epilogue == ["cast"], site
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, fused, dynamic", slow_except(
    {("int8_dynamic", True, None)},
    [(fmt, fused, dynamic) for fmt, fused in FORMATS for dynamic in (None, True)]))
def test_dynamic_token_count(fmt, fused, dynamic):
    """A symbolic M keeps the prologue, marked (``mark_dynamic``) or everywhere (``dynamic=True``, which also
    makes Python floats the forward reads graph inputs: the layers read their fp8 bound where Dynamo keeps it
    a constant)."""
    torch.manual_seed(9)
    model = quantize(nn.Sequential(nn.Linear(256, 128), nn.GELU()), fmt)
    compiled = torch.compile(model, backend="helion_inductor", options=options_of(fused), dynamic=dynamic)
    for m in (3, 7, 40):
        x = torch.randn(m, 256)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    found = sites(helion_backend.get_reports())
    assert [(site.m, site.prologue, site.kernel) for site in found] == [
        ("dynamic", prologue_of(fmt, fused), KERNEL[fmt])], found


# A Python float global: under torch.compile(dynamic=True), a graph input (a 0-d float64 tensor) of the graphs
# that read it.
LIFTED_FP8_MAX = 448.0


def _per_token_over_a_lifted_float(x, layer):
    x = x.reshape(-1, layer.in_features)  # K static, as the layers have it
    scale = (x.abs().amax(-1, keepdim=True).float() / LIFTED_FP8_MAX).clamp(min=1e-12)
    xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch._scaled_mm(xq, layer.qweight.t(), scale_a=scale, scale_b=layer.weight_scale, out_dtype=torch.float32)


def _per_group_over_a_lifted_float(x, layer):
    (n, k), b = layer.qweight.shape, FP8_BLOCK
    xg = x.reshape(-1, k).reshape(-1, k // b, b)  # K static, as the layers have it
    scale = (xg.abs().amax(-1, keepdim=True).float() / LIFTED_FP8_MAX).clamp(min=1e-12)
    x_dq = ((xg.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale).reshape(-1, k)
    w_dq = (layer.qweight.float().reshape(n // b, b, k // b, b)
            * layer.weight_scale.reshape(n // b, 1, k // b, 1)).reshape(n, k)
    return F.linear(x_dq, w_dq)


@pytest.mark.parametrize("fn, layer_class", [(_per_token_over_a_lifted_float, Fp8DynamicLinear),
                                             (_per_group_over_a_lifted_float, BlockFp8Linear)],
                         ids=["per_token", "per_group"])
def test_quantization_reading_a_lifted_float_names_it(fn, layer_class):
    """A quantization that divides by a float Dynamo made a graph input reads a value known only per call,
    which the kernels cannot compile in: the GEMM fuses without the prologue, and the note names the input."""
    torch.manual_seed(17)
    layer = layer_class.from_linear(nn.Linear(256, 128))
    x = torch.randn(4, 256)
    out, reports = compile_run(functools.partial(fn, layer=layer), x, dynamic=True)
    (site,) = sites(reports)
    assert site.prologue == [], site
    assert any("a 0-d graph input" in note and "dynamic=True" in note for note in site.notes), site.notes
    torch.testing.assert_close(out, fn(x, layer), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Packed int4 weights: only the documented dequantization is a prologue.


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_reference_dequantizes_exactly_as_the_layer(dtype):
    """The reference's dequantization is the layer's own, bit for bit (the rounding of the scale
    product included), for a group size that is not a power of two."""
    torch.manual_seed(10)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(240, 32).to(dtype), group_size=48)
    n, k, g = 32, 240, 48
    q = torch.stack([layer.packed & 15, layer.packed >> 4], dim=-1).reshape(n, k)
    expected = ((q.to(dtype) - 8).reshape(n, k // g, g) * layer.scales.reshape(n, k // g, 1)).reshape(n, k)
    assert torch.equal(dequantize_int4(layer.packed, layer.scales, dtype), expected)


class _Int4Variant(Int4WeightOnlyLinear):
    """The int4 layer with its dequantization written another way (``variant``): a different weight."""

    variant = "documented"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        low, high = self.packed & 15, self.packed >> 4
        zero = 7 if self.variant == "zero_point_7" else 8
        pair = [high, low] if self.variant == "high_nibble_first" else [low, high]
        q = torch.stack(pair, dim=-1).reshape(n, k)
        centered = (q - zero).to(x.dtype) if self.variant == "sub_before_convert" else q.to(x.dtype) - zero
        if self.variant == "groups_across_rows":  # the scales of a row's groups laid out column-major
            scales = self.scales.t().reshape(n, k // g, 1)
        else:
            scales = self.scales.reshape(n, k // g, 1)
        w = (centered.reshape(n, k // g, g) * scales).reshape(n, k)
        return F.linear(x, w, self.bias)


@pytest.mark.parametrize("variant", slow_except({"documented", "high_nibble_first"}, [
    "documented", "zero_point_7", "high_nibble_first", "sub_before_convert", "groups_across_rows"]))
def test_int4_near_misses_stay_unfused_with_a_note(variant):
    """Another zero point, nibble order or scale layout, or a subtraction in uint8 (which wraps around)
    computes another weight: the GEMM is fused without the dequantization, which Inductor keeps, and the
    report says what differs. The documented form (the control) takes the prologue."""
    torch.manual_seed(11)
    layer = _Int4Variant.from_linear(nn.Linear(256, 64), group_size=64)
    layer.variant = variant
    _check_int4_variant(layer, "dequant_int4")


def _check_int4_variant(layer: nn.Module, prologue: str) -> None:
    """The layer's documented form (``variant``) fuses with ``prologue``; any other form fuses without it,
    with a note; both compute what the layer does."""
    x = torch.randn(3, 256)
    with torch.no_grad():
        out, reports = compile_run(layer, x)
        expected = layer(x)
    (site,) = sites(reports)
    if layer.variant == "documented":
        assert (site.prologue, site.kernel, site.notes) == ([prologue], "gemm_int4", []), site
    else:
        assert site.prologue == [] and site.kernel == "gemm", site
        assert any("not as packed int4" in note for note in site.notes), site.notes
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, lead", slow_except({(torch.bfloat16, (5,)), (torch.float32, (2, 3))}, [
    (dtype, lead) for dtype in (torch.float32, torch.bfloat16) for lead in ((5,), (2, 3))]))
def test_int4_zero_points_fuse_as_their_own_prologue_and_match_eager(dtype, lead):
    """``quantize(..., zero_points=True)``: each group's zero point read from the [N, K/G, 2] scales and zero
    points; the site's prologue says so, and the result is the layer's (fresh weights, zero points that
    differ from 8)."""
    torch.manual_seed(13)
    block = Block()
    with torch.no_grad():  # rows shifted off zero: their groups' ranges are not symmetric
        block.proj.weight.add_(0.05 * torch.randn(128, 1))
    model = quantize(block.to(dtype).eval(), "int4_weight_only", group_size=64, zero_points=True)
    zeros = model.proj.scales_and_zeros[:, :, 1]
    assert zeros.min() < 8 < zeros.max() and torch.equal(zeros, zeros.round())
    x, r = torch.randn(*lead, 256, dtype=dtype), torch.randn(*lead, 128, dtype=dtype)
    with torch.no_grad():
        out, reports = compile_run(copy.deepcopy(model), x, r)
        expected = model(x, r)
    (site,) = sites(reports)
    assert (site.kernel, site.prologue, site.notes) == ("gemm_int4", ["dequant_int4_zp"], []), site
    assert sqnr_db(expected, out) >= (90 if dtype == torch.float32 else 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_zero_point_reference_dequantizes_exactly_as_the_layer(dtype):
    """With zero points too, the reference's dequantization is the layer's, bit for bit."""
    torch.manual_seed(14)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(240, 32).to(dtype), group_size=48, zero_points=True)
    n, k, g = 32, 240, 48
    q = torch.stack([layer.packed & 15, layer.packed >> 4], dim=-1).reshape(n, k)
    params = layer.scales_and_zeros
    expected = ((q.to(dtype).reshape(n, k // g, g) - params[:, :, 1:]) * params[:, :, :1]).reshape(n, k)
    assert torch.equal(dequantize_int4(layer.packed, params, dtype), expected)


class _Int4ZeroPointVariant(Int4WeightOnlyLinear):
    """The zero-point int4 layer with its dequantization written another way (``variant``)."""

    variant = "documented"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        q = torch.stack([self.packed & 15, self.packed >> 4], dim=-1).reshape(n, k)
        params = self.scales_and_zeros
        zero, scale = params[:, :, 1:], params[:, :, :1]
        if self.variant == "scale_and_zero_swapped":
            zero, scale = scale, zero
        elif self.variant == "zero_from_another_tensor":
            zero = self.other_zeros[:, :, 1:]
        grouped = q.to(x.dtype).reshape(n, k // g, g)
        centered = zero - grouped if self.variant == "zero_minus_value" else grouped - zero
        return F.linear(x, (centered * scale).reshape(n, k), self.bias)


@pytest.mark.parametrize("variant", slow_except({"documented", "scale_and_zero_swapped"}, [
    "documented", "scale_and_zero_swapped", "zero_from_another_tensor", "zero_minus_value"]))
def test_int4_zero_point_near_misses_stay_unfused_with_a_note(variant):
    """Scale and zero point read from each other's half, from two tensors, or subtracted the other way round
    compute another weight: the GEMM fuses without the dequantization and the report says what differs."""
    torch.manual_seed(15)
    layer = _Int4ZeroPointVariant.from_linear(nn.Linear(256, 64), group_size=64, zero_points=True)
    layer.variant = variant
    layer.register_buffer("other_zeros", layer.scales_and_zeros.clone())
    _check_int4_variant(layer, "dequant_int4_zp")


def test_int4_packed_bytes_shared_with_another_reader_still_fuse():
    """The dequantization is pure: the kernel reads the bytes, Inductor still computes the other reader."""
    torch.manual_seed(12)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(256, 64), group_size=32)

    def fn(x):
        return layer(x), layer.packed.float().sum()

    x = torch.randn(2, 256)
    with torch.no_grad():
        (out, total), reports = compile_run(fn, x)
        expected_out, expected_total = fn(x)
    (site,) = sites(reports)
    assert site.prologue == ["dequant_int4"], site
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    assert total == expected_total


# --------------------------------------------------------------------------------------------------
# Block fp8 written by hand: both dequantizations, exactly so, or neither.


class _BlockFp8Variant(BlockFp8Linear):
    """The block fp8 layer with one of its dequantizations written another way (``variant``)."""

    variant = "documented"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        group = FP8_BLOCK // 2 if self.variant == "activation_groups_of_64" else FP8_BLOCK
        xg = x.reshape(-1, k // group, group)
        scale = (xg.abs().amax(dim=-1, keepdim=True).float() / 448.0).clamp(min=1e-12)
        xq = (xg.float() / scale).clamp(-448.0, 448.0).to(FP8)
        if self.variant == "activation_dequantized_in_model_dtype":  # rounds q * s once more, in bf16
            x_dq = (xq.to(x.dtype) * scale.to(x.dtype)).reshape(-1, k)
        else:
            x_dq = (xq.float() * scale).reshape(-1, k).to(x.dtype)
        b = FP8_BLOCK
        w_dq = (self.qweight.float().reshape(n // b, b, k // b, b)
                * self.weight_scale.reshape(n // b, 1, k // b, 1)).reshape(n, k).to(x.dtype)
        return F.linear(x_dq, w_dq, self.bias)


@pytest.mark.parametrize("variant", slow_except({"activation_groups_of_64"}, [
    "documented", "activation_groups_of_64", "activation_dequantized_in_model_dtype"]))
def test_block_fp8_near_misses_stay_unfused_with_a_note(variant):
    """Activation groups of 64, or a dequantization rounded in bf16, are not the format the kernel
    computes: the GEMM fuses as a float one and the report says what differs."""
    torch.manual_seed(13)
    layer = _BlockFp8Variant.from_linear(nn.Linear(256, 128).to(torch.bfloat16))
    layer.variant = variant
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_run(layer, x)
        expected = layer(x)
    (site,) = sites(reports)
    if variant == "documented":
        assert (site.prologue, site.kernel, site.notes) == (PROLOGUE["fp8_block"], "gemm_fp8_block", []), site
    else:
        assert site.prologue == [] and site.kernel == "gemm", site
        assert any("not as block fp8" in note for note in site.notes), site.notes
    assert sqnr_db(expected, out) >= 40


# --------------------------------------------------------------------------------------------------
# Block fp8 through _scaled_mm with blockwise scales (torch >= 2.9 on SM90). The CPU build has no blockwise
# _scaled_mm, but its meta kernel traces one: layers are built in the dequantize form and switched (past
# the constructor's probe), the fused site runs the reference, and graphs that keep the _scaled_mm are
# analyzed without being run.


def scaled_mm_block_model(k: int, n: int, dtype: torch.dtype, bias: bool = True) -> Block:
    """``Block`` with a block fp8 ``_scaled_mm`` linear whose weight blocks have scales far apart (random
    blocks alone have nearly equal ones, which would hide a transposed scale)."""
    model = Block(k, n)
    b = FP8_BLOCK
    with torch.no_grad():
        spread = torch.exp2(torch.arange((n // b) * (k // b)) % 7 - 3.0).reshape(n // b, 1, k // b, 1)
        model.proj.weight.copy_((model.proj.weight.reshape(n // b, b, k // b, b) * spread).reshape(n, k))
    model = quantize(model.to(dtype).eval(), "fp8_block")
    if not bias:
        model.proj.bias = None
    model.proj.use_scaled_mm = True
    return model


def block_fp8_float64(layer: BlockFp8Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` in float64: x quantized per 1 x 128 group as the layer does, then both operands
    dequantized exactly and multiplied."""
    n, k, b = layer.out_features, layer.in_features, FP8_BLOCK
    xg = x.reshape(-1, k // b, b)
    scale = (xg.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (xg.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    x_dq = (xq.double() * scale.double()).reshape(-1, k)
    w_dq = (layer.qweight.double().reshape(n // b, b, k // b, b)
            * layer.weight_scale.double().reshape(n // b, 1, k // b, 1)).reshape(n, k)
    out = x_dq @ w_dq.t() + (layer.bias.double() if layer.bias is not None else 0)
    return out.reshape(*x.shape[:-1], n)


@pytest.mark.parametrize("dtype, k, n, bias", diagonal(
    Spread([(torch.float32, 256, 256), (torch.bfloat16, 512, 384)]), [True, False]))
def test_block_fp8_scaled_mm_fuses_as_the_hand_written_form(dtype, k, n, bias, tmp_path):
    """Same site, family and steps as the dequantize-then-linear form; the op reads the stored block scales
    (no padding or transpose left per call); on fresh inputs it matches float64 (K = N: a transposed
    scale would go unnoticed by the shapes, not by the values)."""
    torch.manual_seed(14)
    model = scaled_mm_block_model(k, n, dtype, bias)
    x, r = torch.randn(2, 3, k, dtype=dtype), torch.randn(2, 3, n, dtype=dtype)
    with torch.no_grad():
        _, reports = compile_run(copy.deepcopy(model), x, r, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
        dequantize_form = copy.deepcopy(model)
        dequantize_form.proj.use_scaled_mm = False
        _, hand_written = compile_run(dequantize_form, x, r)
    (site,), (expected_site,) = sites(reports), sites(hand_written)
    assert (site.rule, site.kernel, site.prologue, site.epilogue, site.notes) == (
        expected_site.rule, "gemm_fp8_block", PROLOGUE["fp8_block"], expected_site.epilogue, []), site
    assert site.epilogue[:2] == (["bias", "gelu_tanh"] if bias else ["gelu_tanh", "residual"]), site.epilogue
    (after,) = tmp_path.glob("*/after.py")
    assert "aten._scaled_mm" not in after.read_text() and "constant_pad_nd" not in after.read_text()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="helion_inductor", options=CPU_REWRITE)
    for _ in range(2):
        x, r = torch.randn(2, 3, k, dtype=dtype), torch.randn(2, 3, n, dtype=dtype)
        with torch.no_grad():
            out = compiled(x, r)
        assert sites(helion_backend.get_reports())[-1].kernel == "gemm_fp8_block"
        expected = F.gelu(block_fp8_float64(model.proj, x), approximate="tanh") + r.double()
        assert sqnr_db(expected, out) >= (90 if dtype == torch.float32 else 40)


@pytest.mark.parametrize("dynamic", [None, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["mark_dynamic", "dynamic_true"])
def test_block_fp8_scaled_mm_with_a_symbolic_token_count_fuses(dynamic):
    """The blockwise ``_scaled_mm`` form fuses for a symbolic M as for a static one. The token counts stay
    within the Helion limit: above it the unrewritten graph runs, whose blockwise ``_scaled_mm`` the CPU lacks."""
    torch.manual_seed(18)
    model = scaled_mm_block_model(256, 256, torch.bfloat16)
    compiled = torch.compile(model, backend="helion_inductor", options=CPU_REWRITE, dynamic=dynamic)
    for m in (3, 8, 20):
        x, r = torch.randn(m, 256, dtype=torch.bfloat16), torch.randn(m, 256, dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        with torch.no_grad():
            out = compiled(x, r)
        expected = F.gelu(block_fp8_float64(model.proj, x), approximate="tanh") + r.double()
        assert sqnr_db(expected, out) >= 40
    found = sites(helion_backend.get_reports())
    assert [(site.m, site.kernel, site.prologue) for site in found] == [
        ("dynamic", "gemm_fp8_block", PROLOGUE["fp8_block"])], found


def analyze(fn, *args, options: dict | None = None):
    """The backend's report on ``fn``'s graph, traced with fake tensors and not run (the CPU cannot run a
    blockwise ``_scaled_mm``)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from helion_backend.compile.manager import HelionPassManager
    from helion_backend.options import BackendOptions

    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    manager = HelionPassManager(BackendOptions.from_user({**CPU_REWRITE, **(options or {})}))
    manager(gm.graph)
    (report,) = manager.reports
    return report


def block_quantize(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized per 1 x block group: (fp8 [M, K], fp32 scales [M, K/block])."""
    xg = x.reshape(x.shape[0], -1, block)
    scale = (xg.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (xg.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return xq.reshape(x.shape), scale.reshape(x.shape[0], -1)


def _scaled_mm(xq, qweight, scale_a, scale_b):
    return torch._scaled_mm(xq, qweight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def _quantized_here(x, qweight, ws):  # control: the form BlockFp8Linear writes
    xq, scale = block_quantize(x)
    return _scaled_mm(xq, qweight, scale.t().contiguous().t(), ws.t())


def _k_not_a_multiple(x, qweight, ws):  # blockwise shapes by ceil(K / 128), K = 192
    xq, scale = block_quantize(F.pad(x, (0, 64)))
    return _scaled_mm(xq[:, :192], qweight, scale, ws.t())


def _scales_transposed(x, qweight, ws):  # scale_a [M, K/128] in shape, but holding its transpose's values
    xq, scale = block_quantize(x)
    return _scaled_mm(xq, qweight, scale.reshape(scale.shape[1], -1).t(), ws.t())


def _pre_quantized(xq, scale, qweight, ws):  # static: nothing to quantize in the kernel
    return _scaled_mm(xq, qweight, scale, ws.t())


def _activation_and_weight_1x128(x, qweight, ws):  # scale_b [K/128, N]: 1 x 128 weight groups
    xq, scale = block_quantize(x)
    return _scaled_mm(xq, qweight, scale, ws.repeat_interleave(FP8_BLOCK, 0).t())


def _activation_128x128(x, qweight, ws):  # scale_a [M/128, K/128] (M = 4 < 128), scale_b [K/128, N]
    xq, scale = block_quantize(x)
    return _scaled_mm(xq, qweight, scale[:1], ws.repeat_interleave(FP8_BLOCK, 0).t())


@pytest.mark.parametrize("fn, reason", [
    (_quantized_here, None),
    (_k_not_a_multiple, "K=192 and N=256 must be multiples of the block 128"),
    (_scales_transposed, "scale_a is not the activation's [M, K/B] group scales"),
    (_pre_quantized, "the quantized activation is not a reshape"),
    (_activation_and_weight_1x128, "is not per-token, per-channel, per-tensor or 1 x 128 / 128 x 128 blockwise"),
    (_activation_128x128, "is not per-token, per-channel, per-tensor or 1 x 128 / 128 x 128 blockwise"),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_scaled_mm_is_block_fp8_only_when_its_scales_say_so(fn, reason):
    """Blockwise only for scale_a [M, K/128] and scale_b [K/128, N/128] computed as the quantization of the
    GEMM's own activation, and K and N multiples of 128; any other _scaled_mm stays unfused, saying why."""
    torch.manual_seed(15)
    k, n = (192, 256) if fn is _k_not_a_multiple else (256, 256)
    layer = BlockFp8Linear.from_linear(nn.Linear(256 if fn is _k_not_a_multiple else k, n))
    qweight = layer.qweight[:, :k]
    x = torch.randn(4, k, dtype=torch.bfloat16)
    args = block_quantize(x) if fn is _pre_quantized else (x,)
    report = analyze(fn, *args, qweight, layer.weight_scale)
    if reason is None:
        (site,) = report.sites
        assert (site.kernel, site.prologue) == ("gemm_fp8_block", PROLOGUE["fp8_block"]), site
        return
    assert not report.sites, report.summary()
    (unfused,) = report.unfused_gemms
    assert reason in unfused.reason, unfused.reason


def test_block_scaled_mm_never_runs_without_its_prologue(tmp_path):
    """Under rules that take no block fp8 prologue, the _scaled_mm is not fused as a plain fp8 GEMM (that
    would drop its block scales): it stays as it is, and the report says why."""
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "fp8_any"\nanchor = ["scaled_mm"]\nkernel = "gemm_fp8"\nepilogue = ["bias?"]\n')
    torch.manual_seed(16)
    layer = BlockFp8Linear.from_linear(nn.Linear(256, 128))
    report = analyze(_quantized_here, torch.randn(4, 256, dtype=torch.bfloat16), layer.qweight, layer.weight_scale,
                     options={"builtin_rules": False, "rules": [str(rules)]})
    assert not report.sites, report.summary()
    (unfused,) = report.unfused_gemms
    assert "fuses only with its block fp8 prologue" in unfused.reason, unfused.reason
    assert "nearest rule fp8_any (rules.toml:1): dtype torch.bfloat16 not allowed" in unfused.reason, unfused.reason


@pytest.mark.skipif(not hasattr(F, "scaled_mm"), reason="no torch.nn.functional.scaled_mm in this torch")
def test_functional_scaled_mm_is_reported_unfused():
    """``F.scaled_mm`` (``_scaled_mm_v2``, scaling recipes as arguments) has no anchor yet: the report lists it."""
    def fn(xq, scale_a, qweight, scale_b):
        return F.scaled_mm(xq, qweight.t(), scale_a, F.ScalingType.BlockWise1x128, scale_b,
                           F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)

    layer = BlockFp8Linear.from_linear(nn.Linear(256, 128))
    xq, scale = block_quantize(torch.randn(4, 256))
    # The blockwise recipe reads scale_b padded to a multiple of 4 rows, column-major.
    report = analyze(fn, xq, scale.t().contiguous().t(), layer.qweight, F.pad(layer.weight_scale, (0, 2)).t())
    assert not report.sites, report.summary()
    (unfused,) = report.unfused_gemms
    assert unfused.op == "aten._scaled_mm_v2.default" and "no rule anchor" in unfused.reason, unfused


# --------------------------------------------------------------------------------------------------
# vLLM's native fp8 forward, written out as its torch path computes it: QuantFP8.forward_native (dynamic per
# token: max over K without keepdim, unsqueezed back; multiplied by the scale's reciprocal; or per tensor), then
# one of the torch scaled-mm kernels' apply (row-wise: the scales and bias in _scaled_mm; channel-wise: unit
# scales into fp32 and the rescale after; per-tensor), with the weight a [K, N] column-major parameter and the
# output narrowed to the rows and viewed back. (vLLM's int8 W8A8 and weight-only paths call custom ops.)

VLLM_FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


class VllmFp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, kernel: str) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        per_tensor = kernel == "per_tensor"
        amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
        w_scale = (amax / FP8_MAX).clamp(min=1e-12)
        qweight = (w / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self.weight = nn.Parameter(qweight.t(), requires_grad=False)  # [K, N], column-major, as vLLM stores it
        self.weight_scale = nn.Parameter(w_scale.reshape(1) if per_tensor else w_scale, requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.register_buffer("identity", torch.ones(1))
        self.kernel = kernel

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel == "per_tensor":
            x_max = x.abs().max().unsqueeze(-1).to(torch.float32)
        else:
            x_max, _ = x.abs().max(dim=-1)
            x_max = x_max.unsqueeze(-1).to(torch.float32)
        scale = (x_max / FP8_MAX).clamp(min=VLLM_FP8_MIN_SCALE)
        out = x.to(torch.float32) * scale.to(torch.float32).reciprocal()
        return out.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_2d = x.view(-1, x.shape[-1])
        output_shape = [*x.shape[:-1], self.weight.shape[1]]
        xq, x_scale = self.quantize(x_2d)
        if self.kernel == "channel_wise":
            out = torch._scaled_mm(xq, self.weight, scale_a=self.identity, scale_b=self.identity,
                                   out_dtype=torch.float32)
            out = torch.narrow(out, 0, 0, xq.shape[0])
            out = out * torch.narrow(x_scale, 0, 0, xq.shape[0]) * self.weight_scale.t()
            return (out + self.bias).to(x.dtype).view(*output_shape)
        scale_b = self.weight_scale if self.kernel == "per_tensor" else self.weight_scale.t()
        out = torch._scaled_mm(xq, self.weight, out_dtype=x.dtype, scale_a=x_scale, scale_b=scale_b, bias=self.bias)
        return torch.narrow(out, 0, 0, xq.shape[0]).view(*output_shape)


VLLM_SCALES = {"row_wise": ["token_scale", "channel_scale", "bias"],
               "channel_wise": ["tensor_scale", "tensor_scale", "token_scale", "channel_scale", "bias"],
               "per_tensor": ["tensor_scale", "tensor_scale", "bias"]}


@pytest.mark.parametrize("kernel, fused", diagonal(sorted(VLLM_SCALES), [False, True]))
def test_vllm_native_fp8_forms_fuse_and_match_eager(kernel, fused):
    """Each form fuses as one fp8 site with its scales, bias, GELU and residual. The per-token quantization
    is recognized (the note by default, the prologue with fuse_activation_quant, the token scale becoming
    act_scale); a per-tensor one is not per token: Inductor computes it, and the site reads its scale."""
    torch.manual_seed(20)
    model = Block()
    model.proj = VllmFp8Linear(model.proj, kernel)
    x, r = torch.randn(2, 3, 256), torch.randn(2, 3, 128)
    with torch.no_grad():
        out, reports = compile_run(copy.deepcopy(model).eval(), x, r, options=options_of(fused))
        expected = model(x, r)
    (site,) = sites(reports)
    scales = list(VLLM_SCALES[kernel])
    per_token = kernel != "per_tensor"
    if per_token and fused:
        scales[scales.index("token_scale")] = "act_scale"
    assert (site.kernel, site.prologue) == ("gemm_fp8", ["quant_fp8_per_token"] if per_token and fused else []), site
    assert site.epilogue[:len(scales)] == scales and site.epilogue[-2:] == ["gelu_tanh", "residual"], site.epilogue
    left = [f"activation quantization (quant_fp8_per_token) {LEFT_TO_INDUCTOR}" in note for note in site.notes]
    assert left == ([True] if per_token and not fused else []), site.notes
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def torchao_int8_cuda_form(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor) -> torch.Tensor:
    """torchao 0.18's W8A8 linear as it runs on CUDA (``int_scaled_matmul`` without its Triton autotuner):
    ``_int_mm`` times the token scale expanded to [M, N], in the int32 result's promotion to fp32, cast to
    the model's dtype, then the channel scale and the bias. Its symmetric scale is max(-min(x), max(x)) / 127.5."""
    zero = torch.zeros((), dtype=x.dtype)
    absmax = torch.maximum(-torch.minimum(x.amin(-1, keepdim=True), zero), torch.maximum(x.amax(-1, keepdim=True), zero))
    scale = (absmax / 127.5).float().clamp(min=torch.finfo(torch.float32).eps).to(x.dtype).float()
    xq = (x * scale.reciprocal()).round().clamp(-128, 127).to(torch.int8)
    m, n = x.shape[0], qweight.shape[0]
    y = (torch._int_mm(xq, qweight.t()) * scale.expand(m, n)).to(x.dtype)
    return y * w_scale + bias


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_torchao_int8_cuda_form_fuses_and_matches_eager(dtype):
    """The token scale multiplies the int32 result with no cast before it, and through an expand: the same
    site as the CPU form (``token_scale`` reads the [M, 1] scale)."""
    torch.manual_seed(21)
    layer = Int8DynamicLinear.from_linear(nn.Linear(256, 64).to(dtype))
    x = torch.randn(17, 256, dtype=dtype)
    args = (layer.qweight, layer.weight_scale, layer.bias)
    out, reports = compile_run(lambda v: F.gelu(torchao_int8_cuda_form(v, *args), approximate="tanh"), x)
    (site,) = sites(reports)
    assert (site.kernel, site.prologue) == ("gemm_int8", []), site
    assert site.epilogue[:3] == ["token_scale", "cast", "channel_scale"] or (
        dtype == torch.float32 and site.epilogue[:2] == ["token_scale", "channel_scale"]), site.epilogue
    assert site.epilogue[-1] == "gelu_tanh", site.epilogue
    expected = F.gelu(torchao_int8_cuda_form(x, *args), approximate="tanh")
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        assert sqnr_db(expected, out) >= 40
