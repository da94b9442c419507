"""Tensor parallelism: every rank fuses its own GEMMs at its own shapes, and the collectives between them are
left as they are.

Two processes (gloo on the CPU, NCCL on two GPUs) run every case of :mod:`tensor_parallel` once, started
together: an MLP and a Llama-style decoder layer sharded with DTensor's ``parallelize_module`` and by hand
with functional collectives, at prefill, decode and dynamic token counts. The graph-level tests below trace
functions with collectives (fake tensors, no process group) and run the backend's pass on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import tensor_parallel as tp
import torch
import torch.nn.functional as F
from helpers import TOLERANCE, randn
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from helion_backend.compile.manager import HelionPassManager
from helion_backend.options import BackendOptions

WORLD = 2
TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
RANKS_TIMEOUT_S = 540  # both ranks, every case: about 50 s of two idle cores

c10d = torch.ops._c10d_functional


# --------------------------------------------------------------------------------------------------
# The ranks


def run_ranks(out: Path, device: str, cases: tuple[str, ...]) -> list[dict]:
    """Start ``WORLD`` worker processes on one file store, wait for all of them (killing them all when one
    fails or time runs out) and return each rank's results."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(TESTS_DIR / "tensor_parallel.py"), "--world", str(WORLD),
               "--init", f"file://{out / 'store'}", "--out", str(out), "--device", device, "--cases", ",".join(cases)]
    logs = [open(out / f"rank{rank}.log", "w") for rank in range(WORLD)]
    ranks = [subprocess.Popen([*command, "--rank", str(rank)], env=env, stdout=log, stderr=subprocess.STDOUT)
             for rank, log in enumerate(logs)]
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        while any(rank.poll() is None for rank in ranks):
            if time.monotonic() > deadline or any(rank.poll() not in (None, 0) for rank in ranks):
                break
            time.sleep(0.2)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()
        for log in logs:
            log.close()
    failed = [(i, rank.returncode) for i, rank in enumerate(ranks) if rank.returncode != 0]
    if failed:
        tails = "\n".join(f"--- rank {i} (exit {code}) ---\n" + (out / f"rank{i}.log").read_text()[-3000:]
                          for i, code in failed)
        pytest.fail(f"tensor-parallel ranks failed or ran past {RANKS_TIMEOUT_S} s:\n{tails}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


# Two CPU ranks take about 90 s on two cores: slow (CI runs them); the graph-level tests below run by default.
@pytest.fixture(scope="module", params=[pytest.param("cpu", marks=pytest.mark.slow),
                                        pytest.param("cuda", marks=pytest.mark.gpu)])
def ranks(request, tmp_path_factory) -> list[dict]:
    if request.param == "cuda" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    return run_ranks(tmp_path_factory.mktemp(f"tp_{request.param}"), request.param, tp.QUICK_CASES)


def case_results(ranks: list[dict]):
    for result in ranks:
        for name, case in result["cases"].items():
            assert "failure" not in case, f"rank {result['rank']}, {name}:\n{case['failure']}"
            yield result, tp.ALL_CASES[name], case


# --------------------------------------------------------------------------------------------------
# What every rank must see


def assert_outputs_match(ranks: list[dict]) -> None:
    for result, case, outcome in case_results(ranks):
        tolerance = TOLERANCE[getattr(torch, result["dtype"])]
        assert len(outcome["errors"]) == len(tp.TOKEN_COUNTS[case.shape])
        assert max(outcome["errors"]) < tolerance, (result["rank"], case.name, outcome["errors"])


def assert_collectives_untouched(ranks: list[dict]) -> None:
    for result, case, outcome in case_results(ranks):
        (schedule,) = outcome["schedules"]
        reductions = len(tp.ROW_PARALLEL[case.model])
        targets = Counter(entry.split(": ")[1] for entry in schedule["before"]["collectives"])
        assert targets == {"_c10d_functional.all_reduce.default": reductions,
                           "_c10d_functional.wait_tensor.default": reductions}, (result["rank"], case.name)
        assert schedule["after"] == schedule["before"], (result["rank"], case.name)


def test_sharded_models_match_the_unsharded_model(ranks):
    assert_outputs_match(ranks)


def expected_sites(case: tp.Case) -> Counter:
    """(kernel, K, N, epilogue) of the sites of one rank: every GEMM at its local shape; a row-parallel GEMM
    never takes what comes after its all-reduce (a residual, the hand-written layers' bias). DTensor adds
    its row-parallel bias, divided by the world size, before the reduction: the graph's own bias step."""
    if case.model == "mlp":
        down_bias = ("bias",) if case.style == "dtensor" else ()
        return Counter({("gemm", tp.HIDDEN, tp.MLP_WIDTH_PER_RANK, ("bias", "gelu_tanh")): 1,
                        ("gemm", tp.MLP_WIDTH_PER_RANK, tp.HIDDEN, down_bias): 1})
    q, kv = tp.HEADS_PER_RANK * tp.HEAD_DIM, tp.KV_HEADS_PER_RANK * tp.HEAD_DIM
    return Counter({("gemm_multi", tp.HIDDEN, q, ()): 1, ("gemm_multi", tp.HIDDEN, kv, ()): 2,
                    ("gemm", q, tp.HIDDEN, ()): 1,
                    ("gemm_glu", tp.HIDDEN, tp.INTERMEDIATE_PER_RANK, ("silu", "up_mul")): 1,
                    ("gemm", tp.INTERMEDIATE_PER_RANK, tp.HIDDEN, ()): 1})


def test_every_rank_reports_its_sites_at_its_local_shapes(ranks):
    for result, case, outcome in case_results(ranks):
        (report,) = outcome["reports"]  # a dynamic M compiles a plain variant too, which has no report
        where = (result["rank"], case.name)
        assert not report["unfused_gemms"], where
        got = Counter((s["kernel"], s["k"], s["n"], tuple(s["epilogue"])) for s in report["sites"])
        assert got == expected_sites(case), where
        m = {"prefill": tp.PREFILL_TOKENS, "decode": 1, "dynamic": "dynamic"}[case.shape]
        assert {s["m"] for s in report["sites"]} == {m}, where
        assert all(s["runs_on"] == "helion" and not s["fallbacks"] for s in report["sites"]), where


def test_collectives_are_neither_taken_in_nor_moved(ranks):
    assert_collectives_untouched(ranks)


def test_the_manifest_of_each_rank_holds_its_local_shapes(ranks):
    q, kv = tp.HEADS_PER_RANK * tp.HEAD_DIM, tp.KV_HEADS_PER_RANK * tp.HEAD_DIM
    expected = {("gemm", tp.HIDDEN, tp.MLP_WIDTH_PER_RANK, ()), ("gemm", tp.MLP_WIDTH_PER_RANK, tp.HIDDEN, ()),
                ("gemm_multi", tp.HIDDEN, q + 2 * kv, (q, kv, kv)), ("gemm", q, tp.HIDDEN, ()),
                ("gemm_glu", tp.HIDDEN, tp.INTERMEDIATE_PER_RANK, ()),
                ("gemm", tp.INTERMEDIATE_PER_RANK, tp.HIDDEN, ())}
    for result in ranks:
        sites = result["manifest"]["sites"]
        assert {(s["kernel"], s["k"], s["n"], tuple(s.get("widths", ()))) for s in sites} == expected, result["rank"]
        assert {m for s in sites for m in s["m"]} == {1, tp.PREFILL_TOKENS}, sites
        assert any(s["max_helion_m"] is not None for s in sites), sites


@pytest.mark.slow
def test_every_case_including_the_dtensor_decoder_at_a_dynamic_m(tmp_path):
    """The whole matrix on the CPU (CI runs all but its slowest case)."""
    results = run_ranks(tmp_path, "cpu", tuple(tp.ALL_CASES))
    assert_outputs_match(results)
    assert_collectives_untouched(results)


# --------------------------------------------------------------------------------------------------
# The pass on graphs with collectives


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor.default(c10d.all_reduce.default(t, "sum", "0"))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def rewritten(fn, *args: torch.Tensor, tmp_path: Path, **options):
    """The schedules of ``fn``'s graph before and after the backend's pass (as a CPU compile with
    ``rewrite_on_cpu`` runs it), and the pass's report."""
    graph = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args).graph
    before = tp.collective_schedule(graph)
    manager = HelionPassManager(BackendOptions.from_user(
        {"rewrite_on_cpu": True, "cache_dir": str(tmp_path), "rmsnorm_prologue_max_m": 64, **options}))
    manager(graph)
    return before, tp.collective_schedule(graph), manager.reports[-1]


def test_an_epilogue_after_an_unrelated_collective_is_left_out(tmp_path):
    """The fused op runs where the site's last step was: taking in the bias, relu and residual would move the
    GEMM past the all-reduce issued between them."""

    def interleaved(x, w, b, y):
        h = x @ w.t()
        reduced = all_reduce(y)
        return torch.relu(h + b) + reduced

    before, after, report = rewritten(interleaved, randn(4, 32), randn(16, 32), randn(16), randn(4, 16),
                                      tmp_path=tmp_path)
    (site,) = report.sites
    assert site.epilogue == [] and site.runs_on == "reference"
    assert any("epilogue stops before add" in note and "all_reduce" in note for note in site.notes), site.notes
    assert after == before


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter"])
def test_a_row_parallel_gemm_ends_at_its_reduction(collective, tmp_path):
    """The bias and residual after the reduction stay after it: fusing them would add them on every rank."""

    def reduce(t):
        if collective == "all_reduce":
            return all_reduce(t)
        return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(t, "sum", WORLD, "0"))

    def row_parallel(x, w, b, residual):
        return reduce(x @ w.t()) + b + residual

    rows = 4 if collective == "all_reduce" else 4 // WORLD
    before, after, report = rewritten(row_parallel, randn(4, 32), randn(16, 32), randn(16), randn(rows, 16),
                                      tmp_path=tmp_path)
    (site,) = report.sites
    assert site.epilogue == [] and site.runs_on == "reference"
    assert after == before


def test_a_column_parallel_gemm_after_an_all_gather_fuses_after_it(tmp_path):
    def column_parallel(x_shard, w, b):
        x = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x_shard, WORLD, "0"))
        return F.gelu(x @ w.t() + b)

    before, after, report = rewritten(column_parallel, randn(2, 32), randn(16, 32), randn(16), tmp_path=tmp_path)
    (site,) = report.sites
    assert site.epilogue == ["bias", "gelu"] and site.runs_on == "reference"
    assert after == before


def test_gate_and_up_on_both_sides_of_a_collective_stay_apart(tmp_path):
    def gated(x, w_gate, w_up, y):
        up = x @ w_up.t()
        reduced = all_reduce(y)
        return F.silu(x @ w_gate.t()) * up, reduced

    before, after, report = rewritten(gated, randn(4, 32), randn(16, 32), randn(16, 32), randn(4, 16),
                                      tmp_path=tmp_path)
    assert sorted(s.kernel for s in report.sites) == ["gemm", "gemm"]
    notes = [note for s in report.sites for note in s.notes]
    assert any(note.startswith("gate and up projections not fused") and "all_reduce" in note for note in notes), notes
    assert after == before


def test_projections_of_one_activation_on_both_sides_of_a_collective_take_separate_launches(tmp_path):
    def qkv(x, wq, wk, wv, y):
        q, k = x @ wq.t(), x @ wk.t()
        reduced = all_reduce(y)
        return q, k, x @ wv.t(), reduced

    before, after, report = rewritten(qkv, randn(4, 32), randn(16, 32), randn(8, 32), randn(8, 32), randn(4, 16),
                                      tmp_path=tmp_path)
    assert [s.kernel for s in report.sites] == ["gemm"] * 3
    assert all(any(note.startswith("not in one launch") and "all_reduce" in note for note in s.notes)
               for s in report.sites), [s.notes for s in report.sites]
    assert after == before


def test_an_rmsnorm_computed_before_a_collective_is_not_the_prologue_of_a_gemm_after_it(tmp_path):
    def normed(x, norm_weight, w, y):
        h = rms_norm(x, norm_weight)
        reduced = all_reduce(y)
        return h @ w.t(), reduced

    before, after, report = rewritten(normed, randn(4, 32), randn(32), randn(16, 32), randn(4, 16), tmp_path=tmp_path)
    (site,) = report.sites
    assert site.prologue == []
    assert any(note.startswith("RMSNorm not fused") and "all_reduce" in note for note in site.notes), site.notes
    assert after == before


def test_without_a_collective_in_between_the_same_graphs_fuse_whole(tmp_path):
    """The guards above cost nothing where no collective lies inside a site."""

    def local(x, w, b, norm_weight, w_gate, w_up):
        h = torch.relu(x @ w.t() + b)
        n = rms_norm(x, norm_weight)
        return h, F.silu(n @ w_gate.t()) * (n @ w_up.t())

    _, _, report = rewritten(local, randn(4, 32), randn(16, 32), randn(16), randn(32), randn(16, 32), randn(16, 32),
                             tmp_path=tmp_path)
    assert sorted((s.kernel, tuple(s.prologue), tuple(s.epilogue)) for s in report.sites) == [
        ("gemm", (), ("bias", "relu")), ("gemm_glu", ("rmsnorm",), ("silu", "up_mul"))]


@pytest.mark.parametrize("micro_pipeline_tp", [False, True])
def test_gemms_of_an_all_gather_or_a_reduce_scatter_are_left_to_micro_pipeline_tp(micro_pipeline_tp, tmp_path):
    """Inductor's micro-pipeline TP fuses an all-gather with the GEMM reading its result, and a GEMM with the
    reduce-scatter of its product, after this pass: where it is on, those GEMMs are its to take."""

    def sequence_parallel(x_shard, w_up, w_down):
        x = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(x_shard, WORLD, "0"))
        h = torch.relu(x @ w_up.t())
        return c10d.wait_tensor.default(c10d.reduce_scatter_tensor.default(h @ w_down.t(), "sum", WORLD, "0"))

    with torch._inductor.config.patch(_micro_pipeline_tp=micro_pipeline_tp):
        before, after, report = rewritten(sequence_parallel, randn(2, 32), randn(16, 32), randn(32, 16),
                                          tmp_path=tmp_path)
    assert after == before
    if not micro_pipeline_tp:
        assert [s.runs_on for s in report.sites] == ["reference", "reference"]
        return
    assert [s.runs_on for s in report.sites] == ["inductor", "inductor"]
    assert "all_gather_into_tensor" in report.sites[0].why and "reduce_scatter_tensor" in report.sites[1].why
    assert all("micro-pipeline TP" in s.why for s in report.sites)
