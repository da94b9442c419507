"""GEMMs too small for a kernel, as decoders write them: a rotary embedding's ``inv_freq @ position_ids``
(K = 1, float32) stays with Inductor, says why in the report, and the graph computes what eager does."""

from __future__ import annotations

import torch
from helpers import compile_run, rel_err, sites

from helion_backend.compile import placing
from helion_backend.compile.manager import HelionPassManager
from helion_backend.options import BackendOptions


def rotary_angles(inv_freq: torch.Tensor, position_ids: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """A rotary embedding's product of frequencies by positions (K = 1) beside a real projection. Hugging
    Face writes it as a batched product of expanded views, which reaches the post-grad graph of a CUDA
    compile as this ``mm`` (on the CPU Inductor keeps the batched form, so the test writes the ``mm``)."""
    freqs = (inv_freq[:, None] @ position_ids.float()).t()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin(), x @ w


def test_the_rotary_product_stays_with_inductor_and_matches_eager():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    position_ids = torch.arange(7)[None, :]
    x, w = torch.randn(7, 64), torch.randn(64, 32)
    (cos, sin, y), reports = compile_run(rotary_angles, inv_freq, position_ids, x, w)
    expected = rotary_angles(inv_freq, position_ids, x, w)
    for got, want in zip((cos, sin, y), expected):
        assert rel_err(got, want) < 1e-6
    by_k = {s.k: s for s in sites(reports)}
    assert set(by_k) == {1, 64}, [r.summary() for r in reports]
    assert by_k[1].runs_on == "inductor" and f"K=1 < {placing.MIN_KERNEL_K}" in by_k[1].why
    assert by_k[64].runs_on == "reference"


def test_the_tf32_setting_is_part_of_the_cache_key(monkeypatch):
    """A graph compiled with TF32 allowed must not be served to a process that forbids it (its float32
    sites are placed otherwise)."""
    options = BackendOptions()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    full = HelionPassManager(options).uuid()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    assert HelionPassManager(options).uuid() != full
