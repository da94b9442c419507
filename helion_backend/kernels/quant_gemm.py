"""Quantized GEMMs as Helion kernels: fp8 and int8 with dynamic per-token activation quantization,
pre-quantized inputs, and int8 weight-only, each with the shared epilogue before the one store.

``quant_gemm_kernel`` quantizes the activation itself: for its rows it first takes the amax over all of
K (the activation is a few hundred KB at decode sizes and stays in L2), turns it into the per-token
scale, then quantizes each K block on its way into the tensor cores, multiplies in fp8 (fp32
accumulator) or int8 (int32 accumulator), rescales the rows, and runs the shared epilogue on the fp32
result before the one store. The quantization is the graph's own ops, replayed
(:mod:`helion_backend.semantics.quant_program`), so the kernel computes what the model wrote.

Every output tile quantizes its rows again (an amax pass and a division per element), which costs
little at M = 1 and dominates at M = 8-32. The config key ``prequantize`` (ours, not Helion's) runs the
quantization once instead, in ``quantize_rows_kernel`` (one program per row, writing the quantized
rows and their scales), and the GEMM then multiplies the quantized rows as they are
(``lowp_gemm_kernel``), rescaling them in the epilogue: two launches, and the one store of the output.
By default the backend leaves the quantization to Inductor (fused with the op producing the activation)
and the site runs ``lowp_gemm_kernel`` on the quantized rows: the two paths above, which quantize, run
only with the option ``fuse_activation_quant``.

``lowp_gemm_kernel`` multiplies inputs as they come: fp8 x fp8 or int8 x int8 (already quantized), or a
float activation with a one-byte weight converted block by block (int8 weight-only, block fp8's weight).
At a few rows the config key ``gemv`` runs the same inputs through :func:`.gemm.gemv_kernel` instead (products
in fp32, int8 x int8 ones in int32; no tensor-core dot), on rows quantized before it (as with
``prequantize``, where the site quantizes).

``swapped_lowp_gemm_kernel`` (config key ``swap_ab``) multiplies the same inputs with the operands swapped,
``w @ x.T``, and transposes each tile back before the epilogue: on Hopper the dot's 64-row side is then the
weight's, not a few rows padded to 64.

``int4_gemm_kernel`` reads a packed int4 weight (two columns of K per byte) and its group scales, and
dequantizes each block in registers exactly as the graph did (nibble, minus the zero point, times the
scale, rounded to the activation's dtype) before the tensor cores multiply it in that dtype. The config
key ``paired_loads`` (ours) reads the activation's even and odd columns as contiguous pairs instead of two
stride-2 views. At a few rows the config key ``gemv`` runs ``int4_gemv_kernel`` instead: the same
dequantization, products in fp32 summed over K after the loop (no dot, so N tiles down to one column), the
weight read as the layer stores it, [N, K/2] bytes along contiguous K. The config key ``swap_ab`` runs
``swapped_int4_gemm_kernel``: the same weight read the same way, multiplied as ``w @ x.T`` so that its rows
fill the dot's 64-row side. On CUDA, for bf16 and fp16 activations, all three dequantize by bit operations
(inline PTX, :mod:`.int4_nibbles`), with the graph's values bit for bit; where the K block lies in one
group of scales they read one row of scales a step instead of gathering each byte's.

``tinygemm_gemm`` runs PyTorch's int4 GEMM instead (:mod:`.tinygemm`) and the epilogue over its product in the
split-K finishing kernel: a site whose weights are frozen runs it where the config table timed it faster.

``block_fp8_gemm_kernel`` quantizes each 1 x B group of the activation in its K loop, one group a step.
With ``prequantize`` block fp8 runs two kernels instead: ``dequantize_groups_kernel`` quantizes every group
once and multiplies it back by its scale, and ``lowp_gemm_kernel`` multiplies those rows by the fp8 weight
scaled block by block as it is loaded, in K blocks of any depth.

Split-K works as in :mod:`.gemm`: each split stores its fp32 partial sums (already rescaled by the
per-token scale, which distributes over the sum) and :func:`.gemm.epilogue_kernel` finishes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from .helion_import import helion  # isort: skip  (first: it defers scikit-learn)
import helion.language as hl
import torch
from helion.autotuner import PowerOfTwoFragment

from helion_backend import tables
from helion_backend.kernels.configs import GEMV, PAIRED_LOADS, PREQUANTIZE, SWAP_AB, config_for, split_key
from helion_backend.kernels.gemm import (
    Layout,
    Signature,
    check_family_steps,
    check_gemm_shapes,
    check_operands,
    compiled_kernel,
    finish_split_k,
    gemv_helion,
    gemv_kernel_config,
    run_epilogue_pass,
    split_k_target,
    tile_epilogue,
)
from helion_backend.kernels.int4_nibbles import Nibbles, int4_dequantizer
from helion_backend.kernels.tinygemm import prepared_operands, tinygemm_mm, tinygemm_problem
from helion_backend.semantics import quant_program as program_module
from helion_backend.semantics.quant_program import QuantProgram
from helion_backend.vocabulary import (
    ACT_SCALE,
    FP8_BLOCK,
    FP8_BLOCK_FAMILY,
    FP8_FAMILY,
    INT4_FAMILY,
    QUANT_DTYPES,
    SUPPORTED_DTYPES,
    TOKEN_SCALE,
)

log = logging.getLogger(__name__)

# One program per row: a row is at most ~50 KB of activation, read twice (amax, then quantize).
QUANTIZE_ROWS_CONFIG = helion.Config(block_sizes=[1, 1024, 1024], num_warps=4, num_stages=2)
# Block fp8's groups: eight groups of one row a program (1024 values, as a row program above reads per step).
DEQUANTIZE_GROUPS_CONFIG = helion.Config(block_sizes=[1, 8], num_warps=4, num_stages=1)


@helion.kernel(static_shapes=True, autotune_effort="none")
def quant_gemm_kernel(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    reduced: Callable[[torch.Tensor], torch.Tensor],
    scale_of: Callable[[torch.Tensor], torch.Tensor],
    quantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """``out[0] = epilogue(s * (quantize(x) @ w))`` with ``split_k == 1``; else ``out[i]`` = split i's part."""
    m, k = x.size()
    n = w.size(1)
    block_m = hl.register_block_size(m)
    block_n = hl.register_block_size(n)
    block_k = hl.register_block_size(k)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k, split_k), 256) * 256
    acc_dtype = torch.int32 if w.dtype == torch.int8 else torch.float32
    for tile_m, tile_n, tile_split in hl.tile([m, n, k], block_size=[block_m, block_n, k_per_split]):
        row_max = hl.full([tile_m], float("-inf"), dtype=torch.float32)
        for tile_k in hl.tile(k, block_size=block_k):
            values = reduced(x[tile_m, tile_k]).to(torch.float32)
            row_max = torch.maximum(row_max, torch.amax(values, dim=1))
        amax = row_max[:, None]
        scale = scale_of(amax)
        acc = hl.zeros([tile_m, tile_n], dtype=acc_dtype)
        for tile_k in hl.tile(tile_split.begin, tile_split.end, block_size=block_k):
            acc = hl.dot(quantize(x[tile_m, tile_k], amax, scale), w[tile_k, tile_n], acc=acc)
        result = acc.to(torch.float32) * scale.to(torch.float32)
        if split_k == 1:
            result = epilogue(result, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = result.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none")
def quantize_rows_kernel(
    x: torch.Tensor,
    quantized_out: torch.Tensor,
    scale_out: torch.Tensor,
    reduced: Callable[[torch.Tensor], torch.Tensor],
    scale_of: Callable[[torch.Tensor], torch.Tensor],
    quantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """``quantized_out[i]`` and ``scale_out[i]``: row i quantized as the program says, and its scale."""
    m, k = x.size()
    for tile_m in hl.tile(m):
        row_max = hl.full([tile_m], float("-inf"), dtype=torch.float32)
        for tile_k in hl.tile(k):
            row_max = torch.maximum(row_max, torch.amax(reduced(x[tile_m, tile_k]).to(torch.float32), dim=1))
        scale = scale_of(row_max)
        scale_out[tile_m] = scale.to(scale_out.dtype)
        for tile_k in hl.tile(k):
            quantized_out[tile_m, tile_k] = quantize(x[tile_m, tile_k], row_max[:, None], scale[:, None])


@helion.kernel(static_shapes=True, autotune_effort="none")
def lowp_gemm_kernel(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """``out[0] = epilogue(x @ w)`` for fp8/int8 inputs, or a float x with a one-byte w converted in the
    loop: int8 (weight-only), or fp8 with its block scales ``w_scale`` [K/B, N/B], every weight row times its
    block's scale before the multiply (block fp8 on rows dequantized before the call; an N tile lies inside
    one weight block, so a row's scale is one load). Helion specializes ``w_scale=None`` away."""
    m, k = x.size()
    n = w.size(1)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k, split_k), 256) * 256
    acc_dtype = torch.int32 if x.dtype == torch.int8 else torch.float32
    for tile_m, tile_n, tile_split in hl.tile([m, n, k], block_size=[None, None, k_per_split]):
        acc = hl.zeros([tile_m, tile_n], dtype=acc_dtype)
        for tile_k in hl.tile(tile_split.begin, tile_split.end):
            if w_scale is None:
                weight = w[tile_k, tile_n].to(x.dtype)
            else:
                block = k // w_scale.size(0)  # B as a constant (a module global would be a kernel argument)
                row_scale = w_scale[tile_k.index // block, tile_n.begin // block]
                weight = (w[tile_k, tile_n].to(torch.float32) * row_scale[:, None]).to(x.dtype)
            acc = hl.dot(x[tile_m, tile_k], weight, acc=acc)
        result = acc.to(torch.float32)
        if split_k == 1:
            result = epilogue(result, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = result.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none")
def swapped_lowp_gemm_kernel(
    x: torch.Tensor,
    w_nk: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """``lowp_gemm_kernel`` (without block scales) with the operands swapped: each program computes
    ``(w_nk @ x.T)`` for an [N block, M block] tile, then transposes it for the epilogue and the store.
    Hopper's wgmma takes 64 rows of its first operand: in ``x @ w`` those are x's, mostly masked padding at
    decode sizes (a 64-row x tile in shared memory for 8 real rows, taking the room of the weight's
    stages); swapped, the 64 rows are the weight's and the row block only needs to cover M. Block sizes in
    ``gemm_kernel``'s order, [M, N, K], so that the config table reads the same."""
    m, k = x.size()
    n = w_nk.size(0)
    block_m, block_n, block_k = hl.register_block_size(m), hl.register_block_size(n), hl.register_block_size(k)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k, split_k), 256) * 256
    acc_dtype = torch.int32 if x.dtype == torch.int8 else torch.float32
    for tile_n, tile_m, tile_split in hl.tile([n, m, k], block_size=[block_n, block_m, k_per_split]):
        acc = hl.zeros([tile_n, tile_m], dtype=acc_dtype)
        for tile_k in hl.tile(tile_split.begin, tile_split.end, block_size=block_k):
            acc = hl.dot(w_nk[tile_n, tile_k].to(x.dtype), x[tile_m, tile_k].T, acc=acc)
        result = acc.to(torch.float32).T
        if split_k == 1:
            result = epilogue(result, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = result.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")
def int4_gemm_kernel(
    x_pairs: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    paired_loads: bool,
    group_steps: bool,
    nibbles: Nibbles,
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """``out[0] = epilogue(x @ dequant(packed, scales))`` with ``split_k == 1``; else ``out[i]`` = split i's part.

    ``packed`` is [K/2, N] bytes: row j holds the weights of x's columns 2j (low nibble) and 2j + 1 (high
    nibble), which ``x_pairs``, x seen as [M, K/2, 2], holds side by side; so the K loop runs over bytes (the
    K block counts bytes) and each step makes two dots of half the depth, one per nibble. ``scales`` is
    [K/G, N]; each byte row reads the scale of its group, which holds both its columns (G is even), and
    likewise its zero point from ``zeros`` [K/G, N] (which ``nibbles`` reads only for a format with zero
    points; the fixed one's loads are dead code).
    ``paired_loads`` (a compile-time constant, ``hl.constexpr``) loads each [block_m, block_k, 2] tile of
    pairs and splits it in registers; else the even and odd columns are loaded apart, as two stride-2 views,
    one value a load. ``nibbles`` dequantizes a tile of bytes with their scales (:mod:`.int4_nibbles`).
    ``group_steps`` (``hl.constexpr``, where the K block divides a group) reads one row of scales a step
    instead of gathering each byte's.
    """
    m, k_bytes, _ = x_pairs.size()
    n = packed.size(1)
    group_bytes = k_bytes // scales.size(0)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k_bytes, split_k), 256) * 256
    for tile_m, tile_n, tile_split in hl.tile([m, n, k_bytes], block_size=[None, None, k_per_split]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(tile_split.begin, tile_split.end):
            pair = packed[tile_k, tile_n]
            if group_steps:
                scale = scales[tile_k.begin // group_bytes, tile_n][None, :]
                zero = zeros[tile_k.begin // group_bytes, tile_n][None, :]
            else:
                scale = scales[tile_k.index // group_bytes, tile_n]
                zero = zeros[tile_k.index // group_bytes, tile_n]
            low, high = nibbles(pair, scale, zero)
            if paired_loads:
                x_even, x_odd = hl.split(x_pairs[tile_m, tile_k, :])
            else:
                x_even, x_odd = x_pairs[tile_m, tile_k, 0], x_pairs[tile_m, tile_k, 1]
            acc = hl.dot(x_even, low, acc=acc)
            acc = hl.dot(x_odd, high, acc=acc)
        result = acc
        if split_k == 1:
            result = epilogue(result, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = result.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")
def swapped_int4_gemm_kernel(
    x_pairs: torch.Tensor,
    packed_nk: torch.Tensor,
    scales_ng: torch.Tensor,
    zeros_ng: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    group_steps: bool,
    nibbles: Nibbles,
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """``int4_gemm_kernel`` with the operands swapped, as ``swapped_lowp_gemm_kernel`` does for one-byte
    weights: each program computes ``dequant(packed_nk) @ x.T`` for an [N block, M block] tile, then
    transposes it for the epilogue and the store. The weight is read as the layer stores it ([N, K/2] bytes,
    contiguous along K, with its [N, K/G] scales and zero points) and fills the dot's 64-row side; x's even
    and odd columns come as pairs (``x_pairs``, x seen as [M, K/2, 2]). Block sizes [M, N, K], K in bytes."""
    m, k_bytes, _ = x_pairs.size()
    n = packed_nk.size(0)
    group_bytes = k_bytes // scales_ng.size(1)
    block_m, block_n, block_k = hl.register_block_size(m), hl.register_block_size(n), hl.register_block_size(k_bytes)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k_bytes, split_k), 256) * 256
    for tile_n, tile_m, tile_split in hl.tile([n, m, k_bytes], block_size=[block_n, block_m, k_per_split]):
        acc = hl.zeros([tile_n, tile_m], dtype=torch.float32)
        for tile_k in hl.tile(tile_split.begin, tile_split.end, block_size=block_k):
            pair = packed_nk[tile_n, tile_k]
            if group_steps:
                scale = scales_ng[tile_n, tile_k.begin // group_bytes][:, None]
                zero = zeros_ng[tile_n, tile_k.begin // group_bytes][:, None]
            else:
                scale = scales_ng[tile_n, tile_k.index // group_bytes]
                zero = zeros_ng[tile_n, tile_k.index // group_bytes]
            low, high = nibbles(pair, scale, zero)
            x_even, x_odd = hl.split(x_pairs[tile_m, tile_k, :])
            acc = hl.dot(low, x_even.T, acc=acc)
            acc = hl.dot(high, x_odd.T, acc=acc)
        result = acc.T
        if split_k == 1:
            result = epilogue(result, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = result.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none")
def int4_gemv_kernel(
    x_pairs: torch.Tensor,
    packed_nk: torch.Tensor,
    scales_ng: torch.Tensor,
    zeros_ng: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    group_steps: bool,
    nibbles: Nibbles,
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """``out = epilogue(x @ dequant(packed_nk, scales_ng).T)`` without a tensor-core dot, for decode's one row:
    :func:`.gemm.gemv_kernel`'s form on the int4 weight. ``packed_nk`` is the layer's [N, K/2] bytes (loads
    along contiguous K), ``scales_ng`` and ``zeros_ng`` its [N, K/G] scales and zero points; ``x_pairs`` is x
    seen as [M, N, K/2, 2], stride 0 along N, so each thread loads the x values its bytes multiply, both
    columns of a byte side by side (wide loads; the even and odd columns apart took one load a value).
    Each byte is dequantized as the graph does (nibble, minus the zero point, times the scale, in x's
    dtype), then both its products are taken in fp32. Block sizes [M, N, K], K in bytes; no split-K."""
    m, n, k_bytes, _ = x_pairs.size()
    group_bytes = k_bytes // scales_ng.size(1)
    block_m, block_n, block_k = hl.register_block_size(m), hl.register_block_size(n), hl.register_block_size(k_bytes)
    for tile_m, tile_n in hl.tile([m, n], block_size=[block_m, block_n]):
        products = hl.zeros([tile_m, tile_n, block_k], dtype=torch.float32)
        for tile_k in hl.tile(k_bytes, block_size=block_k):
            pair = packed_nk[tile_n, tile_k]
            if group_steps:
                scale = scales_ng[tile_n, tile_k.begin // group_bytes][:, None]
                zero = zeros_ng[tile_n, tile_k.begin // group_bytes][:, None]
            else:
                scale = scales_ng[tile_n, tile_k.index // group_bytes]
                zero = zeros_ng[tile_n, tile_k.index // group_bytes]
            low, high = nibbles(pair, scale, zero)
            x_even, x_odd = hl.split(x_pairs[tile_m, tile_n, tile_k, :])
            products = (products + x_even.to(torch.float32) * low.to(torch.float32)[None, :, :]
                        + x_odd.to(torch.float32) * high.to(torch.float32)[None, :, :])
        out[tile_m, tile_n] = epilogue(products.sum(-1), operands, scalars, tile_m, tile_n).to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none")
def block_fp8_gemm_kernel(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    reduced: Callable[[torch.Tensor], torch.Tensor],
    scale_of: Callable[[torch.Tensor], torch.Tensor],
    quantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    epilogue: Callable[..., torch.Tensor],
) -> None:
    """Block fp8: ``out[0] = epilogue(sum_kb (q(x_kb) @ w_kb) * sa[:, kb] * sb[kb, nb])`` with ``split_k == 1``.

    The K block is one group (FP8_BLOCK columns): each step quantizes its [block_m, B] slice of the float
    activation as the program says (amax over the group, scale, fp8), multiplies it by the fp8 weight
    block in fp8 (fp32 result), and scales the product by the group's per-row scale and the weight
    block's scale of each column (``w_scale`` is [K/B, N/B]) before adding it to the fp32 accumulator.
    """
    m, k = x.size()
    n = w.size(1)
    block_m = hl.register_block_size(m)
    block_n = hl.register_block_size(n)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k, split_k), 256) * 256
    for tile_m, tile_n, tile_split in hl.tile([m, n, k], block_size=[block_m, block_n, k_per_split]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(tile_split.begin, tile_split.end, block_size=FP8_BLOCK):
            x_block = x[tile_m, tile_k]
            amax = torch.amax(reduced(x_block).to(torch.float32), dim=1, keepdim=True)
            scale = scale_of(amax)
            product = hl.dot(quantize(x_block, amax, scale), w[tile_k, tile_n], out_dtype=torch.float32)
            block_scale = w_scale[tile_k.begin // FP8_BLOCK, tile_n.index // FP8_BLOCK]
            acc = acc + product * scale.to(torch.float32) * block_scale[None, :]
        result = acc
        if split_k == 1:
            result = epilogue(result, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = result.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none")
def dequantize_groups_kernel(
    x: torch.Tensor,
    out: torch.Tensor,
    reduced: Callable[[torch.Tensor], torch.Tensor],
    scale_of: Callable[[torch.Tensor], torch.Tensor],
    quantize: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """``out[i, g] = q(x[i, g]) * s[i, g]`` for ``x`` seen as [M, K/B, B]: each 1 x B group quantized as the
    program says (amax over the group, scale, fp8) and multiplied back by its scale, in ``out``'s dtype."""
    m, groups, _ = x.size()
    for tile_m, tile_g in hl.tile([m, groups]):
        block = x[tile_m, tile_g, :]
        amax = torch.amax(reduced(block).to(torch.float32), dim=-1, keepdim=True)
        scale = scale_of(amax)
        dequantized = quantize(block, amax, scale).to(torch.float32) * scale.to(torch.float32)
        out[tile_m, tile_g, :] = dequantized.to(out.dtype)


def program_functions(program: QuantProgram) -> tuple[Callable, Callable, Callable]:
    """The program's three parts as device functions. Their closures hold only the program's JSON text:
    Helion keys callables by their closures (so one compiled kernel serves every site with the same
    quantization), and it would turn numbers found there into symbols; parsed inside, they stay
    constants of the kernel."""
    text = program.to_json()

    def reduced(x: torch.Tensor) -> torch.Tensor:
        return program_module.reduced_value(program_module.parse_program(text), x)

    def scale_of(amax: torch.Tensor) -> torch.Tensor:
        parsed = program_module.parse_program(text)
        return program_module.scale_from_amax(parsed, amax.to(parsed.amax_dtype))

    def quantize(x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        parsed = program_module.parse_program(text)
        return program_module.quantize(parsed, x, amax.to(parsed.amax_dtype), scale)

    return reduced, scale_of, quantize


def quant_gemm_helion(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    program: QuantProgram | None = None,
    config: helion.Config | None = None,
    config_dir: str | None = None,
    kernel_family: str = FP8_FAMILY,
) -> torch.Tensor:
    """The quantized GEMM + epilogue as a contiguous [M, N] ``out_dtype`` tensor.

    With ``program``, ``x`` is the float activation and the kernel quantizes it as the program says;
    without, ``x`` is multiplied as it is (fp8/int8, or float against an int8 ``w_kn``).
    """
    steps = tuple(steps)
    operands = list(operands)
    scalars = [float(s) for s in scalars]
    _check_inputs(x, w_kn, program)
    sig = Signature(
        Layout.of(x), Layout.of(w_kn), tuple(map(Layout.of, operands)), len(scalars), steps, out_dtype
    )
    check_operands(sig)
    check_family_steps(steps, kernel_family)
    (m, k), n = x.shape, w_kn.shape[1]
    gemm_dtype = program.quant_dtype if program is not None else x.dtype
    if config is None:
        config = config_for(m, k, n, gemm_dtype, x.device, config_dir, kernel_family)
    prequantize, config = split_key(config, PREQUANTIZE)
    # The GEMV and swapped forms multiply rows quantized before them: where the kernel would quantize them,
    # they are first.
    prequantize = (prequantize or bool(config.get(GEMV)) or bool(config.get(SWAP_AB))) and program is not None
    if prequantize:
        quantized, scale = quantize_rows_helion(program, x)
        # The rows' scale becomes an epilogue operand; it commutes with the scaling steps before act_scale.
        steps = (TOKEN_SCALE, *(s for s in steps if s != ACT_SCALE))
        operands = [scale.view(m, 1).expand(m, n), *operands]
        return quant_gemm_helion(quantized, w_kn, steps, operands, scalars, out_dtype, None, config=config,
                                 kernel_family=kernel_family)
    gemv, config = split_key(config, GEMV)
    if gemv:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
        return gemv_helion(x, w_kn, out, operands, scalars, tile_epilogue(steps), sig, config)
    swap_ab, config = split_key(config, SWAP_AB)
    if m == 1 and program is None and not swap_ab and config.get("block_sizes", [0])[0] > 16:
        # One row gets a row block of 1 whatever the config says (Helion pads the dot itself, for mma.sync);
        # two identical rows take the config's block, and 64 rows run Hopper's wgmma. (Swapped, the rows are
        # the dot's narrow side, which any block covers.)
        rows = [op if op.ndim == 1 else _two_rows(op) for op in operands]
        return quant_gemm_helion(_two_rows(x), w_kn, steps, rows, scalars, out_dtype, None, config=config,
                                 kernel_family=kernel_family)[:1]
    epilogue = tile_epilogue(steps)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    split_k = config.get("split_k", 1)
    target = split_k_target(out, k, split_k)
    if swap_ab:
        kernel, args = swapped_lowp_gemm_kernel, (x, w_kn.t(), target, operands, scalars, epilogue)
    elif program is not None:
        kernel, args = quant_gemm_kernel, (x, w_kn, target, operands, scalars, *program_functions(program), epilogue)
    else:
        kernel, args = lowp_gemm_kernel, (x, w_kn, None, target, operands, scalars, epilogue)
    compiled_kernel(kernel, args, (sig, program), config, target.shape[0])(*args)
    return finish_split_k(target, out, split_k, sig, operands, scalars, epilogue)


def _two_rows(t: torch.Tensor) -> torch.Tensor:
    """A one-row [1, ...] tensor as two identical rows: a stride-0 view, nothing copied."""
    return t.expand(2, *t.shape[1:])


def quantize_rows_helion(program: QuantProgram, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_quantized [M, K], scale [M])`` from :func:`quantize_rows_kernel`: what
    :func:`helion_backend.quant_program.quantize_rows` computes, in one Helion launch."""
    m, k = x.shape
    quantized = torch.empty((m, k), dtype=program.quant_dtype, device=x.device)
    scale = torch.empty(m, dtype=program.scale_dtype, device=x.device)
    args = (x, quantized, scale, *program_functions(program))
    compiled_kernel(quantize_rows_kernel, args, (Layout.of(x), program), QUANTIZE_ROWS_CONFIG, 1)(*args)
    return quantized, scale


def _check_inputs(x: torch.Tensor, w_kn: torch.Tensor, program: QuantProgram | None) -> None:
    check_gemm_shapes(Layout.of(x), Layout.of(w_kn))
    quantized = program.quant_dtype if program is not None else x.dtype
    if w_kn.dtype not in QUANT_DTYPES.values():
        raise ValueError(f"the weight must be one of {list(QUANT_DTYPES.values())}, got {w_kn.dtype}")
    weight_only = program is None and x.dtype in SUPPORTED_DTYPES.values() and w_kn.dtype == torch.int8
    if quantized != w_kn.dtype and not weight_only:
        raise ValueError(f"cannot multiply a {quantized} activation by a {w_kn.dtype} weight")


def int4_gemm_helion(
    x: torch.Tensor,
    packed_kn: torch.Tensor,
    group_scales: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    config: helion.Config | None = None,
    config_dir: str | None = None,
    frozen_weights: bool = False,
) -> torch.Tensor:
    """``epilogue(x @ w)`` for the int4 weight ``w`` [K, N] that ``packed_kn`` (the [K/2, N] view of the packed
    [N, K/2] bytes) and ``group_scales`` ([N, K/G] scales, or [N, K/G, 2] scales and zero points, in x's
    dtype) stand for, as a contiguous [M, N] ``out_dtype`` tensor. The config's K block counts bytes (two
    columns of K). With ``frozen_weights`` (the weight never changes in place) and no ``config`` given,
    :func:`tinygemm_gemm` runs where the config table timed it faster than the table's config."""
    steps, operands, scalars = tuple(steps), list(operands), [float(s) for s in scalars]
    sig = _int4_signature(x, packed_kn, group_scales, steps, operands, scalars, out_dtype)
    (m, k), n = x.shape, packed_kn.shape[1]
    if config is None:
        if frozen_weights and tables.tinygemm_measured_faster(m, k, n, x.dtype, x.device, config_dir, INT4_FAMILY):
            out = _tinygemm_gemm(x, packed_kn, group_scales, sig, operands, scalars)
            if out is not None:
                return out
        config = config_for(m, k, n, x.dtype, x.device, config_dir, INT4_FAMILY)
    paired, config = split_key(config, PAIRED_LOADS)
    gemv, config = split_key(config, GEMV)
    zero_points = group_scales.dim() == 3
    scales_ng, zeros_ng = (group_scales[:, :, 0], group_scales[:, :, 1]) if zero_points else (group_scales,) * 2
    epilogue, nibbles = tile_epilogue(steps), int4_dequantizer(x, zero_points)
    group_steps = _steps_within_groups(config, k // 2 // group_scales.shape[1])
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    # What the kernels specialize on besides the signature: the scales' and zero points' strides, the form.
    variant = (sig, Layout.of(scales_ng), Layout.of(zeros_ng), group_steps, nibbles.__name__)
    if gemv:
        x_pairs = x.reshape(m, 1, k // 2, 2).expand(m, n, k // 2, 2)
        args = (x_pairs, packed_kn.t(), scales_ng, zeros_ng, out, operands, scalars,
                hl.constexpr(group_steps), nibbles, epilogue)
        compiled_kernel(int4_gemv_kernel, args, variant, gemv_kernel_config(config), 1)(*args)
        return out
    swap_ab, config = split_key(config, SWAP_AB)
    split_k = config.get("split_k", 1)
    target = split_k_target(out, k // 2, split_k)
    x_pairs = x.reshape(m, k // 2, 2)
    if swap_ab:
        kernel, args = swapped_int4_gemm_kernel, (x_pairs, packed_kn.t(), scales_ng, zeros_ng, target, operands,
                                                  scalars, hl.constexpr(group_steps), nibbles, epilogue)
    else:
        kernel, args = int4_gemm_kernel, (x_pairs, packed_kn, scales_ng.t(), zeros_ng.t(), target, operands,
                                          scalars, hl.constexpr(paired), hl.constexpr(group_steps), nibbles, epilogue)
        variant = (*variant, paired)
    compiled_kernel(kernel, args, variant, config, target.shape[0])(*args)
    return finish_split_k(target, out, split_k, sig, operands, scalars, epilogue)


def tinygemm_gemm(
    x: torch.Tensor,
    packed_kn: torch.Tensor,
    group_scales: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """:func:`int4_gemm_helion`'s result through tinygemm (:mod:`.tinygemm`): its bf16 product, then the
    epilogue in one pass of the split-K finishing kernel (none where there is nothing to do). The weight's
    tinygemm form is made at the first call and kept beside it. None where tinygemm cannot take the operands
    or the form cannot be made in this call (a CUDA-graph capture): the caller runs a Helion kernel."""
    steps, operands, scalars = tuple(steps), list(operands), [float(s) for s in scalars]
    sig = _int4_signature(x, packed_kn, group_scales, steps, operands, scalars, out_dtype)
    return _tinygemm_gemm(x, packed_kn, group_scales, sig, operands, scalars)


def _tinygemm_gemm(x: torch.Tensor, packed_kn: torch.Tensor, group_scales: torch.Tensor, sig: Signature,
                   operands: list[torch.Tensor], scalars: list[float]) -> torch.Tensor | None:
    """:func:`tinygemm_gemm` on checked inputs (``sig`` their signature)."""
    k, n = x.shape[1], packed_kn.shape[1]
    problem = tinygemm_problem(x.dtype, k, n, k // group_scales.shape[1])
    if problem is not None:
        log.debug("helion_inductor: a Helion kernel runs instead of tinygemm: %s", problem)
        return None
    prepared = prepared_operands(packed_kn.t(), group_scales)
    if prepared is None:
        return None
    product = tinygemm_mm(x, *prepared)
    if not sig.steps and product.dtype == sig.out_dtype:
        return product
    out = torch.empty(product.shape, dtype=sig.out_dtype, device=product.device)
    run_epilogue_pass(product.unsqueeze(0), out, sig, operands, scalars, tile_epilogue(sig.steps))
    return out


def _steps_within_groups(config: helion.Config, group_bytes: int) -> bool:
    """Whether every K step of ``config`` lies in one group of scales: its K block (bytes) divides the
    group's bytes (the steps start at multiples of the block, split-K's parts at multiples of 256 bytes)."""
    block_k = config["block_sizes"][2]
    return block_k <= group_bytes and group_bytes % block_k == 0


def _int4_signature(x: torch.Tensor, packed_kn: torch.Tensor, group_scales: torch.Tensor, steps: tuple[str, ...],
                    operands: list[torch.Tensor], scalars: list[float], out_dtype: torch.dtype) -> Signature:
    """The int4 launch's signature, once its inputs, epilogue operands and steps are checked."""
    _check_int4_inputs(x, packed_kn, group_scales)
    sig = Signature(Layout.of(x), Layout.of(packed_kn), tuple(map(Layout.of, operands)), len(scalars), steps,
                    out_dtype)
    check_operands(sig)
    check_family_steps(steps, INT4_FAMILY)
    return sig


def _check_int4_inputs(x: torch.Tensor, packed_kn: torch.Tensor, group_scales: torch.Tensor) -> None:
    zero_points = group_scales.dim() == 3 and group_scales.shape[2] == 2
    if x.dim() != 2 or packed_kn.dim() != 2 or not (group_scales.dim() == 2 or zero_points):
        raise ValueError(f"expected x [M, K], packed_kn [K/2, N] and group_scales [N, K/G] (or [N, K/G, 2] with "
                         f"zero points), got {tuple(x.shape)}, {tuple(packed_kn.shape)} and "
                         f"{tuple(group_scales.shape)}")
    k, (k_bytes, n), (scale_n, groups) = x.shape[1], packed_kn.shape, group_scales.shape[:2]
    if x.dtype not in SUPPORTED_DTYPES.values() or group_scales.dtype != x.dtype or packed_kn.dtype != torch.uint8:
        raise ValueError(f"expected a float x, uint8 bytes and scales in x's dtype, got {x.dtype}, "
                         f"{packed_kn.dtype} and {group_scales.dtype}")
    if k != 2 * k_bytes or scale_n != n or groups == 0 or k % groups or (k // groups) % 2:
        raise ValueError(f"x [M, K] = {tuple(x.shape)} does not fit packed_kn [K/2, N] = {tuple(packed_kn.shape)} "
                         f"and group_scales [N, K/G] = {tuple(group_scales.shape)} with an even group size G")


def block_fp8_gemm_helion(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    block_scales: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    program: QuantProgram,
    config: helion.Config | None = None,
    config_dir: str | None = None,
) -> torch.Tensor:
    """``epilogue(x @ w)`` for block fp8, as a contiguous [M, N] ``out_dtype`` tensor: the float activation
    ``x`` [M, K] quantized per 1 x B group by ``program``, the fp8 weight ``w_kn`` [K, N] (a view of the
    [N, K] one) with ``block_scales`` [N/B, K/B].

    By default the GEMM kernel quantizes each group on its way into the tensor cores, and the config's K
    block is ignored (it is B). With the config key ``prequantize`` the groups are quantized and multiplied
    back by their scales once, by a kernel of their own, and the GEMM multiplies those rows by the weight
    scaled block by block (any K block; the N block is capped at B)."""
    if x.shape[0] == 1:
        # Helion 1.4 cannot lower the per-group amax of a single row (a reduction over the constant K block
        # of a [1, B] tile fails an assertion), and the call would fall back to the unfused reference: run
        # the row twice and keep one.
        rows = [op if op.ndim == 1 else _two_rows(op) for op in operands]
        out = block_fp8_gemm_helion(_two_rows(x), w_kn, block_scales, steps, rows, scalars, out_dtype,
                                    program, config, config_dir)
        return out[:1]
    steps, operands, scalars = tuple(steps), list(operands), [float(s) for s in scalars]
    _check_block_fp8_inputs(x, w_kn, block_scales, program)
    sig = Signature(Layout.of(x), Layout.of(w_kn), tuple(map(Layout.of, operands)), len(scalars), steps, out_dtype)
    check_operands(sig)
    check_family_steps(steps, FP8_BLOCK_FAMILY)
    (m, k), n = x.shape, w_kn.shape[1]
    if config is None:
        config = config_for(m, k, n, x.dtype, x.device, config_dir, FP8_BLOCK_FAMILY)
    prequantize, config = split_key(config, PREQUANTIZE)
    config = _n_block_within_b(config) if prequantize else _block_k_of_one_group(config)
    epilogue = tile_epilogue(steps)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    split_k = config.get("split_k", 1)
    target = split_k_target(out, k, split_k)
    scales_kn = block_scales.t()
    if prequantize:
        kernel = lowp_gemm_kernel
        args = (dequantize_groups(x, program), w_kn, scales_kn, target, operands, scalars, epilogue)
    else:
        kernel = block_fp8_gemm_kernel
        args = (x, w_kn, scales_kn, target, operands, scalars, *program_functions(program), epilogue)
    key = (sig, Layout.of(scales_kn), program)
    compiled_kernel(kernel, args, key, config, target.shape[0])(*args)
    return finish_split_k(target, out, split_k, sig, operands, scalars, epilogue)


def dequantize_groups(x: torch.Tensor, program: QuantProgram) -> torch.Tensor:
    """``x`` with each 1 x B group quantized as ``program`` says and multiplied back by its scale, in x's
    dtype (:func:`dequantize_groups_kernel`)."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    grouped = (m, k // FP8_BLOCK, FP8_BLOCK)
    args = (x.reshape(grouped), out.view(grouped), *program_functions(program))
    key = (Layout.of(args[0]), program)
    compiled_kernel(dequantize_groups_kernel, args, key, DEQUANTIZE_GROUPS_CONFIG, 1)(*args)
    return out


@functools.cache  # on every launch
def _block_k_of_one_group(config: helion.Config) -> helion.Config:
    """``config`` with its K block dropped: the kernel's K loop has a fixed block of one group, so Helion
    takes only the M and N block sizes."""
    block_sizes = config.get("block_sizes", [])
    rest = {key: value for key, value in config.items() if key != "block_sizes"}
    return helion.Config(block_sizes=list(block_sizes[:2]), **rest)


@functools.cache  # on every launch
def _n_block_within_b(config: helion.Config) -> helion.Config:
    """``config`` with its N block at most B, so that an N tile reads one block scale per K row."""
    block_sizes = list(config.get("block_sizes", []))
    if len(block_sizes) > 1 and block_sizes[1] > FP8_BLOCK:
        block_sizes[1] = FP8_BLOCK
    return helion.Config(**{**config, "block_sizes": block_sizes})


def _check_block_fp8_inputs(x: torch.Tensor, w_kn: torch.Tensor, block_scales: torch.Tensor,
                            program: QuantProgram) -> None:
    if x.dim() != 2 or w_kn.dim() != 2 or x.shape[1] != w_kn.shape[0]:
        raise ValueError(f"expected x [M, K] and w_kn [K, N], got {tuple(x.shape)} and {tuple(w_kn.shape)}")
    (k, n), b = w_kn.shape, FP8_BLOCK
    if k % b or n % b or tuple(block_scales.shape) != (n // b, k // b):
        raise ValueError(f"block fp8 needs K and N multiples of {b} and scales [N/{b}, K/{b}]; got w_kn "
                         f"{tuple(w_kn.shape)} and scales {tuple(block_scales.shape)}")
    if w_kn.dtype != torch.float8_e4m3fn or program.quant_dtype != torch.float8_e4m3fn:
        raise ValueError(f"block fp8 multiplies float8_e4m3fn operands, got a {w_kn.dtype} weight and a "
                         f"{program.quant_dtype} activation quantization")
    if x.dtype not in SUPPORTED_DTYPES.values() or block_scales.dtype != torch.float32:
        raise ValueError(f"expected a float activation and fp32 block scales, got {x.dtype} and {block_scales.dtype}")
