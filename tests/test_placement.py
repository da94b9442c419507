"""Placement of a CUDA site by M: the crossover for any M, the config table's verdict for a static M.

The decision is made from the site's shape and the tables alone, so fakes stand in for the site, the
options and the tables (no GPU, no graph)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helion_backend import dispatch
from helion_backend.kernels.configs import Verdict
from helion_backend.passes import placement

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here
K, N = 4096, 1024


@pytest.fixture
def tables(monkeypatch):
    """A table whose crossover at (K, N) is M = 1 (a loss at 2) and whose verdicts are set per M."""
    verdicts: dict[int, Verdict] = {}
    monkeypatch.setattr(dispatch, "helion_unavailable_reason", lambda: None)
    monkeypatch.setattr(dispatch, "helion_size_limit",
                        lambda *args: (1, f"measured crossover M=1 at K={K}, N={N} (config table)"))
    monkeypatch.setattr(dispatch, "measured_verdict", lambda m, *args: verdicts.get(m))
    return verdicts


def place(m: int | None, max_helion_size: int = 32) -> tuple[str, str | None, int]:
    site = SimpleNamespace(k=K, dtype=torch.bfloat16, device=CUDA, static_m=m)
    ctx = SimpleNamespace(options=SimpleNamespace(max_helion_size=max_helion_size, config_dir=""))
    return placement.place(site, ctx, "gemm", N)


def test_a_static_m_the_table_measured_helion_winning_runs_helion_above_the_crossover(tables):
    tables.update({1: Verdict(1, True), 2: Verdict(2, False), 8: Verdict(8, True)})
    runs_on, why, limit = place(8)
    assert (runs_on, limit) == ("helion", 8)  # the fused op must not send M = 8 to its fallback
    assert "Helion measured faster at M=8" in why
    assert place(1) == ("helion", None, 1)


def test_a_static_m_the_table_measured_losing_stays_with_inductor(tables):
    tables.update({1: Verdict(1, True), 2: Verdict(2, False)})
    runs_on, why, limit = place(2)
    assert (runs_on, limit) == ("inductor", 1)
    assert "measured faster at M=2, K=4096, N=1024" in why


def test_without_a_verdict_the_crossover_decides(tables):
    runs_on, why, _ = place(16)
    assert runs_on == "inductor" and "M=16 > measured crossover M=1" in why
    # A dynamic M is routed at run time up to the crossover.
    assert place(None) == ("helion", "M is dynamic: Helion when M <= 1 at run time, cuBLAS above", 1)


def test_max_helion_size_bounds_every_verdict(tables):
    tables.update({8: Verdict(8, True)})
    runs_on, why, _ = place(8, max_helion_size=4)
    assert runs_on == "inductor" and "M=8 >" in why


def place_site(k: int, dtype: torch.dtype, tf32: bool) -> tuple[str, str | None, int]:
    site = SimpleNamespace(k=k, dtype=dtype, device=CUDA, static_m=1)
    ctx = SimpleNamespace(options=SimpleNamespace(max_helion_size=32, config_dir=""), tf32=tf32)
    return placement.place(site, ctx, "gemm", N)


@pytest.mark.parametrize("k", [1, 7, placement.MIN_KERNEL_K - 1])
def test_a_k_too_short_for_a_dot_stays_with_inductor(tables, k):
    runs_on, why, _ = place_site(k, torch.bfloat16, tf32=False)
    assert runs_on == "inductor" and f"K={k} < {placement.MIN_KERNEL_K}" in why
    assert place_site(placement.MIN_KERNEL_K, torch.bfloat16, tf32=False)[0] == "helion"


def test_float32_follows_pytorchs_tf32_setting(tables):
    """The kernels dot float32 in full precision: where PyTorch may use TF32 the site is Inductor's, whose GEMM
    then does as PyTorch does; 16-bit sites do not depend on the setting."""
    runs_on, why, _ = place_site(K, torch.float32, tf32=True)
    assert runs_on == "inductor" and "TF32 allowed" in why
    assert place_site(K, torch.float32, tf32=False)[0] == "helion"
    assert place_site(K, torch.bfloat16, tf32=True)[0] == "helion"
