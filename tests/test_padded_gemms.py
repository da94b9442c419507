"""GEMMs on zero-padded operands, as Inductor's ``pad_mm`` writes them on CUDA for an unaligned M, K or N:
each site multiplies the unpadded operands, so it has the model's M, K and N and fuses the epilogue after
the slices that cut the product back. The CPU tests write pad_mm's graph by hand (pad_mm runs on CUDA only);
the GPU test lets Inductor pad."""

from __future__ import annotations

import pytest
import torch
from helpers import TOLERANCE, compile_run, rel_err, sites

import helion_backend


def pad_mm_addmm(x, w, b, q, r, pad_m: int = 3, pad_k: int = 8, pad_n: int = 5):
    """``(x @ w.t() + b) * q + r`` in pad_mm's form: both operands padded with zeros (M, K, N), the bias
    along N by ``cat`` with zeros, the product's padded rows and columns sliced off."""
    xp = torch.constant_pad_nd(x, [0, pad_k, 0, pad_m])
    wp = torch.constant_pad_nd(w.t(), [0, pad_n, 0, pad_k])
    bp = torch.cat([b, b.new_zeros(pad_n)])
    return torch.addmm(bp, xp, wp)[:-pad_m][:, :-pad_n] * q + r


def padded_k_mm(x, w, r):
    """K padded on both operands only: no slice, the product has the model's shape."""
    return torch.constant_pad_nd(x, [0, 7]) @ torch.constant_pad_nd(w, [0, 0, 0, 7]) + r


def padded_product_read_twice(x, w, r):
    """The padded product has a second reader: the unpadded site would not be all it computes."""
    y = torch.constant_pad_nd(x, [0, 0, 0, 3]) @ w
    return y[:-3] + r, y.sum()


def nonzero_padding(x, w, r):
    """Padding with ones adds to the product: nothing to see through."""
    return (torch.constant_pad_nd(x, [0, 4], 1.0) @ torch.constant_pad_nd(w, [0, 0, 0, 4], 1.0)) + r


def _inputs(*shapes, gen):
    return [torch.randn(*s, generator=gen) for s in shapes]


def _only_site(reports):
    (site,) = sites(reports)
    return site


def test_pad_mm_addmm_is_one_site_of_the_unpadded_shape():
    m, k, n = 5, 40, 75
    x, w, b, q, r = _inputs((m, k), (n, k), (n,), (m, n), (m, n), gen=torch.Generator().manual_seed(0))
    out, reports = compile_run(pad_mm_addmm, x, w, b, q, r)
    assert rel_err(out, pad_mm_addmm(*(t.double() for t in (x, w, b, q, r)))) < TOLERANCE[torch.float32]
    site = _only_site(reports)
    assert (site.m, site.k, site.n) == (m, k, n), site
    assert site.epilogue == ["bias", "mul", "residual"] and site.runs_on == "reference", site


def test_k_padding_alone_is_seen_through():
    x, w, r = _inputs((6, 57), (57, 40), (6, 40), gen=torch.Generator().manual_seed(1))
    out, reports = compile_run(padded_k_mm, x, w, r)
    assert rel_err(out, padded_k_mm(x.double(), w.double(), r.double())) < TOLERANCE[torch.float32]
    site = _only_site(reports)
    assert (site.m, site.k, site.n) == (6, 57, 40) and site.epilogue == ["residual"], site


def test_a_padded_product_with_another_reader_keeps_its_padding():
    x, w, r = _inputs((5, 32), (32, 24), (5, 24), gen=torch.Generator().manual_seed(2))
    (out, total), reports = compile_run(padded_product_read_twice, x, w, r)
    want, want_total = padded_product_read_twice(x.double(), w.double(), r.double())
    assert rel_err(out, want) < TOLERANCE[torch.float32] and rel_err(total, want_total) < TOLERANCE[torch.float32]
    assert {(s.m, s.k, s.n) for s in sites(reports)} == {(8, 32, 24)}, [r.summary() for r in reports]


def test_padding_with_a_nonzero_value_is_not_seen_through():
    x, w, r = _inputs((4, 28), (28, 20), (4, 20), gen=torch.Generator().manual_seed(3))
    out, reports = compile_run(nonzero_padding, x, w, r)
    assert rel_err(out, nonzero_padding(x.double(), w.double(), r.double())) < TOLERANCE[torch.float32]
    assert {(s.m, s.k, s.n) for s in sites(reports)} == {(4, 32, 20)}, [r.summary() for r in reports]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_inductor_padding_leaves_the_models_shape_on_the_gpu(dtype, monkeypatch):
    """With Inductor padding every unaligned GEMM, each site still has the model's M, K and N and fuses
    its epilogue (an unaligned N once left the bias and multiply outside a site of the padded N)."""
    from torch._inductor import config as inductor_config

    monkeypatch.setattr(inductor_config, "force_shape_pad", True)
    m, k, n = 9, 136, 259
    gen = torch.Generator(device="cuda").manual_seed(4)
    x, w, b, q = (torch.randn(*s, generator=gen, device="cuda").to(dtype) for s in ((m, k), (n, k), (n,), (m, n)))

    def biased_gate(x, w, b, q):
        return torch.nn.functional.linear(x, w, b) * q

    helion_backend.clear_reports()
    out = torch.compile(biased_gate, backend="helion_inductor", options={"untuned_sites": "helion"})(x, w, b, q)
    reports = helion_backend.get_reports()
    want = biased_gate(*(t.double() for t in (x, w, b, q)))
    assert rel_err(out, want) <= max(TOLERANCE[dtype], 3 * rel_err(biased_gate(x, w, b, q), want))
    site = _only_site(reports)
    assert (site.m, site.k, site.n) == (m, k, n), [r.summary() for r in reports]
    assert site.epilogue == ["bias", "mul"] and site.runs_on == "helion", [r.summary() for r in reports]
