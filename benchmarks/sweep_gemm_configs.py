"""Time a few candidate Helion configs per decode GEMM shape and write the GPU's config table.

    python benchmarks/sweep_gemm_configs.py [--m 1,4,16,32] [--suite qwen3_8b] [--budget-min 4]
    python benchmarks/sweep_gemm_configs.py --kernel gemm_fp8 --m 1,16      # a quantized kernel family
    python benchmarks/sweep_gemm_configs.py --kernel gemm_multi --m 1,8,32  # q, k and v in one launch
    python benchmarks/sweep_gemm_configs.py --kernel gemm_glu --m 1,8,32    # the gated MLP kernel

Each candidate runs the fused kernel (bias + GELU-tanh epilogue) under CUDA-graph replay, cycling
through enough weight copies to defeat the L2, exactly as the benchmark times it; the fastest
correct config per (kernel, K, N, M) goes to ``helion_backend/kernels/tuned/<gpu>.json`` (and --out-dir),
with the time of ``torch.compile`` default on the same call and whether Helion beat it
(``helion_wins``: the dispatch keeps M above the first loss with cuBLAS + Inductor).
A small fixed candidate list, not Helion's autotuner; ``python -m helion_backend tune`` autotunes the
shapes a deployment compiled into the user's table instead.

The quantized families run the layers :mod:`helion_backend.quantize` builds (fp8 and int8 with dynamic
per-token activations, int8 and int4 weight-only, block fp8), checked against the unfused quantized
computation and timed against ``torch.compile`` default of the same layer. The int4 family's K block counts
packed bytes (two columns of K) and block fp8's is fixed at one group, so they have candidates of their own.

The gated MLP family (``gemm_glu``, rules/gated_mlp.toml) runs ``silu(x @ w_gate) * (x @ w_up)``
at the suites' gate/up shapes (it skips the others), checked against float64 and timed against
``torch.compile`` default of that expression (two cuBLAS GEMMs and Inductor's fused silu * mul). Its
candidates are the 16-bit ones as the kernel runs them: without split-K, the K block fitted to two weight
tiles. Its entries record their epilogue; the table's is the other families'.
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
import torch.nn.functional as F

from benchmarks.bench_gemm import SUITES
from helion_backend import dispatch
from helion_backend.epilogue import apply_epilogue
from helion_backend.kernels import configs
from helion_backend.kernels.configs import PREQUANTIZE
from helion_backend.kernels.gemm import gemm_epilogue_helion, glu_gemm_helion, glu_kernel_config
from helion_backend.kernels.multi_gemm import multi_gemm_helion
from helion_backend.kernels.quant_gemm import block_fp8_gemm_helion, int4_gemm_helion, quant_gemm_helion
from helion_backend.norm import RmsNormSpec, rms_norm
from helion_backend.passes.trace import trace_sites
from helion_backend.quantize import QUANT_FORMATS
from helion_backend.timing import copies_to_defeat_l2, time_callable_us
from helion_backend.tuning import (
    TIMING,
    ConfigTable,
    Measured,
    TuneKey,
    compiled_fallback,
    fastest_valid,
    make_inputs,
    reference_f64,
    table_metadata,
)
from helion_backend.vocabulary import FP8_BLOCK, FP8_BLOCK_FAMILY, INT4_FAMILY, MULTI_GEMM_FAMILY

STEPS = ("bias", "gelu_tanh")
GLU_FAMILY, GLU_STEPS = "gemm_glu", ("silu", "up_mul")
# The (K, N) the gated kernel runs at: the suites' gate and up projections.
GLU_SHAPES = frozenset((s.k, s.n) for shapes in SUITES.values() for s in shapes if s.name == "gate_up")
# Quantized families: the helion_backend.quantize format whose layers they run.
QUANT_FAMILIES = {"gemm_fp8": "fp8_dynamic", "gemm_int8": "int8_dynamic", "gemm_weight_only": "int8_weight_only",
                  INT4_FAMILY: "int4_weight_only", FP8_BLOCK_FAMILY: "fp8_block"}
QUANT_TOLERANCE = 1e-2  # against the unfused quantized computation (40 dB SQNR)
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
        return candidates
    return candidates + candidate_configs(m, n, QUANT_CANDIDATES, **{PREQUANTIZE: True})


def glu_candidates(m: int, n: int) -> list[helion.Config]:
    """The 16-bit candidates as the gated kernel runs them (so that the table records what runs), each once."""
    return list(dict.fromkeys(glu_kernel_config(c, torch.bfloat16.itemsize, False) for c in candidate_configs(m, n)))


def sweep_key(kernel: str, k: int, n: int, m: int, device: torch.device) -> dict | None:
    if kernel == "gemm":
        return sweep_bf16_key(k, n, m, device)
    if kernel == GLU_FAMILY:
        return sweep_glu_key(k, n, m, device)
    return sweep_quant_key(kernel, k, n, m, device)


def table_entry(key: dict, best: Measured, candidates: int, fallback_us: float) -> dict:
    """The table entry of a swept key: its fields, the fastest config and its time, and torch.compile's."""
    return {**key, "config": dict(best.config), "us": round(best.us, 2), "candidates": candidates,
            "fallback_us": round(fallback_us, 2), "helion_wins": best.us < fallback_us}


def sibling_groups(suite: str) -> list[tuple[int, tuple[int, ...]]]:
    """(K, widths) of the suite's decoder q, k and v: the launch the ``gemm_multi`` family runs."""
    by_name = {shape.name: shape for shape in SUITES[suite]}
    q, kv = by_name.get("q_o", by_name.get("q")), by_name.get("kv")
    return [] if q is None or kv is None else [(q.k, (q.n, kv.n, kv.n))]


def sweep_multi_key(k: int, widths: tuple[int, ...], m: int, device: torch.device) -> dict | None:
    """q, k and v of RMS-normalized rows (a decoder's input norm, Hugging Face's spelling) in one launch, per
    candidate, against the three single-site Helion kernels with their table configs (the backend with
    ``merge_siblings`` off) and against torch.compile default of the norm and three linears."""
    spec = RmsNormSpec(1e-6, round_before_weight=True)
    copies = copies_to_defeat_l2(k * sum(widths) * 2, device)
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    norms = [torch.randn(k, device=device, dtype=torch.bfloat16) * 0.1 + 1 for _ in range(copies)]
    weights = [[torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for n in widths] for _ in range(copies)]
    steps = [()] * len(widths)
    timer = functools.partial(time_callable_us, config=TIMING, device=device)

    def run(config: helion.Config, i: int) -> list[torch.Tensor]:
        j = i % copies
        return multi_gemm_helion(xs[j], [w.t() for w in weights[j]], steps, [], [], torch.bfloat16, config,
                                 norm=(norms[j], spec))

    def separate(i: int) -> list[torch.Tensor]:
        j = i % copies
        return [gemm_epilogue_helion(xs[j], w.t(), (), [], [], torch.bfloat16, norm=(norms[j], spec))
                for w in weights[j]]

    rows = rms_norm(xs[0], norms[0], spec).double()
    reference = [rows @ w.double().t() for w in weights[0]]
    candidates = [c for c in candidate_configs(m, sum(widths)) if c["split_k"] == 1]
    best = fastest_valid(candidates, run, reference, timer)
    if best is None:
        return None
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, nw, ws: [F.linear(rms_norm(x, nw, spec), w) for w in ws])
    fallback_us = timer(lambda i: compiled(xs[i % copies], norms[i % copies], weights[i % copies]))
    separate_us = timer(separate)
    key = {"kernel": MULTI_GEMM_FAMILY, "dtype": "bfloat16", "k": k, "n": sum(widths), "m": m, "widths": list(widths)}
    return {**table_entry(key, best, len(candidates), fallback_us), "separate_us": round(separate_us, 2)}


def sweep_bf16_key(k: int, n: int, m: int, device: torch.device) -> dict | None:
    """The fastest correct candidate at this key and the time of torch.compile default, as a table entry."""
    key = TuneKey("gemm", STEPS, "bfloat16", k, n, m)
    inputs = make_inputs(key, device, copies=copies_to_defeat_l2(k * n * 2, device))
    timer = functools.partial(time_callable_us, config=TIMING, device=device)
    candidates = candidate_configs(m, n)

    def run(config: helion.Config, i: int) -> torch.Tensor:
        return gemm_epilogue_helion(*inputs.args(i), config=config)

    best = fastest_valid(candidates, run, reference_f64(inputs), timer)
    if best is None:
        return None
    fallback_us = timer(compiled_fallback(inputs))
    return table_entry({"dtype": key.dtype, "k": k, "n": n, "m": m}, best, len(candidates), fallback_us)


def sweep_glu_key(k: int, n: int, m: int, device: torch.device) -> dict | None:
    """As :func:`sweep_bf16_key` for the gated kernel, whose two weights both stream from HBM on every call;
    None at a shape that is no gate/up projection's."""
    if (k, n) not in GLU_SHAPES:
        return None
    key = TuneKey(GLU_FAMILY, GLU_STEPS, "bfloat16", k, n, m)
    copies = copies_to_defeat_l2(2 * k * n * torch.bfloat16.itemsize, device)  # two weights a call
    gate, up = (make_inputs(key, device, copies, seed) for seed in (0, 1))
    timer = functools.partial(time_callable_us, config=TIMING, device=device)
    candidates = glu_candidates(m, n)

    def run(config: helion.Config, i: int) -> torch.Tensor:
        x, w_kn, *rest = gate.args(i)
        return glu_gemm_helion(x, w_kn, up.args(i)[1], *rest, config=config)

    x, w_gate, w_up = gate.xs[0].double(), gate.weights[0].double(), up.weights[0].double()
    reference = apply_epilogue(x @ w_gate.t(), GLU_STEPS, [].__getitem__, [], x @ w_up.t())
    best = fastest_valid(candidates, run, reference, timer)
    if best is None:
        return None
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w_gate, w_up: F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), dynamic=False)
    fallback_us = timer(lambda i: compiled(gate.xs[i % copies], gate.weights[i % copies], up.weights[i % copies]))
    return table_entry({"kernel": GLU_FAMILY, "dtype": key.dtype, "k": k, "n": n, "m": m, "epilogue": list(GLU_STEPS)},
                       best, len(candidates), fallback_us)


def sweep_quant_key(kernel: str, k: int, n: int, m: int, device: torch.device) -> dict | None:
    """As :func:`sweep_bf16_key` for a quantized family: the layer as helion_backend.quantize builds it,
    with a bias and a GELU, checked against its unfused computation, timed against torch.compile of it."""
    copies = copies_to_defeat_l2(k * n, device)
    layers = [_quantized_layer(kernel, k, n, device) for _ in range(copies)]
    xs = [torch.randn(m, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    (site,) = trace_sites(layers[0], xs[0])
    program = site.quant_program
    steps = tuple(s.name for s in site.steps if s.name not in ("cast", "reshape")) + ("gelu_tanh",)
    run, reference = _quant_kernel_call(kernel, layers, xs, steps, program)
    timer = functools.partial(time_callable_us, config=TIMING, device=device)
    candidates = quant_candidates(kernel, m, n)
    best = fastest_valid(candidates, run, reference, timer, QUANT_TOLERANCE)
    if best is None:
        return None
    torch._dynamo.reset()
    compiled = [torch.compile(lambda x, layer=layer: F.gelu(layer(x), approximate="tanh")) for layer in layers]
    fallback_us = timer(lambda i: compiled[i % copies](xs[i % copies]))
    return table_entry({"kernel": kernel, "dtype": str(site.dtype).removeprefix("torch."), "k": k, "n": n, "m": m},
                       best, len(candidates), fallback_us)


def _quant_kernel_call(kernel: str, layers: list, xs: list, steps: tuple[str, ...], program) -> tuple:
    """``(run(config, i), reference)``: the family's kernel on copy ``i``, and the unfused result of copy 0."""
    copies = len(layers)
    if kernel == INT4_FAMILY:  # the epilogue reads the bias alone; the scales are the prologue's

        def int4_args(i: int) -> tuple:
            layer = layers[i % copies]
            return (xs[i % copies], layer.packed.t(), layer.scales, steps, [layer.bias], [], torch.bfloat16)

        def run_int4(config: helion.Config, i: int) -> torch.Tensor:
            return int4_gemm_helion(*int4_args(i), config=config)

        x, packed_kn, scales, *rest = int4_args(0)
        w_kn = dispatch.dequantize_int4(packed_kn.t(), scales, x.dtype).t()
        return run_int4, dispatch.reference(x, w_kn, *rest)
    if kernel == FP8_BLOCK_FAMILY:  # the epilogue reads the bias alone; both scales are the prologue's

        def block_args(i: int) -> tuple:
            layer = layers[i % copies]
            return (xs[i % copies], layer.qweight.t(), layer.weight_scale, steps, [layer.bias], [], torch.bfloat16,
                    program)

        def run_block(config: helion.Config, i: int) -> torch.Tensor:
            return block_fp8_gemm_helion(*block_args(i), config=config)

        x, w_kn, scales, steps, operands, scalars, out_dtype, _ = block_args(0)
        x_dq, w_dq_kn = dispatch.dequantize_block_fp8(x, program, w_kn.t(), scales)
        return run_block, dispatch.reference(x_dq, w_dq_kn, steps, operands, scalars, out_dtype)
    operands = [[_channel_scale(layer), layer.bias] for layer in layers]

    def args(i: int) -> tuple:
        j = i % copies
        return (xs[j], layers[j].qweight.t(), steps, operands[j], [], torch.bfloat16, program)

    def run(config: helion.Config, i: int) -> torch.Tensor:
        return quant_gemm_helion(*args(i), config=config, kernel_family=kernel)

    return run, dispatch.reference(*args(0))


def _quantized_layer(kernel: str, k: int, n: int, device: torch.device) -> torch.nn.Module:
    linear = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    return QUANT_FORMATS[QUANT_FAMILIES[kernel]].from_linear(linear).eval()


def _channel_scale(layer: torch.nn.Module) -> torch.Tensor:
    return layer.weight_scale.reshape(-1).float()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", default="1,4,16,32", help="comma list of M values")
    parser.add_argument("--kernel", default="gemm", choices=["gemm", GLU_FAMILY, MULTI_GEMM_FAMILY, *QUANT_FAMILIES],
                        help="kernel family (gemm_multi: a decoder's q, k and v in one launch, after an RMSNorm)")
    parser.add_argument("--suite", default=",".join(SUITES), help="comma list of suites")
    parser.add_argument("--budget-min", type=float, default=0, help="start no new key after this long")
    parser.add_argument("--out-dir", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    # One line per timed candidate (fastest_valid logs them), without the rest of the package's INFO logs.
    tune_log = logging.getLogger("helion_backend.tuning")
    tune_log.setLevel(logging.INFO)
    tune_log.addHandler(logging.StreamHandler(sys.stdout))
    ms = [int(m) for m in args.m.split(",")]
    if args.kernel == MULTI_GEMM_FAMILY:
        groups = sorted({group for suite in args.suite.split(",") for group in sibling_groups(suite)})
        keys = [(k, widths, m) for k, widths in groups for m in ms]
    else:
        shapes = sorted({(s.k, s.n) for suite in args.suite.split(",") for s in SUITES[suite]})
        keys = [(k, n, m) for k, n in shapes for m in ms]
    path = configs.TUNED_DIR / f"{configs.gpu_key(device)}.json"
    table = ConfigTable.load(path, shlex.join(sys.orig_argv))  # a sweep updates the table, key by key
    metadata = {**table_metadata(device), "epilogue": list(STEPS)}
    start = time.monotonic()
    for k, n, m in keys:
        if args.budget_min and time.monotonic() - start > 60 * args.budget_min:
            print(f"budget spent: K={k} N={n} M={m} not swept")
            continue
        multi = args.kernel == MULTI_GEMM_FAMILY
        entry = sweep_multi_key(k, n, m, device) if multi else sweep_key(args.kernel, k, n, m, device)
        if entry is None:
            continue
        table.put(entry, metadata)
        separate = f", one launch per GEMM {entry['separate_us']} us" if multi else ""
        print(f"best {args.kernel} K={k} N={n} M={m}: {entry['config']} {entry['us']} us "
              f"(torch.compile {entry['fallback_us']} us{separate})")
        if args.out_dir:
            (args.out_dir / path.name).write_text(path.read_text())
    print(f"{len(table.entries)} keys in the table after {time.monotonic() - start:.0f} s -> {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
