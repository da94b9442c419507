"""How the placement policy for untuned keys (helion_backend/policy.py) does on the measured config table.

Every entry of a table holds the best Helion time and the fallback's (cuBLAS + Inductor's epilogue) at its
key, so the policy can be replayed on the table itself, without a GPU:

- leave one shape out: each tuned (family, dtype, K, N) removed in turn, its Ms decided from the others (a
  model whose shapes nobody tuned);
- leave one key out: each (family, dtype, K, N, M) removed in turn (an M nobody tuned).

The policy must send a held-out key to Helion only where Helion won there. Each line counts the keys, those
sent to Helion, those of them Helion lost (the policy's one forbidden mistake), the evidence, and the
geomean against torch.compile if the borrowed config were as fast as the key's own (an upper bound: the
GPU's held-out benchmark measures the real thing). ``--grid`` also replays other closeness ratios and
margins, to show how far the chosen ones are from a mistake. ``--cost`` times what the policy adds to the
first compile of a Llama-3.1-8B-shaped decoder: reading the table and deciding every site's key at every
M up to 32, in bf16 and fp8 (no calibration: option ``autotune_missing`` is off by default). ``--replay
RESULTS`` places the bf16 rows of a ``bench_gemm.py`` results file with the table (each held-out row with its
suite held out) and lists those the table now places elsewhere than they ran, so a table change shows
which measured rows it moved::

    python benchmarks/policy_loo.py [--table helion_backend/kernels/tuned/nvidia_h200.json] [--grid] [--cost]
        [--replay benchmarks/results/held_out/leave_one_family_out/nvidia_h200_bf16.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helion_backend import policy
from helion_backend.vocabulary import DEFAULT_KERNEL_FAMILY

SHIPPED = Path(__file__).resolve().parents[1] / "helion_backend" / "kernels" / "tuned" / "nvidia_h200.json"


def load_tables(path: Path) -> policy.Tables:
    """(family, dtype) -> (K, N) -> entries sorted by M, from a table file (configs kept as plain dicts)."""
    return tables_of(json.loads(path.read_text()))


def tables_of(table: dict) -> policy.Tables:
    """:func:`load_tables` of a table file's JSON."""
    tables: dict[tuple[str, str], dict[tuple[int, int], list[policy.Entry]]] = {}
    for raw in table["entries"]:
        wins, us, fallback_us = raw.get("helion_wins"), raw.get("us"), raw.get("fallback_us")
        entry = policy.Entry(int(raw["m"]), raw["config"], None if wins is None else bool(wins),
                             float(fallback_us) / float(us) if us and fallback_us else None,
                             bool(raw.get("calibrated", False)))
        shapes = tables.setdefault((raw.get("kernel", DEFAULT_KERNEL_FAMILY), raw["dtype"]), {})
        shapes.setdefault((int(raw["k"]), int(raw["n"])), []).append(entry)
    for shapes in tables.values():
        for entries in shapes.values():
            entries.sort(key=lambda e: e.m)
    return tables


def report(tables: policy.Tables) -> list[str]:
    lines = []
    for name, evaluate in (("leave one shape out", policy.leave_one_shape_out),
                           ("leave one key out", policy.leave_one_key_out)):
        outcomes = evaluate(tables)
        lines.append(f"{name}: {policy.summarize(outcomes).line()}")
        for family, dtype in sorted(tables):
            mine = [o for o in outcomes if (o.family, o.dtype) == (family, dtype)]
            lines.append(f"  {family} {dtype}: {policy.summarize(mine).line()}")
        lines += [f"  Helion where it lost: {o.family} {o.dtype} K={o.k} N={o.n} M={o.m}: {o.lead:.2f}x "
                  f"({o.decision.evidence} from {o.decision.source})" for o in outcomes if o.wrong_helion]
    return lines


def grid(tables: policy.Tables) -> list[str]:
    """Leave one shape out under other ratios and margins (the policy's constants patched)."""
    lines = ["leave one shape out, by CLOSE_RATIO and PREDICTED_MARGIN:"]
    for ratio, margin in itertools.product((1.25, 1.5, 2.0, 3.0), (1.0, 1.05, 1.1, 1.15, 1.2)):
        with mock.patch.object(policy, "CLOSE_RATIO", ratio), mock.patch.object(policy, "PREDICTED_MARGIN", margin):
            summary = policy.summarize(policy.leave_one_shape_out(tables))
        chosen = " (chosen)" if (ratio, margin) == (policy.CLOSE_RATIO, policy.PREDICTED_MARGIN) else ""
        lines.append(f"  ratio {ratio}, margin {margin}{chosen}: {summary.line()}")
    return lines


# A Llama-3.1-8B decoder's GEMM keys as the backend's families see them: (family, K, N) of q/k/v (one shared
# launch: the sum of their widths), o, gate/up (one gated launch, keyed by one projection's N), down, LM head.
LLAMA_3_1_8B_KEYS = (("gemm_multi", 4096, 6144), (DEFAULT_KERNEL_FAMILY, 4096, 4096), ("gemm_glu", 4096, 14336),
                     (DEFAULT_KERNEL_FAMILY, 14336, 4096), (DEFAULT_KERNEL_FAMILY, 4096, 128256))
QUANTIZED_FAMILY = {"gemm_multi": "gemm_multi_fp8", "gemm_glu": "gemm_glu_fp8", DEFAULT_KERNEL_FAMILY: "gemm_fp8"}


def placement_cost(path: Path, repeats: int = 5) -> str:
    """The median time to read the table and decide the Llama-3.1-8B keys at M = 1 ... 32 in bf16 and fp8."""
    keys = [(family, "bfloat16", k, n) for family, k, n in LLAMA_3_1_8B_KEYS]
    keys += [(QUANTIZED_FAMILY[family], "float8_e4m3fn", k, n) for family, k, n in LLAMA_3_1_8B_KEYS]
    times, evidence = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        tables = load_tables(path)
        for family, dtype, k, n in keys:
            for m in range(1, 33):
                decision = policy.decide(tables.get((family, dtype), {}), k, n, m)
                evidence[decision.evidence] = evidence.get(decision.evidence, 0) + 1
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    counts = ", ".join(f"{word} {count // repeats}" for word, count in sorted(evidence.items()))
    return (f"placement cost: {len(keys) * 32} decisions (Llama-3.1-8B-shaped, bf16 and fp8, M = 1..32) with the "
            f"table read: {median * 1e3:.1f} ms (median of {repeats}); evidence: {counts}")


def replay(table_path: Path, results_path: Path) -> list[str]:
    """Where the policy places each bf16 row of a ``bench_gemm.py`` results file with this table (its row's
    suite held out where the row was), against where the row ran: whether a table change moved a measured
    placement, so that the row's time still stands for the table."""
    from benchmarks.bench_gemm import held_out_shapes, without_shapes

    table, results = json.loads(table_path.read_text()), json.loads(results_path.read_text())
    by_suite: dict[str, policy.Tables] = {}
    rows = [row for row in results["rows"] if row["dtype"] == "bf16" and not row.get("quant")
            and isinstance(row.get("helion_sites"), str)]
    moved = []
    for row in rows:
        suite = row["suite"] if row.get("held_out") else ""
        if suite not in by_suite:
            by_suite[suite] = tables_of(without_shapes(table, held_out_shapes([suite]))[0] if suite else table)
        shapes = by_suite[suite].get((DEFAULT_KERNEL_FAMILY, "bfloat16"), {})
        decision = policy.decide(shapes, int(row["k"]), int(row["n"]), int(row["m"]))
        ran_helion = row["helion_sites"].startswith("helion")
        if decision.helion != ran_helion:
            moved.append(f"  {row['suite']} {row['name']} M={row['m']}: ran {'Helion' if ran_helion else 'Inductor'}, "
                         f"now {'Helion' if decision.helion else 'Inductor'} ({decision.evidence})")
    held = sum(1 for row in rows if row.get("held_out"))
    return [f"replay of {results_path}: {len(rows)} rows ({held} held out), {len(moved)} placed elsewhere "
            f"by {table_path.name}", *moved]


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, default=SHIPPED, help=f"a config table (default: {SHIPPED.name})")
    parser.add_argument("--grid", action="store_true", help="also replay other ratios and margins")
    parser.add_argument("--cost", action="store_true", help="also time the placement of a Llama-3.1-8B decoder")
    parser.add_argument("--replay", type=Path, action="append", default=[], metavar="RESULTS",
                        help="also check where the table places the rows of a bench_gemm.py results file "
                             "against where they ran (repeatable)")
    args = parser.parse_args(argv)
    tables = load_tables(args.table)
    print("\n".join(report(tables) + (grid(tables) if args.grid else [])
                    + ([placement_cost(args.table)] if args.cost else [])
                    + [line for path in args.replay for line in replay(args.table, path)]))


if __name__ == "__main__":
    main(sys.argv[1:])
