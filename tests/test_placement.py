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
