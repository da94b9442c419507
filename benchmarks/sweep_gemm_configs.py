"""Time a few candidate Helion configs per decode GEMM shape and write the GPU's config table.

    python benchmarks/sweep_gemm_configs.py [--m 1,4,16,32] [--suite qwen3_8b] [--budget-min 4]
    python benchmarks/sweep_gemm_configs.py --kernel gemm_fp8 --m 1,16      # a quantized kernel family
    python benchmarks/sweep_gemm_configs.py --kernel gemm_multi --m 1,8,32  # q, k and v in one launch
    python benchmarks/sweep_gemm_configs.py --kernel gemm_glu --m 1,8,32    # the gated MLP kernel
    python benchmarks/sweep_gemm_configs.py --kernel gemm_multi_fp8 --m 1,8,32  # also gemm_glu_fp8, *_int8:
                                                                            # siblings on quantized rows

Each candidate runs the fused kernel (bias + GELU-tanh epilogue) under CUDA-graph replay, cycling
through enough weight copies to defeat the L2, exactly as the benchmark times it; the fastest
correct config per (kernel, K, N, M) goes to ``helion_backend/kernels/tuned/<gpu>.json`` (and --out-dir),
with the time of ``torch.compile`` default on the same call and whether Helion beat it
(``helion_wins``: the dispatch keeps M above the first loss with cuBLAS + Inductor).
A small fixed candidate list, not Helion's autotuner; the inputs, checks and fallbacks are the tuner's
(:mod:`helion_backend.tuning_problems`), and ``python -m helion_backend tune`` autotunes the shapes a
deployment compiled (into the user's table, or the shipped one with ``--table``) instead.

The quantized families run the layers :mod:`helion_backend.quantize` builds (fp8 and int8 with dynamic
per-token activations, int8 and int4 weight-only, block fp8), checked against the unfused quantized
computation and timed against ``torch.compile`` default of the same layer. The int4 family's K block counts
packed bytes (two columns of K) and block fp8's is fixed at one group, so they have candidates of their own.

The gated MLP family (``gemm_glu``, rules/gated_mlp.toml) runs ``silu(x @ w_gate) * (x @ w_up)``
at the suites' gate/up shapes (it skips the others), checked against float64 and timed against
``torch.compile`` default of that expression (two cuBLAS GEMMs and Inductor's fused silu * mul). Its
candidates are the 16-bit ones as the kernel runs them: without split-K, the K block fitted to two weight
tiles. The shared launch (``gemm_multi``) runs a decoder's q, k and v (with their RMSNorm where the
backend fuses it, at one row by default), also timed against one launch per GEMM (``separate_us``). Entries record the epilogue they ran.
"""

from __future__ import annotations

import argparse
import functools
import logging
import shlex
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import helion
import torch

from benchmarks.bench_gemm import SMOKE_SUITE, SUITES
from helion_backend.kernels import configs
from helion_backend.kernels.configs import PREQUANTIZE
from helion_backend.kernels.gemm import glu_kernel_config
from helion_backend.options import BackendOptions
from helion_backend.timing import time_callable_us
from helion_backend.tuning import TIMING, ConfigTable, fastest_valid, table_entry, table_metadata
from helion_backend.tuning_problems import (
    QUANT_FORMAT_OF,
    TuneKey,
    build_problem,
    quantized_sibling_epilogue,
    quantized_site,
)
from helion_backend.vocabulary import (
    FP8_BLOCK,
    FP8_BLOCK_FAMILY,
    GLU_FAMILIES,
    GLU_FAMILY,
    INT4_FAMILY,
    MEMBER_FAMILY,
    MULTI_GEMM_FAMILIES,
    MULTI_GEMM_FAMILY,
    RMSNORM,
)

STEPS = ("bias", "gelu_tanh")
GLU_STEPS = ("silu", "up_mul")
# The (K, N) the gated kernel runs at: the suites' gate and up projections.
GLU_SHAPES = frozenset((s.k, s.n) for shapes in SUITES.values() for s in shapes if s.name == "gate_up")
# (block_m, block_n, block_k, num_warps, num_stages, split_k, indexing). Helion shrinks block_m to M
# when M is smaller; "tensor_descriptor" loads through TMA where the tensor allows it (Helion falls
# back to pointers where it does not).
CANDIDATES = (
    (16, 32, 256, 4, 3, 1, "pointer"),
    (16, 64, 128, 4, 4, 1, "pointer"),
    (16, 32, 512, 4, 3, 1, "pointer"),
    (16, 32, 256, 4, 3, 1, "tensor_descriptor"),
    # Deeper pipelines: 0.5-1.1 us faster than the table on the o and down projections at M = 1 and 8
    # (H200, seventh session's scratch sweep).
    (16, 32, 256, 4, 5, 1, "pointer"),
    (16, 32, 512, 4, 4, 1, "pointer"),
    (16, 64, 256, 4, 3, 1, "tensor_descriptor"),
    (16, 64, 128, 4, 5, 1, "tensor_descriptor"),
    (16, 128, 128, 8, 4, 1, "tensor_descriptor"),
    (16, 32, 256, 4, 3, 2, "pointer"),
    (16, 64, 256, 4, 3, 2, "tensor_descriptor"),
    (16, 32, 128, 4, 4, 4, "pointer"),
    (16, 32, 256, 4, 3, 4, "tensor_descriptor"),
    # Wide N tiles: fewer programs re-read the activation (which the quantized kernels also quantize).
    (16, 128, 256, 4, 3, 1, "pointer"),
    (16, 128, 256, 8, 3, 2, "pointer"),
    (16, 256, 128, 8, 3, 1, "pointer"),
    # M > 16: one M tile instead of two, so the weight is streamed once.
    (32, 32, 256, 4, 3, 1, "pointer"),
    (32, 32, 512, 4, 3, 1, "pointer"),
    (32, 64, 256, 4, 3, 1, "tensor_descriptor"),
    (32, 64, 128, 8, 4, 1, "tensor_descriptor"),
    (32, 32, 256, 4, 4, 2, "pointer"),
    (32, 64, 128, 4, 4, 2, "tensor_descriptor"),
)
# The quantized families: the candidates that did best in the first fp8/int8 sweep, each with the
# activation quantized inside the GEMM kernel and, once, by a kernel of its own (``prequantize``).
QUANT_CANDIDATES = (
    (16, 32, 512, 4, 3, 1, "pointer"),
    (16, 32, 256, 4, 3, 2, "pointer"),
    (16, 64, 256, 4, 3, 2, "pointer"),
    (16, 32, 256, 4, 3, 4, "tensor_descriptor"),
    (16, 128, 256, 8, 3, 2, "pointer"),
    (16, 64, 128, 4, 4, 1, "pointer"),
    (32, 32, 256, 4, 3, 1, "pointer"),
)
# One-byte weights (fp8, int8) move half the bytes of a 16-bit tile per pipeline stage, and the small-M
# kernels stream at the rate of the bytes they keep in flight: the first quantized sweeps picked the
# deepest tile on offer (16 x 32 x 512) at nearly every key, and fp8 GEMMs ran at 1.8 TB/s where the
# 16-bit ones reach 3.7 (H200, ninth session). So the K blocks go to 1024 and the pipelines deeper.
ONE_BYTE_CANDIDATES = (
    (16, 32, 1024, 4, 3, 1, "pointer"),
    (16, 64, 512, 4, 3, 1, "pointer"),
    (16, 32, 512, 4, 5, 1, "pointer"),
    (16, 32, 1024, 4, 3, 2, "pointer"),
    (16, 64, 512, 4, 4, 2, "pointer"),
    (32, 32, 512, 4, 3, 1, "pointer"),
    (32, 64, 512, 8, 3, 1, "pointer"),
)
# The int4 kernel: K blocks in bytes (128 bytes = 256 columns of K), and each step holds the bytes, their
# scales and both dequantized nibbles in registers, so shallower blocks than the 16-bit ones.
INT4_CANDIDATES = (
    (16, 32, 128, 4, 3, 1, "pointer"),
    (16, 64, 64, 4, 4, 1, "pointer"),
    (16, 32, 256, 4, 3, 1, "pointer"),
    (16, 64, 128, 4, 3, 2, "pointer"),
    (16, 32, 128, 4, 3, 4, "pointer"),
    (16, 128, 64, 8, 3, 1, "pointer"),
    (32, 32, 128, 4, 3, 1, "pointer"),
    (32, 64, 64, 4, 4, 2, "pointer"),
)
# Block fp8: the K block is always one group (FP8_BLOCK), so only the M and N tiles, warps, stages and
# splits vary.
BLOCK_FP8_CANDIDATES = tuple(
    (bm, bn, FP8_BLOCK, w, s, sk, "pointer")
    for bm, bn, w, s, sk in ((16, 32, 4, 3, 1), (16, 64, 4, 3, 1), (16, 128, 4, 3, 1), (16, 64, 4, 4, 2),
                             (16, 32, 4, 3, 4), (16, 128, 8, 3, 2), (32, 64, 4, 3, 1), (32, 128, 8, 3, 1))
)
# Splits beyond this many CTAs only add partial sums to write and read back.
MAX_SPLIT_CTAS = 4 * 132


def candidate_configs(m: int, n: int, candidates=CANDIDATES, **extra: object) -> list[helion.Config]:
    """The candidates that make sense at this M and N (block_m above M and oversplit grids are skipped)."""
    return [
        helion.Config(block_sizes=[bm, bn, bk], num_warps=w, num_stages=s, split_k=sk, indexing=ix, **extra)
        for bm, bn, bk, w, s, sk, ix in candidates
        if (bm <= 16 or m > 16) and (sk == 1 or -(-n // bn) * -(-m // bm) * sk <= MAX_SPLIT_CTAS)
    ]


def quant_candidates(kernel: str, m: int, n: int) -> list[helion.Config]:
    if kernel == INT4_FAMILY:
        return candidate_configs(m, n, INT4_CANDIDATES)
    if kernel == FP8_BLOCK_FAMILY:
        return candidate_configs(m, n, BLOCK_FP8_CANDIDATES)
    candidates = candidate_configs(m, n, QUANT_CANDIDATES)
    if kernel == "gemm_weight_only":  # no activation quantization, so no scales to move
        return candidates + candidate_configs(m, n, ONE_BYTE_CANDIDATES)
    # The deep tiles only with the rows quantized first, which won every fp8 and int8 key so far.
    return candidates + candidate_configs(m, n, QUANT_CANDIDATES + ONE_BYTE_CANDIDATES, **{PREQUANTIZE: True})


def glu_candidates(m: int, n: int) -> list[helion.Config]:
    """The 16-bit candidates as the gated kernel runs them (so that the table records what runs), each once."""
    return list(dict.fromkeys(glu_kernel_config(c, torch.bfloat16.itemsize, False) for c in candidate_configs(m, n)))


def candidates_for(key: TuneKey) -> list[helion.Config]:
    """The family's candidates at this key's M and N."""
    if key.kernel == GLU_FAMILY:
        return glu_candidates(key.m, key.n)
    if key.kernel in GLU_FAMILIES:  # on quantized rows: the quantized candidates as the gated kernel runs them
        candidates = candidate_configs(key.m, key.n, QUANT_CANDIDATES + ONE_BYTE_CANDIDATES)
        return list(dict.fromkeys(glu_kernel_config(c, 1, False) for c in candidates))
    if key.kernel in MULTI_GEMM_FAMILIES.values():  # no split-K: the outputs' tiles supply the parallelism
        one_byte = key.kernel != MULTI_GEMM_FAMILY
        candidates = candidate_configs(key.m, key.n, CANDIDATES + (ONE_BYTE_CANDIDATES if one_byte else ()))
        return [c for c in candidates if c["split_k"] == 1]
    if key.kernel in QUANT_FORMAT_OF:
        return quant_candidates(key.kernel, key.m, key.n)
    return candidate_configs(key.m, key.n)


def sweep_key(key: TuneKey, device: torch.device) -> dict | None:
    """The fastest correct candidate at this key and the time of torch.compile default, as a table entry."""
    problem = build_problem(key, device)
    timer = functools.partial(time_callable_us, config=TIMING, device=device)
    candidates = candidates_for(key)
    best = fastest_valid(candidates, problem.run, problem.reference, timer, problem.tolerance)
    return None if best is None else table_entry(key, problem, best, len(candidates), timer)


def sibling_groups(suite: str) -> list[tuple[int, tuple[int, ...]]]:
    """(K, widths) of the suite's decoder q, k and v: the launch the ``gemm_multi`` family runs."""
    by_name = {shape.name: shape for shape in SUITES[suite]}
    q, kv = by_name.get("q_o", by_name.get("q")), by_name.get("kv")
    return [] if q is None or kv is None else [(q.k, (q.n, kv.n, kv.n))]


def fused_norm(m: int) -> tuple[str, ...]:
    """The shared launch's prologue at this M as the backend compiles it: the RMSNorm only up to the
    default ``rmsnorm_prologue_max_m`` (above, Inductor's norm kernel feeds the plain launch, which is
    what the table's entry and its crossover must measure)."""
    return (RMSNORM,) if m <= BackendOptions().rmsnorm_prologue_max_m else ()


def sweep_keys(kernel: str, suites: list[str], ms: list[int]) -> list[TuneKey]:
    """The family's keys at the suites' shapes: q, k and v after their RMSNorm for the shared launch, the
    gate/up shapes for the gated kernel, each layer's own steps then a GELU for the quantized families."""
    if kernel in MULTI_GEMM_FAMILIES.values():
        groups = sorted({group for suite in suites for group in sibling_groups(suite)})
        if kernel != MULTI_GEMM_FAMILY:  # q, k and v on quantized rows (no norm: Inductor fused it with the quantization)
            dtype = quantized_site(MEMBER_FAMILY[kernel])[0]
            return [TuneKey(kernel, (), dtype, k, sum(widths), m, widths) for k, widths in groups for m in ms]
        return [TuneKey(kernel, (), "bfloat16", k, sum(widths), m, widths, fused_norm(m))
                for k, widths in groups for m in ms]
    shapes = sorted({(s.k, s.n) for suite in suites for s in SUITES[suite]})
    if kernel == GLU_FAMILY:
        shapes = [shape for shape in shapes if shape in GLU_SHAPES]
        dtype, prologue, steps = "bfloat16", (), GLU_STEPS
    elif kernel in GLU_FAMILIES:
        shapes = [shape for shape in shapes if shape in GLU_SHAPES]
        dtype, prologue, steps = quantized_site(MEMBER_FAMILY[kernel])[0], (), quantized_sibling_epilogue(kernel)
    elif kernel in QUANT_FORMAT_OF:
        dtype, prologue, layer_steps = quantized_site(kernel)
        steps = (*layer_steps, "gelu_tanh")
    else:
        dtype, prologue, steps = "bfloat16", (), STEPS
    return [TuneKey(kernel, steps, dtype, k, n, m, prologue=prologue) for k, n in shapes for m in ms]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,4,16,32", help="comma list of M values")
    parser.add_argument("--kernel", default="gemm", choices=["gemm", GLU_FAMILY, *MULTI_GEMM_FAMILIES.values(), *QUANT_FORMAT_OF,
                                                         *(f for f in GLU_FAMILIES if f != GLU_FAMILY)],
                        help="kernel family (gemm_multi: a decoder's q, k and v in one launch, after an RMSNorm)")
    parser.add_argument("--suite", default=",".join(s for s in SUITES if s != SMOKE_SUITE), help="comma list of suites")
    parser.add_argument("--budget-min", type=float, default=0, help="start no new key after this long")
    parser.add_argument("--out-dir", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    # One line per timed candidate (fastest_valid logs them), without the rest of the package's INFO logs.
    tune_log = logging.getLogger("helion_backend.tuning")
    tune_log.setLevel(logging.INFO)
    tune_log.addHandler(logging.StreamHandler(sys.stdout))
    keys = sweep_keys(args.kernel, args.suite.split(","), [int(m) for m in args.m.split(",")])
    path = configs.TUNED_DIR / f"{configs.gpu_key(device)}.json"
    table = ConfigTable.load(path, shlex.join(sys.orig_argv))  # a sweep updates the table, key by key
    metadata = {**table_metadata(device), "epilogue": list(STEPS)}
    start = time.monotonic()
    for key in keys:
        if args.budget_min and time.monotonic() - start > 60 * args.budget_min:
            print(f"budget spent: {key} not swept")
            continue
        entry = sweep_key(key, device)
        if entry is None:
            continue
        table.put(entry, metadata)
        separate = f", one launch per GEMM {entry['separate_us']} us" if "separate_us" in entry else ""
        print(f"best {key}: {entry['config']} {entry['us']} us (torch.compile {entry['fallback_us']} us{separate})")
        if args.out_dir:
            (args.out_dir / path.name).write_text(path.read_text())
    print(f"{len(table.entries)} keys in the table after {time.monotonic() - start:.0f} s -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
