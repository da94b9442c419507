"""Sweep the candidate configs of each kernel family at the benchmark suites' decode shapes into the GPU's
config table, or write those keys as a manifest for the tune command.

    python benchmarks/sweep_gemm_configs.py [--m 1,4,16,32] [--suite qwen3_8b] [--budget-min 4]
    python benchmarks/sweep_gemm_configs.py --kernel gemm_fp8 --m 1,16      # a quantized kernel family
    python benchmarks/sweep_gemm_configs.py --kernel gemm_multi --m 1,8,32  # q, k and v in one launch
    python benchmarks/sweep_gemm_configs.py --kernel gemm_glu --m 1,8,32    # the gated MLP kernel
    python benchmarks/sweep_gemm_configs.py --kernel gemm_multi_fp8 --m 1,8,32  # also gemm_glu_fp8, *_int8:
                                                                            # siblings on quantized rows
    python benchmarks/sweep_gemm_configs.py --kernel all      # every family

The shipped table is made by the tune command from the suites' manifest, every key at once (resumable;
``--force`` re-sweeps keys already there)::

    python benchmarks/sweep_gemm_configs.py --kernel all --write-manifest /tmp/suites.json
    python -m helion_backend tune /tmp/suites.json --effort sweep --num-tokens 1,2,4,8,16,24,32 \
        --table helion_backend/kernels/tuned/nvidia_h200.json

Either way each key is tuned by ``helion_backend.tuning.loop.tune_key`` with the ``sweep`` effort: the family's
candidates (:mod:`helion_backend.tuning.candidates`) and today's config run the fused kernel under
CUDA-graph replay, cycling through enough weight copies to defeat the L2, exactly as the benchmark times
it; the fastest correct config per (kernel, K, N, M) goes to ``helion_backend/kernels/tuned/<gpu>.json``
(and --out-dir), with the time of ``torch.compile`` default on the same call, whether Helion beat it
(``helion_wins``: the dispatch keeps M above the first loss with cuBLAS + Inductor), the effort and the
seconds the key took. This script re-sweeps the keys it is given (the table keeps the others) and stops
starting keys after ``--budget-min``. The inputs, checks and fallbacks are the tuner's
(:mod:`helion_backend.tuning.problems`).

The suites' keys: bias + GELU-tanh after the 16-bit GEMMs. The quantized families run the layers
:mod:`helion_backend.quantize` builds (fp8 and int8 with dynamic per-token activations, int8 and int4
weight-only, block fp8) with their own steps then a GELU, checked against the unfused quantized
computation and timed against ``torch.compile`` default of the same layer. The int4 family's K block counts
packed bytes (two columns of K) and block fp8's is fixed at one group, so they have candidates of their own.

The gated MLP family (``gemm_glu``, rules/gated_mlp.toml) runs ``silu(x @ w_gate) * (x @ w_up)``
at the suites' gate/up shapes (it skips the others), checked against float64 and timed against
``torch.compile`` default of that expression (two cuBLAS GEMMs and Inductor's fused silu * mul). Its
candidates are the 16-bit ones as the gated kernel runs them: without split-K, the K block fitted to two
weight tiles. The shared launch (``gemm_multi``) runs a decoder's q, k and v (with their RMSNorm where the
backend fuses it, at one row by default), also timed against one launch per GEMM (``separate_us``).
Entries record the epilogue they ran.

The manifest lists each of those sites with a dynamic M up to the default ``max_helion_size``, so that
the tune command's ``--num-tokens`` picks the Ms, and expands to exactly the keys this script sweeps at
them; the shared launch's site with its RMSNorm is limited at ``rmsnorm_prologue_max_m`` and outranks the
plain one there, as :func:`fused_norm` says.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench_gemm import SMOKE_SUITE, SUITES
from helion_backend import tables
from helion_backend.manifest import ManifestSite, SiteIdentity, write_manifest
from helion_backend.options import SWEEP_EFFORT, BackendOptions
from helion_backend.tuning.loop import (
    DEFAULT_NUM_TOKENS,
    ConfigTable,
    TuneError,
    expand_keys,
    table_metadata,
    tune_key,
)
from helion_backend.tuning.problems import (
    QUANT_FORMAT_OF,
    TuneKey,
    quantized_sibling_epilogue,
    quantized_site,
)
from helion_backend.vocabulary import (
    GLU_FAMILIES,
    GLU_FAMILY,
    MEMBER_FAMILY,
    MULTI_GEMM_FAMILIES,
    MULTI_GEMM_FAMILY,
    RMSNORM,
)

STEPS = ("bias", "gelu_tanh")
GLU_STEPS = ("silu", "up_mul")
# The (K, N) the gated kernel runs at: the suites' gate and up projections.
GLU_SHAPES = frozenset((s.k, s.n) for shapes in SUITES.values() for s in shapes if s.name == "gate_up")
# Every family the script sweeps (--kernel all), in the order it sweeps them.
KERNELS = ("gemm", GLU_FAMILY, *MULTI_GEMM_FAMILIES.values(), *QUANT_FORMAT_OF,
           *(family for family in GLU_FAMILIES if family != GLU_FAMILY))
ALL_KERNELS = "all"
DEFAULT_M = "1,4,16,32"


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


def suite_sites(kernels: Sequence[str], suites: Sequence[str],
                max_m: int = BackendOptions.max_helion_size) -> list[ManifestSite]:
    """The sites of :func:`sweep_keys` for ``kernels`` at M = 1..``max_m``, each with a dynamic M up to the
    largest M it is swept at, so that the tune command's ``--num-tokens`` picks the Ms. Raises ``ValueError``
    where the manifest would not expand to exactly the swept keys (a key kind a manifest cannot express)."""
    ms = list(range(1, max_m + 1))
    keys = [key for kernel in kernels for key in sweep_keys(kernel, suites, ms)]
    limits: dict[SiteIdentity, int] = {}
    for key in keys:
        site = (key.kernel, key.epilogue, key.dtype, key.k, key.n, key.prologue, key.widths)
        limits[site] = max(limits.get(site, 0), key.m)
    sites = [ManifestSite.declared(kernel, epilogue, dtype, k, n, None, limit, prologue=prologue, widths=widths)
             for (kernel, epilogue, dtype, k, n, prologue, widths), limit in limits.items()]
    expanded, swept = expand_keys(sites, ms), sorted(keys, key=lambda key: key.table_key)
    if expanded != swept:
        differ = sorted(set(map(str, expanded)) ^ set(map(str, swept)))
        raise ValueError(f"the manifest of {list(kernels)} would not expand to the swept keys: {differ[:4]}")
    return sites


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", help=f"comma list of M values (default: {DEFAULT_M})")
    parser.add_argument("--kernel", default="gemm", choices=[*KERNELS, ALL_KERNELS],
                        help="kernel family (gemm_multi: a decoder's q, k and v in one launch, after an RMSNorm; "
                             f"{ALL_KERNELS}: every family)")
    parser.add_argument("--suite", default=",".join(s for s in SUITES if s != SMOKE_SUITE), help="comma list of suites")
    parser.add_argument("--budget-min", type=float, default=0, help="start no new key after this long")
    parser.add_argument("--out-dir", type=Path, help="also write the table here")
    parser.add_argument("--write-manifest", type=Path, metavar="PATH",
                        help="write the suites' keys of --kernel as a manifest for `python -m helion_backend tune "
                             "PATH --effort sweep` and exit, sweeping nothing (its --num-tokens picks the Ms)")
    args = parser.parse_args(argv)
    if args.write_manifest and args.m:
        parser.error("--m does not apply to --write-manifest: pass the Ms to the tune command's --num-tokens")
    try:
        args.m = [int(m) for m in (args.m or DEFAULT_M).split(",")]
    except ValueError:
        parser.error(f"--m: expected a comma list of integers such as {DEFAULT_M}, got {args.m!r}")
    args.kernels = KERNELS if args.kernel == ALL_KERNELS else (args.kernel,)
    args.suites = args.suite.split(",")
    unknown = sorted(set(args.suites) - set(SUITES))
    if unknown:
        parser.error(f"--suite: unknown suite(s) {unknown}; valid: {sorted(SUITES)}")
    return args


def sweep(keys: list[TuneKey], args: argparse.Namespace) -> None:
    """Tune ``keys`` with the sweep effort into the shipped table of this GPU (and --out-dir), key by key."""
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    # One line per timed candidate (fastest_valid logs them), without the rest of the package's INFO logs.
    tune_log = logging.getLogger("helion_backend.tuning.loop")
    tune_log.setLevel(logging.INFO)
    tune_log.addHandler(logging.StreamHandler(sys.stdout))
    path = tables.TUNED_DIR / f"{tables.gpu_key(device)}.json"
    table = ConfigTable.load(path, shlex.join(sys.orig_argv))  # a sweep updates the table, key by key
    metadata = table_metadata(device)
    start = time.monotonic()
    for key in keys:
        if args.budget_min and time.monotonic() - start > 60 * args.budget_min:
            print(f"budget spent: {key} not swept")
            continue
        try:
            entry = tune_key(key, device, effort=SWEEP_EFFORT, budget_s=None)
        except TuneError as e:
            print(f"no entry for {key}: {e}")
            continue
        table.put(entry, metadata)
        separate = f", one launch per GEMM {entry['separate_us']} us" if "separate_us" in entry else ""
        print(f"best {key}: {entry['config']} {entry['us']} us (torch.compile {entry['fallback_us']} us{separate}); "
              f"{entry['seconds']} s")
        if args.out_dir:
            (args.out_dir / path.name).write_text(path.read_text())
    print(f"{len(table.entries)} keys in the table after {time.monotonic() - start:.0f} s -> {path}")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.write_manifest:
        sites = suite_sites(args.kernels, args.suites)
        try:
            write_manifest(args.write_manifest, sites)
        except OSError as e:
            sys.exit(f"error: cannot write the manifest {args.write_manifest} ({e})")
        print(f"{len(sites)} site(s) of {', '.join(args.kernels)} -> {args.write_manifest}; tune them with\n"
              f"  python -m helion_backend tune {args.write_manifest} --effort {SWEEP_EFFORT} "
              f"--num-tokens {','.join(map(str, DEFAULT_NUM_TOKENS))} --table helion_backend/kernels/tuned/<gpu>.json")
        return
    sweep([key for kernel in args.kernels for key in sweep_keys(kernel, args.suites, args.m)], args)


if __name__ == "__main__":
    main(sys.argv[1:])
