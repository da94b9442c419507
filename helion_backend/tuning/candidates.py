"""The candidate configs of each kernel family that the tune command's ``sweep`` effort times at a key.

A short fixed list per family, timed at the key through the family's wrapper (:func:`candidates_for`), costs
about 5-10 s a key on the GPU against 30-300 s for Helion's search, so it can cover every (shape, M) key
of the shipped table. The lists are what the sweeps of the shipped table ran
(``benchmarks/sweep_gemm_configs.py``, now through ``python -m helion_backend tune --effort sweep``);
editing a tuple changes what later sweeps can find, so results stay comparable only while they stay.
"""

from __future__ import annotations

from collections.abc import Sequence

import helion
import torch

from helion_backend.kernels.configs import GEMV, NUM_SMS, PAIRED_LOADS, PREQUANTIZE, SWAP_AB
from helion_backend.kernels.family import FAMILIES
from helion_backend.kernels.gemm import glu_kernel_config
from helion_backend.tuning.problems import TuneKey, quantizes_its_rows, wrapper_keys
from helion_backend.vocabulary import FP8_BLOCK

Candidate = tuple[int, int, int, int, int, int, str]
# (block_m, block_n, block_k, num_warps, num_stages, split_k, indexing). At one row Helion makes the M tile
# one row; at more it keeps block_m and masks the rows past M. "tensor_descriptor" loads through TMA where
# the tensor allows it (Helion falls back to pointers where it does not).
CANDIDATES: tuple[Candidate, ...] = (
    (16, 32, 256, 4, 3, 1, "pointer"),
    (16, 64, 128, 4, 4, 1, "pointer"),
    (16, 32, 512, 4, 3, 1, "pointer"),
    (16, 32, 256, 4, 3, 1, "tensor_descriptor"),
    # Deeper pipelines: they beat the shallower ones on the o and down projections at M = 1 and 8.
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
    # The same with N tiles of 16: twice the programs of 32-wide tiles, the weight still streamed once. The
    # shared q/k/v launch has no split-K, so at M = 32 the tiles above leave too few programs to fill the GPU.
    (32, 16, 512, 4, 3, 1, "pointer"),
    (32, 16, 256, 4, 4, 1, "pointer"),
)
# One row as a GEMV (``gemv``: kernels/gemm.py's ``gemv_kernel``, no dot, no split-K; a few rows through
# :func:`gemv_rows`): 16-bit inputs, and fp8/int8 rows and weights or a float row and an int8 weight (their
# wrapper's GEMV; see gemv_candidates).
# With ``mode="max-autotune"`` Inductor rewrites a one-row ``mm`` as a multiply and a sum, and its reduction
# kernel beats a one-row dot on every Qwen3 shape without a bias.
# As in that reduction, each K step only multiplies and adds into a [N block, K block] accumulator, K
# summed once after the loop; narrow N tiles (down to one column) give hundreds of programs, and 16-byte
# loads run along K (the weight's contiguous dimension). The accumulator takes N block x K block / (32 x
# warps) registers a thread: 16 to 64 here. Mostly one stage (Triton pipelines the loads that feed a dot);
# two with three, in case the loads of this loop are pipelined too.
GEMV_CANDIDATES = (
    (16, 1, 2048, 4, 1, 1, "pointer"),
    (16, 2, 1024, 4, 1, 1, "pointer"),
    (16, 2, 2048, 8, 1, 1, "pointer"),
    (16, 4, 512, 4, 1, 1, "pointer"),
    (16, 4, 1024, 4, 1, 1, "pointer"),
    (16, 4, 1024, 8, 1, 1, "pointer"),
    (16, 8, 256, 4, 1, 1, "pointer"),
    (16, 8, 512, 4, 1, 1, "pointer"),
    (16, 16, 256, 8, 1, 1, "pointer"),
    (16, 4, 512, 4, 3, 1, "pointer"),
    (16, 8, 512, 8, 3, 1, "pointer"),
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
# kernels stream at the rate of the bytes they keep in flight: with the 16-bit candidates, the sweeps picked
# the deepest tile on offer at nearly every key and fp8 GEMMs streamed at half the 16-bit rate. So the K
# blocks go to 1024 and the pipelines deeper.
ONE_BYTE_CANDIDATES = (
    (16, 32, 1024, 4, 3, 1, "pointer"),
    (16, 64, 512, 4, 3, 1, "pointer"),
    (16, 32, 512, 4, 5, 1, "pointer"),
    (16, 32, 1024, 4, 3, 2, "pointer"),
    (16, 64, 512, 4, 4, 2, "pointer"),
    (32, 32, 512, 4, 3, 1, "pointer"),
    (32, 64, 512, 8, 3, 1, "pointer"),
    # More warps on an SM for the fp8 dot's 16-row tiles, which convert both operands to f16 in registers
    # before mma.sync (96 conversions a thread a 16 x 32 x 512 step, in their PTX): N tiles of 16 give 256
    # programs at N = 4096 where 32 give one per SM, or 8 warps one program (the M = 32 k and v keys pick
    # the second).
    (16, 16, 512, 4, 3, 1, "pointer"),
    (16, 16, 1024, 4, 3, 1, "pointer"),
    (16, 32, 512, 8, 3, 1, "pointer"),
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
    # One group of 128 (64 bytes) a step, or half of one: a step reads one row of scales (``group_steps``)
    # instead of each byte's, so wider N tiles and deeper pipelines.
    (16, 32, 64, 4, 4, 1, "pointer"),
    (16, 64, 64, 4, 4, 2, "pointer"),
    (16, 128, 64, 4, 4, 1, "pointer"),
    (16, 256, 64, 8, 3, 1, "pointer"),
    (16, 128, 32, 4, 5, 1, "pointer"),
)
# int4 at one row as a GEMV (``gemv``: ``int4_gemv_kernel``): the 16-bit GEMV's tiles with K blocks in bytes,
# half as deep, so that a step makes as many products (two a byte) and holds as many accumulators; then
# one-group steps (64 bytes) over wider N tiles.
INT4_GEMV_CANDIDATES = (*((bm, bn, bk // 2, w, s, sk, ix) for bm, bn, bk, w, s, sk, ix in GEMV_CANDIDATES),
                        (16, 16, 64, 4, 3, 1, "pointer"), (16, 32, 64, 4, 3, 1, "pointer"),
                        (16, 64, 64, 8, 3, 1, "pointer"))
# The shallowest K block a GEMV candidate gets at more rows (:func:`gemv_rows`): 32 values (int4: bytes).
MIN_GEMV_BLOCK_K = 32
# int4 with the operands swapped (``swap_ab``: ``swapped_int4_gemm_kernel``): the one-byte swapped tiles, K
# blocks in bytes, half as deep, and one-group steps.
INT4_SWAPPED_CANDIDATES = ((16, 64, 128, 4, 4, 1, "pointer"), (16, 64, 128, 4, 3, 2, "pointer"),
                           (16, 64, 256, 4, 3, 1, "pointer"), (16, 128, 128, 4, 3, 1, "pointer"),
                           (16, 128, 128, 8, 3, 2, "pointer"), (32, 64, 128, 4, 4, 1, "pointer"),
                           (32, 128, 128, 8, 3, 1, "pointer"), (16, 64, 64, 4, 4, 4, "pointer"),
                           (16, 64, 64, 4, 4, 1, "pointer"), (16, 128, 64, 4, 4, 1, "pointer"),
                           (16, 128, 64, 8, 4, 1, "pointer"), (16, 256, 64, 8, 3, 1, "pointer"))
# Block fp8: the K block is always one group (FP8_BLOCK), so only the M and N tiles, warps, stages and
# splits vary.
BLOCK_FP8_CANDIDATES = tuple(
    (bm, bn, FP8_BLOCK, w, s, sk, "pointer")
    for bm, bn, w, s, sk in ((16, 32, 4, 3, 1), (16, 64, 4, 3, 1), (16, 128, 4, 3, 1), (16, 64, 4, 4, 2),
                             (16, 32, 4, 3, 4), (16, 128, 8, 3, 2), (32, 64, 4, 3, 1), (32, 128, 8, 3, 1))
)
# Block fp8 with ``prequantize``: the groups dequantized up front, the weight scaled in the K loop, so the K
# block is free; the weight-only int8 kernel's winners (a one-byte weight converted in the loop), with N
# blocks of at most one weight block.
BLOCK_FP8_PREQUANTIZED_CANDIDATES = (
    (16, 32, 512, 4, 3, 1, "pointer"),
    (16, 64, 512, 4, 3, 1, "pointer"),
    (16, 64, 128, 4, 4, 1, "pointer"),
    (16, 32, 1024, 4, 3, 1, "pointer"),
    (16, 32, 256, 4, 3, 2, "pointer"),
    (16, 64, 256, 4, 3, 2, "pointer"),
    (32, 32, 256, 4, 3, 1, "pointer"),
    (32, 32, 512, 4, 3, 1, "pointer"),
)
# fp8 x fp8 and int8 x int8 in 64-row tiles from M = 2 on: Triton then multiplies with Hopper's wgmma, which
# reads both operands from shared memory as loaded (fp8 natively), where the 16-row tiles run mma.sync and
# convert every fp8 weight to f16 in registers first (their PTX, compiled for sm_90 on the CPU). The rows past
# M are masked, so they cost shared memory and tensor-core time, not HBM traffic. At M = 1 Helion gives the
# rows a block of 1 whatever the config says: the single GEMM's wrapper then runs the row as two (the shared
# launch's and the gated kernel's do not, so there these would only repeat the 16-row candidates).
WGMMA_CANDIDATES = (
    (64, 32, 512, 4, 3, 1, "pointer"),
    (64, 64, 256, 4, 3, 1, "pointer"),
    (64, 64, 256, 4, 3, 1, "tensor_descriptor"),
    (64, 32, 256, 4, 4, 2, "pointer"),
    (64, 32, 512, 4, 3, 2, "pointer"),
    (64, 64, 256, 4, 3, 2, "pointer"),
)
# The one-byte GEMMs with the operands swapped (``swap_ab``: ``swapped_lowp_gemm_kernel``, ``w @ x.T``): the
# weight fills the dot's 64-row side, so N blocks of 64 or 128 (and with them fewer programs: split-K makes up
# the count), and the row block needs only cover M. A 64-row x tile of the plain dot took 32 KB of shared
# memory a stage at 512-deep K blocks for 8 real rows, twice the weight's 16 KB; here the rows take 8 KB.
SWAPPED_CANDIDATES = (
    (16, 64, 256, 4, 4, 1, "pointer"),
    (16, 64, 512, 4, 3, 1, "pointer"),
    (16, 64, 256, 4, 4, 2, "pointer"),
    (16, 64, 512, 4, 3, 2, "pointer"),
    (16, 128, 256, 4, 3, 1, "pointer"),
    (16, 128, 256, 8, 3, 2, "pointer"),
    (32, 64, 256, 4, 4, 1, "pointer"),
    (32, 64, 512, 4, 3, 2, "pointer"),
    (16, 64, 256, 4, 4, 4, "pointer"),
    (16, 64, 512, 4, 3, 4, "pointer"),
    (32, 64, 256, 4, 4, 4, "pointer"),
)
# Splits beyond this many CTAs only add partial sums to write and read back.
MAX_SPLIT_CTAS = 4 * NUM_SMS


def candidate_configs(m: int, n: int, candidates: Sequence[Candidate] = CANDIDATES, pad_rows: bool = False,
                      **extra: object) -> list[helion.Config]:
    """The candidates that make sense at this M and N: block_m above M is skipped unless ``pad_rows`` (a
    16-row block always fits), and so are oversplit grids."""
    return [
        helion.Config(block_sizes=[bm, bn, bk], num_warps=w, num_stages=s, split_k=sk, indexing=ix, **extra)
        for bm, bn, bk, w, s, sk, ix in candidates
        if (bm <= 16 or m > 16 or pad_rows) and (sk == 1 or -(-n // bn) * -(-m // bm) * sk <= MAX_SPLIT_CTAS)
    ]


def one_byte_candidates(m: int, n: int, one_row: bool = False, **extra: object) -> list[helion.Config]:
    """The candidates of a GEMM of one-byte inputs (fp8 or int8 rows and weights): the quantized families'
    tiles, the deep one-byte ones, and the 64-row wgmma ones (:func:`wgmma_candidates`)."""
    tiles = candidate_configs(m, n, QUANT_CANDIDATES + ONE_BYTE_CANDIDATES, **extra)
    return tiles + wgmma_candidates(m, n, one_row, **extra)


def wgmma_candidates(m: int, n: int, one_row: bool = False, **extra: object) -> list[helion.Config]:
    """:data:`WGMMA_CANDIDATES` at this M and N; at one row only for a kernel that runs the row as two
    (``one_row``)."""
    return candidate_configs(m, n, WGMMA_CANDIDATES, pad_rows=True, **extra) if m > 1 or one_row else []


def int4_candidates(key: TuneKey) -> list[helion.Config]:
    """int4's own K blocks, each also with ``paired_loads``, then its swapped form; at a few rows also its GEMV
    form."""
    m, n = key.m, key.n
    return (candidate_configs(m, n, INT4_CANDIDATES) + candidate_configs(m, n, INT4_CANDIDATES, **{PAIRED_LOADS: True})
            + candidate_configs(m, n, INT4_SWAPPED_CANDIDATES, **{SWAP_AB: True})
            + gemv_candidates(key, INT4_GEMV_CANDIDATES))


def block_fp8_candidates(key: TuneKey) -> list[helion.Config]:
    """Block fp8's one-group K blocks, and with ``prequantize`` deeper ones."""
    m, n = key.m, key.n
    return candidate_configs(m, n, BLOCK_FP8_CANDIDATES) + candidate_configs(
        m, n, BLOCK_FP8_PREQUANTIZED_CANDIDATES, **{PREQUANTIZE: True})


def weight_only_candidates(key: TuneKey) -> list[helion.Config]:
    """The int8 weight-only family's: a float activation, the weight converted in registers anyway (the
    one-byte deep tiles), then its GEMV and swapped forms."""
    tiles = candidate_configs(key.m, key.n, QUANT_CANDIDATES + ONE_BYTE_CANDIDATES)
    return tiles + gemv_candidates(key) + swapped_candidates(key)


def row_quant_candidates(key: TuneKey) -> list[helion.Config]:
    """fp8's and int8's: the one-byte deep tiles and the 64-row ones. A site that quantizes its own rows also
    tries the quantized families' tiles, and the deep and 64-row ones only with ``prequantize`` (the rows
    quantized once, by a kernel of their own), as that won every such fp8 and int8 key; for any other site
    the key would change nothing, and each config is timed once. Then the GEMV and swapped forms."""
    m, n = key.m, key.n
    if not quantizes_its_rows(key):
        tiles = one_byte_candidates(m, n, one_row=True)
    else:
        tiles = candidate_configs(m, n, QUANT_CANDIDATES) + one_byte_candidates(m, n, one_row=True,
                                                                                **{PREQUANTIZE: True})
    return tiles + gemv_candidates(key) + swapped_candidates(key)


def glu_candidates(m: int, n: int) -> list[helion.Config]:
    """The 16-bit candidates as the gated kernel runs them (so that the table records what runs), each once."""
    return list(dict.fromkeys(glu_kernel_config(c, torch.bfloat16.itemsize, False) for c in candidate_configs(m, n)))


def sweep_configs(key: TuneKey, current: helion.Config) -> list[helion.Config]:
    """What the ``sweep`` effort times at ``key``, in order: the family's candidates, then today's config
    (``current``), each once. The tune command's compile workers run the same list ahead of the timing."""
    return list(dict.fromkeys([*candidates_for(key), current]))


def candidates_for(key: TuneKey) -> list[helion.Config]:
    """The family's candidates at this key's M and N (its registry row's)."""
    return FAMILIES[key.kernel].candidates(key)


def float_candidates(key: TuneKey) -> list[helion.Config]:
    """The 16-bit GEMM's: the tile candidates, then its GEMV form at one row."""
    return candidate_configs(key.m, key.n) + gemv_candidates(key)


def glu_family_candidates(key: TuneKey) -> list[helion.Config]:
    return glu_candidates(key.m, key.n)


def quantized_glu_candidates(key: TuneKey) -> list[helion.Config]:
    """The gated kernel on quantized rows: the quantized candidates as it runs them, each once."""
    return list(dict.fromkeys(glu_kernel_config(c, 1, False) for c in one_byte_candidates(key.m, key.n)))


def multi_candidates(key: TuneKey) -> list[helion.Config]:
    """A shared launch's: no split-K (the outputs' tiles supply the parallelism)."""
    return [c for c in candidate_configs(key.m, key.n, CANDIDATES) if c["split_k"] == 1]


def quantized_multi_candidates(key: TuneKey) -> list[helion.Config]:
    """A shared launch on quantized rows: :func:`multi_candidates` and the one-byte and 64-row tiles."""
    candidates = [*candidate_configs(key.m, key.n, CANDIDATES), *candidate_configs(key.m, key.n, ONE_BYTE_CANDIDATES),
                  *wgmma_candidates(key.m, key.n)]
    return [c for c in candidates if c["split_k"] == 1]


def swapped_candidates(key: TuneKey) -> list[helion.Config]:
    """:data:`SWAPPED_CANDIDATES` (``swap_ab``) where the key's wrapper runs the swapped kernel, with
    ``prequantize`` on a site that quantizes its own rows (the wrapper quantizes them first anyway)."""
    if SWAP_AB not in wrapper_keys(key):
        return []
    rows = {PREQUANTIZE: True} if quantizes_its_rows(key) else {}
    return candidate_configs(key.m, key.n, SWAPPED_CANDIDATES, **{SWAP_AB: True}, **rows)


def gemv_candidates(key: TuneKey, tiles: Sequence[Candidate] = GEMV_CANDIDATES) -> list[helion.Config]:
    """The GEMV ``tiles`` (``gemv``; int4 has its own), at the key's rows (:func:`gemv_rows`), where the key's
    wrapper runs the GEMV kernel: a few rows of the 16-bit, fp8, int8, int8 and int4 weight-only GEMMs."""
    if GEMV not in wrapper_keys(key):
        return []
    return candidate_configs(key.m, key.n, gemv_rows(key.m, tiles), **{GEMV: True})


def gemv_rows(m: int, candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """GEMV candidates (tuned at one row) as M rows run them. At one row Helion makes the M tile one row
    whatever block_m says; above it the tile is block_m rows, masked, and a step holds block_m x N block x K
    block products. So block_m becomes M's next power of two, and the K block shrinks as many times (to no
    less than :data:`MIN_GEMV_BLOCK_K`), which keeps a thread's products and the N tiles' grid as at one row."""
    if m == 1:
        return tuple(candidates)
    rows = gemv_row_block(m)
    return tuple(dict.fromkeys((rows, bn, max(bk // rows, MIN_GEMV_BLOCK_K), warps, stages, split_k, indexing)
                               for _, bn, bk, warps, stages, split_k, indexing in candidates))


def gemv_row_block(m: int) -> int:
    """The M block of the GEMV tiles at ``m`` > 1 rows (:func:`gemv_rows`): M's next power of two."""
    return 1 << (m - 1).bit_length()
