"""Sibling fusions on quantized rows (fp8 and W8A8 int8, activation quantized by Inductor, the default):
q, k and v in one launch (``gemm_multi_fp8`` / ``gemm_multi_int8``) and gate/up in one kernel
(``gemm_glu_fp8`` / ``gemm_glu_int8``): which sites merge, the report, the reasons when they do not, and
the compiled decoder block against the unfused quantized graph (the CPU reference path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import CPU_REWRITE, WITHOUT_GATED, compile_run, diagonal, rel_err, sites, slow_except

from helion_backend.layers.quantize import quantize
from helion_backend.vocabulary import GLU_FP8_FAMILY, GLU_INT8_FAMILY, MULTI_GEMM_FAMILIES

D, KV, FF = 64, 32, 128
FORMATS = {"fp8_dynamic": ("gemm_fp8", GLU_FP8_FAMILY), "int8_dynamic": ("gemm_int8", GLU_INT8_FAMILY)}
# The unfused quantized graph: every site alone, gate and up apart.
UNFUSED = {**WITHOUT_GATED, "merge_siblings": False}


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class Block(nn.Module):
    """A decoder layer's GEMMs: q, k, v of the normed input, an output projection, then a SwiGLU MLP of the
    normed residual sum (attention left out: it does not touch the GEMM sites)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D, bias=False), nn.Linear(D, KV, bias=False), nn.Linear(D, KV, bias=False)
        self.o = nn.Linear(D + 2 * KV, D, bias=False)
        self.gate, self.up, self.down = (nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False),
                                         nn.Linear(FF, D, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms(x)
        a = x + self.o(torch.cat([self.q(h), self.k(h), self.v(h)], -1))
        h = rms(a)
        return a + self.down(F.silu(self.gate(h)) * self.up(h))


def block(fmt: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return quantize(Block().to(torch.bfloat16).eval(), fmt)


def by_anchor(found):
    return {s.anchor: s for s in found}


@pytest.mark.parametrize("fmt, shape", diagonal(list(FORMATS), [(5, D), (2, 3, D)]))
def test_qkv_share_a_launch_and_gate_up_one_kernel(fmt, shape, op_calls):
    member, glu = FORMATS[fmt]
    model = block(fmt)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_run(model, x)
    found = sites(reports)
    kernels = sorted(s.kernel for s in found)
    assert kernels == sorted([MULTI_GEMM_FAMILIES[member]] * 3 + [member, glu, member]), kernels
    qkv = [s for s in found if s.kernel == MULTI_GEMM_FAMILIES[member]]
    assert all(any(f"one launch ({MULTI_GEMM_FAMILIES[member]})" in n and "same quantized rows" in n
                   for n in s.notes) for s in qkv), [s.notes for s in qkv]
    (gated,) = [s for s in found if s.kernel == glu]
    assert gated.rule == glu.replace("gemm_glu", "gated_mlp") and "up_mul" in gated.epilogue
    assert any("the up projection" in n and "runs in the same kernel" in n for n in gated.notes), gated.notes
    # q/k/v one launch, o, gate/up, down: four fused ops instead of seven.
    assert op_calls.launches == 4 and op_calls.count == 6


@pytest.mark.parametrize("fmt", slow_except(list(FORMATS)[:1], list(FORMATS)))
@pytest.mark.slow
def test_fused_block_matches_the_unfused_quantized_graph_on_fresh_inputs(fmt):
    """The same compile on new random rows (never zeros), against the graph with every site alone."""
    model = block(fmt, seed=1)
    fused = torch.compile(model, backend="helion_inductor", options=dict(CPU_REWRITE))
    with torch.no_grad():
        for seed in range(3):
            torch.manual_seed(100 + seed)
            x = torch.randn(6, D, dtype=torch.bfloat16) * (1 + seed)
            ref, _ = compile_run(model, x, options=UNFUSED)
            torch._dynamo.reset()
            got = fused(x)
            # The fused kernels keep gate and up in fp32 where the graph rounds each to bf16 first.
            assert rel_err(got, ref) <= 2e-2, seed
            assert rel_err(got, model(x)) <= 5e-2, seed


def test_the_fused_ops_compute_what_the_separate_sites_do(op_calls):
    """The rewritten gate/up and q/k/v read the first site's rows and token scale: against eager on the
    quantized model, each output of the q/k/v launch and the gated product, checked directly."""
    model = block("fp8_dynamic", seed=2)

    def parts(x):
        h = rms(x)
        return model.q(h), model.k(h), model.v(h), F.silu(model.gate(h)) * model.up(h)

    x = torch.randn(7, D, dtype=torch.bfloat16)
    with torch.no_grad():
        got, reports = compile_run(parts, x)
        # Inductor's norm may round a few rows differently from eager's before they are quantized, and eager
        # rounds gate and up to bf16 before their product.
        for out, ref in zip(got, parts(x)):
            assert rel_err(out, ref) <= 3e-2
    assert op_calls.launches == 2 and op_calls.count == 4


def test_option_off_and_without_gated_rules_every_site_is_alone(op_calls):
    with torch.no_grad():
        _, reports = compile_run(block("fp8_dynamic"), torch.randn(4, D, dtype=torch.bfloat16), options=UNFUSED)
    assert sorted(s.kernel for s in sites(reports)) == ["gemm_fp8"] * 7
    assert op_calls.launches == 7


def test_an_up_projection_read_elsewhere_is_not_absorbed():
    model = block("fp8_dynamic")

    def fn(x):
        up = model.up(x)
        return F.silu(model.gate(x)) * up, up.sum()

    with torch.no_grad():
        _, reports = compile_run(fn, torch.randn(4, D, dtype=torch.bfloat16))
    found = by_anchor(sites(reports))
    assert all(s.kernel == "gemm_fp8" for s in found.values()), found
    notes = [n for s in found.values() for n in s.notes if n.startswith("gate and up projections not fused")]
    assert notes and "is also read by" in notes[0], notes


def test_quantizations_of_different_rows_are_not_merged():
    """Gate of one activation, up of another: equal shapes, different rows. (k and the gate read x, v and up
    read y: those pairs may share launches.)"""
    model = block("fp8_dynamic")

    def fn(x, y):
        return model.k(x), model.v(y), F.silu(model.gate(x)) * model.up(y)

    x, y = torch.randn(4, D, dtype=torch.bfloat16), torch.randn(4, D, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_run(fn, x, y)
        for o, r in zip(out, fn(x, y)):
            assert rel_err(o, r) <= 1e-2
    assert GLU_FP8_FAMILY not in [s.kernel for s in sites(reports)]


def test_same_rows_under_another_token_scale_stay_apart_with_a_note():
    """Pre-quantized rows multiplied under two different [M, 1] scales: nothing proves either belongs to the
    rows, so neither the shared launch nor the gated kernel takes them."""
    model = block("fp8_dynamic")
    gate, up = model.gate, model.up

    def fn(xq, s1, s2):
        g = torch._scaled_mm(xq, gate.qweight.t(), scale_a=s1, scale_b=gate.weight_scale, out_dtype=torch.bfloat16)
        u = torch._scaled_mm(xq, up.qweight.t(), scale_a=s2, scale_b=up.weight_scale, out_dtype=torch.bfloat16)
        return F.silu(g) * u

    xq = (torch.randn(4, D) * 50).clamp(-400, 400).to(torch.float8_e4m3fn)
    s1, s2 = torch.rand(4, 1) + 0.1, torch.rand(4, 1) + 0.1
    with torch.no_grad():
        out, reports = compile_run(fn, xq, s1, s2)
    assert rel_err(out, fn(xq, s1, s2)) <= 1e-2
    found = sites(reports)
    assert all(s.kernel == "gemm_fp8" for s in found), [s.kernel for s in found]
    notes = [n for s in found for n in s.notes]
    assert any("another token scale" in n for n in notes), notes


def test_fuse_activation_quant_keeps_gate_and_up_apart():
    """With the quantization in the GEMM's prologue the sites are no rows-quantized-before-the-GEMM pair."""
    with torch.no_grad():
        _, reports = compile_run(block("fp8_dynamic"), torch.randn(4, D, dtype=torch.bfloat16),
                                 options={**CPU_REWRITE, "fuse_activation_quant": True})
    kernels = [s.kernel for s in sites(reports)]
    assert GLU_FP8_FAMILY not in kernels and "gemm_multi_fp8" not in kernels, kernels


@pytest.mark.slow
def test_dynamic_token_count_fuses_both(op_calls):
    model = block("fp8_dynamic")
    compiled = torch.compile(model, backend="helion_inductor", options=dict(CPU_REWRITE))
    rows = [torch.randn(m, D, dtype=torch.bfloat16) for m in (3, 9)]
    for x in rows:
        torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        refs = [compile_run(model, x, options=UNFUSED)[0] for x in rows]  # one symbolic-M graph serves both
        torch._dynamo.reset()
        for x, ref in zip(rows, refs):
            assert rel_err(compiled(x), ref) <= 2e-2, x.shape[0]
