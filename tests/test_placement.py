"""Placement of a CUDA site by M and by what the config tables measured: the key's own entry, its
neighbours in M, close shapes, or nothing (Inductor, at torch.compile's speed).

The decision is made from the site's shape and the tables alone, so a fake site and a table written to a
temporary folder stand in for the graph and the GPU (no GPU runs)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from helion_backend import environment, tables
from helion_backend.compile import placing
from helion_backend.kernels import configs
from helion_backend.options import BackendOptions

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here
K, N = 4096, 1024


def timed(m: int, lead: float, k: int = K, n: int = N) -> dict:
    """A table entry whose Helion time is ``1 / lead`` of the fallback's."""
    return {"dtype": "bfloat16", "k": k, "n": n, "m": m, "us": 10.0, "fallback_us": 10.0 * lead,
            "helion_wins": lead > 1,
            "config": {"block_sizes": [16, 64, 256], "num_warps": 4, "num_stages": 3, "split_k": 1}}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """Writes the shipped table of a fake GPU (no user table), with Helion available."""
    monkeypatch.setattr(tables, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    monkeypatch.setattr(environment, "helion_unavailable_reason", lambda: None)
    configs.forget_tables()

    def write(*entries: dict) -> None:
        (tmp_path / "test_gpu.json").write_text(json.dumps({"entries": list(entries)}))
        configs.forget_tables()

    yield write
    configs.forget_tables()


def place(m: int | None, k: int = K, n: int = N, **options) -> placing.Placement:
    site = SimpleNamespace(k=k, dtype=torch.bfloat16, device=CUDA, static_m=m)
    ctx = SimpleNamespace(options=BackendOptions(cache_dir="/nonexistent", **options))
    return placing.place(site, ctx, "gemm", n)


def test_a_static_m_the_table_measured_helion_winning_runs_helion(table):
    table(timed(1, 1.3), timed(2, 0.9), timed(8, 1.2))
    placed = place(8)
    assert (placed.runs_on, placed.evidence, placed.untuned) == ("helion", {"8": "exact"}, False)
    assert placed.max_helion_m >= 8  # the fused op must not send M = 8 to its fallback
    assert "Helion measured faster at M=8 (evidence exact, Helion 1.20x" in placed.why


def test_a_static_m_the_table_measured_losing_stays_with_inductor(table):
    table(timed(1, 1.3), timed(2, 0.9))
    placed = place(2)
    assert (placed.runs_on, placed.evidence) == ("inductor", {"2": "exact"})
    assert "cuBLAS + Inductor's epilogue measured faster at M=2 (evidence exact" in placed.why


def test_an_untuned_key_stays_with_inductor_and_says_why(table):
    table(timed(1, 1.3), timed(8, 1.2))  # K x N = 4096 x 1024 only
    placed = place(8, k=2048, n=8192)  # Llama-3.2-1B's up projection: nothing within 1.5x of it was tuned
    assert (placed.runs_on, placed.evidence, placed.untuned) == ("inductor", {"8": "none"}, True)
    assert "no config table entry at or close to M=8, K=2048, N=8192 (evidence none)" in placed.why
    assert "python -m helion_backend tune" in placed.why
    # An M above every tuned M of the shape: no verdict is extrapolated upward.
    assert place(16).evidence == {"16": "none"} and place(16).runs_on == "inductor"


def test_an_untuned_key_near_a_shape_that_kept_its_lead_runs_helion(table):
    table(timed(1, 1.4), timed(4, 1.3), timed(8, 1.25), timed(16, 1.1))
    placed = place(4, n=1280)  # N within 1.5x of a shape Helion led by more than 15% up to M = 4
    assert (placed.runs_on, placed.evidence) == ("helion", {"4": "predicted"})
    assert "Helion measured faster at M=4, K=4096, N=1024 (evidence predicted" in placed.why
    # Its M = 16 lead (10%) is too thin to lend: Inductor.
    assert place(16, n=1280).runs_on == "inductor" and place(16, n=1280).evidence == {"16": "predicted"}


def test_an_untuned_m_between_two_winning_ms_runs_helion(table):
    table(timed(4, 1.2), timed(8, 1.1))
    placed = place(6)
    assert (placed.runs_on, placed.evidence) == ("helion", {"6": "nearest"})


def test_untuned_keys_run_helion_where_the_options_say(table):
    table()
    placed = place(8, untuned_sites="helion")
    assert (placed.runs_on, placed.evidence, placed.untuned) == ("helion", {"8": "none"}, True)
    assert "untuned_sites='helion'" in placed.why
    tuned_first = place(8, autotune_missing=True)
    assert tuned_first.runs_on == "helion" and "autotune_missing tunes it before the first run" in tuned_first.why


def test_a_dynamic_m_runs_helion_up_to_the_first_m_without_a_winning_verdict(table):
    table(timed(1, 1.3), timed(2, 1.2), timed(4, 1.2), timed(8, 1.1), timed(16, 0.95), timed(32, 1.1))
    placed = place(None)
    assert (placed.runs_on, placed.max_helion_m) == ("helion", 8)
    assert placed.why.startswith("M is dynamic: Helion when M <= 8 at run time, cuBLAS above (at M=16: cuBLAS")
    assert placed.evidence == {"1": "exact", "2": "exact", "4": "exact", "8": "exact", "16": "exact"}
    assert not placed.untuned
    # Without the loss, the limit stops where the table stops: 32 is tuned, but not max_helion_size = 64.
    table(timed(1, 1.3), timed(32, 1.2))
    wider = place(None, max_helion_size=64)
    assert wider.max_helion_m == 32 and wider.evidence["64"] == "none" and wider.untuned


def test_a_dynamic_m_without_any_measurement_stays_with_inductor(table):
    table()
    placed = place(None)
    assert (placed.runs_on, placed.untuned) == ("inductor", True)
    assert placed.why.startswith("M is dynamic; at M=1: no config table entry")
    assert place(None, untuned_sites="helion")[:3] == ("helion", (
        "M is dynamic: Helion when M <= 32 at run time, cuBLAS above (no config table entry at some M: "
        "untuned_sites='helion': the default config, untimed)"), 32)


def test_max_helion_size_bounds_every_verdict(table):
    table(timed(8, 1.5))
    placed = place(8, max_helion_size=4)
    assert placed.runs_on == "inductor" and "M=8 > max_helion_size=4" in placed.why


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="option 'untuned_sites' must be one of \\['inductor', 'helion'\\]"):
        BackendOptions.from_user({"untuned_sites": "cublas"})


def place_site(k: int, dtype: torch.dtype, tf32: bool) -> placing.Placement:
    site = SimpleNamespace(k=k, dtype=dtype, device=CUDA, static_m=1)
    ctx = SimpleNamespace(options=BackendOptions(cache_dir="/nonexistent", untuned_sites="helion"), tf32=tf32)
    return placing.place(site, ctx, "gemm", N)


@pytest.mark.parametrize("k", [1, 7, placing.MIN_KERNEL_K - 1])
def test_a_k_too_short_for_a_dot_stays_with_inductor(table, k):
    placed = place_site(k, torch.bfloat16, tf32=False)
    assert placed.runs_on == "inductor" and f"K={k} < {placing.MIN_KERNEL_K}" in placed.why
    assert place_site(placing.MIN_KERNEL_K, torch.bfloat16, tf32=False).runs_on == "helion"


def test_float32_follows_pytorchs_tf32_setting(table):
    """The kernels dot float32 in full precision: where PyTorch may use TF32 the site is Inductor's, whose GEMM
    then does as PyTorch does; 16-bit sites do not depend on the setting."""
    placed = place_site(K, torch.float32, tf32=True)
    assert placed.runs_on == "inductor" and "TF32 allowed" in placed.why
    assert place_site(K, torch.float32, tf32=False).runs_on == "helion"
    assert place_site(K, torch.bfloat16, tf32=True).runs_on == "helion"
