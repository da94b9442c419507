"""The tensor-parallel decode benchmark (``benchmarks/decode.py --tp N``, :mod:`benchmarks.decode_tp`): its
smoke run on two gloo ranks, its refusals, and its run on two GPUs."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import decode, decode_tp  # noqa: E402

WORLD = 2


def run_benchmark(tmp_path: Path, *args: str, timeout: int) -> tuple[dict, str]:
    env = {**os.environ,
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend")}
    out_dir = tmp_path / "out"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--tp", str(WORLD),
                             "--out-dir", str(out_dir), *args],
                            capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (path,) = out_dir.glob(f"*_tp{WORLD}_decode.json")
    return json.loads(path.read_text()), result.stdout


def rank_shapes(config: decode.DecoderConfig, world: int) -> dict[str, tuple[int, int]]:
    """(K, N) of each linear's shard on one rank, by the module the report names."""
    q, kv = config.heads // world * config.head_dim, config.kv_heads // world * config.head_dim
    inter = config.intermediate // world
    shapes = {"lm_head.linear": (config.hidden, config.vocab // world)}
    for i in range(config.layers):
        shapes |= {f"layers.{i}.attn.q_proj": (config.hidden, q), f"layers.{i}.attn.k_proj": (config.hidden, kv),
                   f"layers.{i}.attn.v_proj": (config.hidden, kv), f"layers.{i}.attn.o_proj.linear": (q, config.hidden),
                   f"layers.{i}.mlp.gate_proj": (config.hidden, inter),  # with up_proj in one gated site
                   f"layers.{i}.mlp.down_proj.linear": (inter, config.hidden)}
    return shapes


def assert_rows_correct(data: dict, formats: tuple[str, ...], variants: tuple[str, ...]) -> None:
    rows = {(row["format"], row["variant"]): row for row in data["rows"]}
    assert set(rows) == {(f, v) for f in formats for v in variants}
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        assert decode.row_is_correct(row), (key, row["rel_err"], row["rel_err_base"])
        assert row["graphs"] == 1 and row["graph_breaks"] == 0, key
        assert len(row["ranks"]) == WORLD and all(r["wall_us"] > 0 for r in row["ranks"]), key
        assert row["wall_us"] == max(r["wall_us"] for r in row["ranks"]) or row["wall_method"] == "interleaved", key
    assert data["metadata"]["complete"] and data["metadata"]["world_size"] == WORLD


def assert_rank_sites(data: dict, formats: tuple[str, ...], config: decode.DecoderConfig, runs_on: str) -> None:
    """Every rank reports every linear of its shard, at the shard's K and N, nothing left unfused."""
    expected = rank_shapes(config, WORLD)
    for fmt in formats:
        per_rank = data["metadata"]["rank_sites"][fmt]
        assert len(per_rank) == WORLD, fmt
        for rank, sites in enumerate(per_rank):
            got = {s["module"]: (s["k"], s["n"]) for s in sites}
            assert got == expected, (fmt, rank, got)
            assert all(s["runs_on"] == runs_on and not s["fallbacks"] for s in sites), (fmt, rank, sites)
        assert all("0 unfused GEMM(s)" in summary for ranks in data["metadata"]["helion_reports"][fmt]
                   for summary in ranks), fmt


@pytest.mark.slow
def test_smoke_run_on_two_gloo_ranks_matches_the_unsharded_model_and_reports_per_rank_sites(tmp_path):
    """Two CPU ranks: the sharded step compiled (reduce-overhead, helion_inductor) against the unsharded eager
    model, bf16 and fp8, and each rank's sites at its shard's shapes (about 4 minutes on two busy cores)."""
    formats, variants = ("bf16", "fp8_dynamic"), decode_tp.TP_VARIANTS
    data, stdout = run_benchmark(tmp_path, "--smoke", "--formats", ",".join(formats), "--steps", "4",
                                 "--warmup", "1", timeout=900)
    assert_rows_correct(data, formats, variants)
    assert_rank_sites(data, formats, decode.SMOKE_CONFIG, runs_on="reference")
    for fmt in formats:
        # The sharding alone (eager, no compile) is within the format's tolerance too.
        assert data["metadata"]["eager_sharding_error"][f"{fmt} batch=1"] < decode.TOLERANCES[fmt], fmt
        assert all(row["wall_method"] == "interleaved" for row in data["rows"] if row["format"] == fmt)
    assert data["metadata"]["lm_head"] == {"bf16": "Linear", "fp8_dynamic": "Fp8DynamicLinear"}
    assert data["metadata"]["collectives"] == "gloo" and data["metadata"]["gpus"] == []
    assert "helion_inductor report, bf16, batch 1, rank 1:" in stdout
    table = (tmp_path / "out" / "cpu_tp2_decode.md").read_text()
    assert "tensor parallel over 2 ranks" in table and "sites per rank, fp8_dynamic" in table
    assert "bf16: helion_inductor vs reduce_overhead: wall geomean" in table  # the per-step speedup

    # --merge keeps a tensor-parallel file's per-rank sites and table.
    merged_dir = tmp_path / "merged"
    decode.main(["--merge", str(tmp_path / "out" / "cpu_tp2_decode.json"), "--out-dir", str(merged_dir)])
    merged = json.loads((merged_dir / "cpu_tp2_decode.json").read_text())
    assert merged["metadata"]["rank_sites"] == data["metadata"]["rank_sites"]
    assert len(merged["rows"]) == len(data["rows"])
    assert "sites per rank, fp8_dynamic" in (merged_dir / "cpu_tp2_decode.md").read_text()


def test_a_tp_run_wants_as_many_gpus_as_ranks(capsys, tmp_path):
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit, match=rf"^--tp {visible + 1} needs {visible + 1} CUDA GPUs; {visible} visible"):
        decode.main(["--tp", str(visible + 1), "--out-dir", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_a_tp_run_refuses_a_model_that_does_not_split(tmp_path):
    # The smoke model has 4 query and 2 key/value heads: three ranks cannot share them.
    with pytest.raises(SystemExit, match=r"--tp 3: heads \(4\) is not a multiple of --tp 3; kv_heads \(2\)"):
        decode.main(["--smoke", "--tp", "3", "--out-dir", str(tmp_path)])


def test_the_rank_config_holds_each_ranks_share_of_qwen3_8b():
    shard = decode_tp.rank_config(decode.QWEN3_8B, WORLD)
    assert (shard.heads, shard.kv_heads, shard.intermediate, shard.vocab) == (16, 4, 6144, 75968)
    assert dataclasses.replace(shard, heads=32, kv_heads=8, intermediate=12288, vocab=151936) == decode.QWEN3_8B
    assert decode_tp.sharding_problems(decode.QWEN3_8B, 8) == []
    assert decode_tp.sharding_problems(decode.QWEN3_8B, 16) == ["kv_heads (8) is not a multiple of --tp 16"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs")
def test_two_gpus_run_the_sharded_step_under_cuda_graphs(tmp_path):
    """Two H200s, NCCL: one layer, batch 1, bf16 and fp8; both variants under CUDA graphs (no skip), GPU
    times from both ranks, every rank's sites on Helion at its shard's shapes (untuned keys sent to Helion
    by the GPU tests' fixture)."""
    formats, variants = ("bf16", "fp8_dynamic"), decode_tp.TP_VARIANTS
    data, _ = run_benchmark(tmp_path, "--formats", ",".join(formats), "--batch", "1", "--layers", "1",
                            "--steps", "20", "--warmup", "3", timeout=540)
    assert_rows_correct(data, formats, variants)
    config = dataclasses.replace(decode.QWEN3_8B, layers=1)
    assert_rank_sites(data, formats, config, runs_on="helion")
    for row in data["rows"]:
        assert row["cudagraph_skips"] == 0, (row["format"], row["variant"], row["cudagraph_skip_reasons"])
        assert row["gpu_us"] > 0 and all(r["gpu_us"] > 0 for r in row["ranks"]), row
    assert len(data["metadata"]["gpus"]) == WORLD and data["metadata"]["collectives"].startswith("nccl")
