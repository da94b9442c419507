"""Time a few candidate Helion configs per decode GEMM shape and write the GPU's config table.

    python benchmarks/sweep_gemm_configs.py [--m 1,4,16,32] [--suite qwen3_8b] [--budget-min 4]

Each candidate runs the fused kernel (bias + GELU-tanh epilogue) under CUDA-graph replay, cycling
through enough weight copies to defeat the L2, exactly as the benchmark times it; the fastest
correct config per (K, N, M) goes to ``helion_backend/kernels/tuned/<gpu>.json`` (and --out-dir),
with the time of ``torch.compile`` default on the same call and whether Helion beat it
(``helion_wins``: the dispatch keeps M above the first loss with cuBLAS + Inductor).
A small fixed candidate list, not Helion's autotuner; ``python -m helion_backend tune`` autotunes the
shapes a deployment compiled into the user's table instead.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import helion
import torch

from benchmarks.bench_gemm import SUITES
from benchmarks.common import (
    TimingConfig,
    copies_to_defeat_l2,
    relative_error,
    run_metadata,
    time_callable_us,
)
from helion_backend.kernels import configs
from helion_backend.kernels.gemm import gemm_epilogue_helion

STEPS = ("bias", "gelu_tanh")
TIMING = TimingConfig(warmup_calls=2, calls_per_graph=20, warmup_replays=3, replays=15)
# (block_m, block_n, block_k, num_warps, num_stages, split_k, indexing). Helion shrinks block_m to M
# when M is smaller; "tensor_descriptor" loads through TMA where the tensor allows it (Helion falls
# back to pointers where it does not).
CANDIDATES = (
    (16, 32, 256, 4, 3, 1, "pointer"),
    (16, 64, 128, 4, 4, 1, "pointer"),
    (16, 32, 512, 4, 3, 1, "pointer"),
    (16, 32, 256, 4, 3, 1, "tensor_descriptor"),
    (16, 64, 256, 4, 3, 1, "tensor_descriptor"),
    (16, 64, 128, 4, 5, 1, "tensor_descriptor"),
    (16, 128, 128, 8, 4, 1, "tensor_descriptor"),
    (16, 32, 256, 4, 3, 2, "pointer"),
    (16, 64, 256, 4, 3, 2, "tensor_descriptor"),
    (16, 32, 128, 4, 4, 4, "pointer"),
    (16, 32, 256, 4, 3, 4, "tensor_descriptor"),
    # M > 16: one M tile instead of two, so the weight is streamed once.
    (32, 32, 256, 4, 3, 1, "pointer"),
    (32, 32, 512, 4, 3, 1, "pointer"),
    (32, 64, 256, 4, 3, 1, "tensor_descriptor"),
    (32, 64, 128, 8, 4, 1, "tensor_descriptor"),
    (32, 32, 256, 4, 4, 2, "pointer"),
    (32, 64, 128, 4, 4, 2, "tensor_descriptor"),
)
# Splits beyond this many CTAs only add partial sums to write and read back.
MAX_SPLIT_CTAS = 4 * 132


def candidate_configs(m: int, n: int) -> list[helion.Config]:
    """The candidates that make sense at this M and N (block_m above M and oversplit grids are skipped)."""
    return [
        helion.Config(block_sizes=[bm, bn, bk], num_warps=w, num_stages=s, split_k=sk, indexing=ix)
        for bm, bn, bk, w, s, sk, ix in CANDIDATES
        if (bm <= 16 or m > 16) and (sk == 1 or -(-n // bn) * -(-m // bm) * sk <= MAX_SPLIT_CTAS)
    ]


def sweep_key(k: int, n: int, m: int, device: torch.device) -> dict | None:
    copies = copies_to_defeat_l2(k * n * 2, device)
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    bs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    ref = torch.nn.functional.gelu(xs[0].double() @ ws[0].double().t() + bs[0].double(), approximate="tanh")
    results = []
    for config in candidate_configs(m, n):
        def step(i: int, config=config):
            j = i % copies
            return gemm_epilogue_helion(xs[j], ws[j].t(), STEPS, [bs[j]], [], torch.bfloat16, config)
        try:
            err = relative_error(step(0), ref)
            us = time_callable_us(step, TIMING, device) if err <= 1e-2 else math.inf
        except Exception as e:  # a config that does not compile for this shape: skip it
            print(f"  K={k} N={n} M={m} {dict(config)}: {type(e).__name__}: {str(e)[:200]}")
            continue
        results.append((us, err, config))
        print(f"  K={k} N={n} M={m} {dict(config)}: {us:.2f} us (err {err:.1e})")
    if not results:
        return None
    us, err, best = min(results, key=lambda r: r[0])
    fallback_us = time_fallback_us(xs, ws, bs, device)
    return {"dtype": "bfloat16", "k": k, "n": n, "m": m, "config": dict(best), "us": round(us, 2),
            "candidates": len(results), "fallback_us": round(fallback_us, 2), "helion_wins": us < fallback_us}


def time_fallback_us(xs: list[torch.Tensor], ws: list[torch.Tensor], bs: list[torch.Tensor],
                     device: torch.device) -> float:
    """What the site runs without Helion: ``torch.compile`` default (cuBLAS plus Inductor's epilogue)."""
    torch._dynamo.reset()  # one lambda serves every key: past Dynamo's recompile limit it would run eager
    fallback = torch.compile(
        lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh"),
        dynamic=False,
    )
    return time_callable_us(lambda i: fallback(xs[i % len(xs)], ws[i % len(ws)], bs[i % len(bs)]), TIMING, device)


def _key(entry: dict) -> tuple:
    return entry["dtype"], entry["k"], entry["n"], entry["m"]


def _existing(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _existing_entries(path: Path) -> list[dict]:
    return list(_existing(path).get("entries", []))


def _existing_commands(path: Path) -> list[str]:
    return list(_existing(path).get("metadata", {}).get("commands", []))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,4,16,32", help="comma list of M values")
    parser.add_argument("--suite", default=",".join(SUITES), help="comma list of suites")
    parser.add_argument("--budget-min", type=float, default=0, help="start no new key after this long")
    parser.add_argument("--out-dir", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    shapes = sorted({(s.k, s.n) for suite in args.suite.split(",") for s in SUITES[suite]})
    ms = [int(m) for m in args.m.split(",")]
    path = configs.TUNED_DIR / f"{configs.gpu_key(device)}.json"
    entries = {_key(e): e for e in _existing_entries(path)}  # a sweep updates the table, key by key
    commands = [*_existing_commands(path), shlex.join(sys.orig_argv)]
    start = time.monotonic()
    for k, n in shapes:
        for m in ms:
            if args.budget_min and time.monotonic() - start > 60 * args.budget_min:
                print(f"budget spent: K={k} N={n} M={m} not swept")
                continue
            entry = sweep_key(k, n, m, device)
            if entry:
                entries[_key(entry)] = entry
                print(f"best K={k} N={n} M={m}: {entry['config']} {entry['us']} us "
                      f"(torch.compile {entry['fallback_us']} us)")
            metadata = {**run_metadata(device), "epilogue": list(STEPS), "commands": commands}
            metadata.pop("command")
            table = {"metadata": metadata, "entries": sorted(entries.values(), key=_key)}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(table, indent=1) + "\n")
            if args.out_dir:
                (args.out_dir / path.name).write_text(path.read_text())
    print(f"{len(entries)} keys in the table after {time.monotonic() - start:.0f} s -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
