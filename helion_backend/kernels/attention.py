"""Decode attention: ``softmax(q @ k^T * scale + bias) @ v`` for a few query rows over a long KV cache.

At decode, each (batch, head) has one or a few query rows and reads its whole cache: a memory-bound
reduction over the cache length L, where a prefill kernel (cuDNN's or the memory-efficient one, tiled for
long queries) leaves most of the GPU idle. The cache is split into ``split_kv`` chunks so that a small batch still fills the
GPU; each chunk leaves its rows' normalized output and log-sum-exp, and :func:`combine_kernel` merges
the chunks (flash-decoding). With one chunk the kernel writes the output directly.

The softmax runs in base 2 on fp32 scores (``exp2`` of ``log2(e)``-scaled logits); probabilities meet
``v`` in its dtype on the tensor cores, as in flash attention.

With a boolean mask whose masked positions drop out (a fill of -inf, or one at most
:data:`SKIP_READS_FILL`), each chunk stops reading the cache after the last position some row of its
program keeps: a static cache is allocated for the longest sequence and masks the positions past the
current one, which a decode step would otherwise stream from memory for nothing (at position 512 of
1024, half of every layer's K and V). A masked logit's probability is exactly zero whatever the cache
holds there, as long as its row keeps some position. A row that keeps none of a chunk with a finite fill
(cuDNN's -65536) adds the same fill to each of its logits, which the softmax cancels: its chunk is read
whole, as the graph computes it. (With -inf such a row contributes nothing.)
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from .helion_import import helion  # isort: skip  (first: it defers scikit-learn)
import helion.language as hl
import torch
from helion.autotuner import PowerOfTwoFragment

from helion_backend.kernels.gemm import Layout, compiled_kernel
from helion_backend.vocabulary import ATTENTION_DTYPES, ATTENTION_MAX_HEAD_DIM

LOG2E = 1.4426950408889634
# Cache positions per chunk come in whole runs of this many (so that full K/V blocks stay unmasked).
CHUNK_ALIGN = 64
# A finite fill at most this large drops a masked position out of fp32's softmax (exp(fill) is 0) unless its
# score exceeds the row's best kept score by nearly 10^4: the kernel then skips reading masked positions.
# cuDNN's fill for a boolean mask is -65536, Hugging Face's masks use the dtype's minimum.
SKIP_READS_FILL = -1e4
# Programs a launch should have to fill an H100/H200 (132 SMs) several times over: the split heuristic aims
# at this many (with the chunk merge no longer spilling, four programs an SM beat one; see default_config).
TARGET_PROGRAMS = 512
# The most mask positions a program reads in one step of its first pass ([rows, positions] in registers).
MAX_SCAN_BLOCK = 512


@helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")
def decode_attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    keep: torch.Tensor | None,
    scale: float,
    masked_bias: float,
    skip_reads: hl.constexpr,
    finite_fill: hl.constexpr,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """q [B, H, R, D]; k, v [B, H, L, D]; optional additive ``bias`` and boolean ``keep`` [B, H, R, L] (any
    strides: broadcast views), whose False positions add ``masked_bias`` (-inf: they drop out). Cache chunk
    ``s`` writes its rows' output ``out[s]`` ([S, B, H, R, D], normalized within the chunk) and base-2
    log-sum-exp ``lse[s]`` ([S, B, H, R]); a row with every position of the chunk masked out (-inf) writes
    zeros and ``-inf``. With ``skip_reads`` (the fill drops masked positions out), a chunk stops reading K and
    V after the last position some row of the program keeps, unless the fill is finite (``finite_fill``) and
    some row keeps none of the chunk."""
    b, h, r, d = q.size()
    kv_len = k.size(2)
    block_l = hl.register_block_size(kv_len)
    block_scan = hl.register_block_size(kv_len)  # positions of the mask a chunk's first step reads at once
    split_kv = hl.register_tunable("split_kv", PowerOfTwoFragment(1, 64, 1))
    # Written out here, not called from chunk_size(): Helion takes a block size only from an inline expression.
    chunk = helion.cdiv(helion.cdiv(kv_len, split_kv), 64) * 64
    for tile_b, tile_h, tile_r, tile_s in hl.tile([b, h, r, kv_len], block_size=[1, 1, None, chunk]):
        bi, hi = tile_b.begin, tile_h.begin
        q_rows = q[bi, hi, tile_r, :]
        row_max = hl.full([tile_r], float("-inf"), dtype=torch.float32)
        row_sum = hl.zeros([tile_r], dtype=torch.float32)
        acc = hl.zeros([tile_r, d], dtype=torch.float32)
        end = hl.full([], 0, dtype=torch.int32) + tile_s.end  # on the device: a mask may move it
        if keep is not None and skip_reads:
            # Stop after the chunk's last position some row keeps: past it, every row adds the fill. The mask
            # is read in large steps (each step costs a memory latency); a chunk
            # no row keeps any of gets end 0, and no step of the loop below runs.
            end = hl.zeros([], dtype=torch.int32)
            row_keeps = hl.zeros([tile_r], dtype=torch.int32)
            for tile_m in hl.tile(tile_s.begin, tile_s.end, block_size=block_scan):
                kept = keep[bi, hi, tile_r, tile_m]
                ends = torch.where(kept, tile_m.index[None, :] + 1, 0)
                end = torch.maximum(end, torch.amax(torch.amax(ends, -1), 0))
                row_keeps = torch.maximum(row_keeps, torch.amax(kept.to(torch.int32), -1))
            if finite_fill:
                # A (real) row that keeps none of the chunk attends to all of it: the fill cancels.
                keeps_none = (row_keeps == 0) & (tile_r.index < r)
                end = torch.where(torch.amax(keeps_none.to(torch.int32), 0) > 0, tile_s.end, end)
        for tile_l in hl.tile(tile_s.begin, end, block_size=block_l):
            k_block = k[bi, hi, tile_l, :]
            v_block = v[bi, hi, tile_l, :]
            logits = hl.dot(q_rows, k_block.T, out_dtype=torch.float32) * (scale * LOG2E)
            if bias is not None:
                logits = logits + bias[bi, hi, tile_r, tile_l].to(torch.float32) * LOG2E
            if keep is not None:
                logits = torch.where(keep[bi, hi, tile_r, tile_l], logits, logits + masked_bias * LOG2E)
            new_max = torch.maximum(row_max, torch.amax(logits, -1))
            # A row with nothing to attend to yet keeps exp2(-inf - 0) = 0, never -inf - -inf.
            shift = torch.where(new_max == float("-inf"), 0.0, new_max)
            p = torch.exp2(logits - shift[:, None])
            rescale = torch.exp2(row_max - shift)
            row_sum = row_sum * rescale + torch.sum(p, -1)
            acc = hl.dot(p.to(v.dtype), v_block, acc=acc * rescale[:, None])
            row_max = new_max
        denominator = torch.where(row_sum > 0, row_sum, 1.0)
        out[tile_s.id, bi, hi, tile_r, :] = (acc / denominator[:, None]).to(out.dtype)
        lse[tile_s.id, bi, hi, tile_r] = row_max + torch.log2(denominator)


@helion.kernel(static_shapes=True, autotune_effort="none")
def combine_kernel(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` [B, H, R, D]: the chunks' outputs ``partial`` [S, B, H, R, D] weighted by their share
    ``2^lse`` [S, B, H, R] of each row's softmax. A row no chunk attended to comes out zeros, as from one
    chunk and from ``scaled_dot_product_attention`` (its safe softmax)."""
    s, b, h, r, d = partial.size()
    for tile_b, tile_h, tile_r, tile_d in hl.tile([b, h, r, d], block_size=[1, 1, None, None]):
        bi, hi = tile_b.begin, tile_h.begin
        chunk_lse = lse[:, bi, hi, tile_r]
        top = torch.amax(chunk_lse, 0)
        weights = torch.exp2(chunk_lse - torch.where(top == float("-inf"), 0.0, top)[None, :])
        acc = torch.sum(partial[:, bi, hi, tile_r, tile_d] * weights[:, :, None], 0)
        total = torch.sum(weights, 0)
        out[bi, hi, tile_r, tile_d] = (acc / torch.where(total > 0, total, 1.0)[:, None]).to(out.dtype)


# Elements of ``partial`` one combine program holds in registers ([S, rows, D] tile): 32 per thread at 4 warps.
COMBINE_TILE_ELEMENTS = 4096


@functools.cache  # on every launch
def combine_config(splits: int, rows: int, head_dim: int) -> helion.Config:
    """Rows of one (batch, head) per program (not more: the tile is [S, rows, D]), and D split until the
    tile fits :data:`COMBINE_TILE_ELEMENTS` (a fixed 16-row tile spills registers when there are many
    chunks)."""
    block_r = min(16, 1 << (rows - 1).bit_length())
    block_d = 1 << (head_dim - 1).bit_length()
    while block_d > 16 and splits * block_r * block_d > COMBINE_TILE_ELEMENTS:
        block_d //= 2
    return helion.Config(block_sizes=[block_r, block_d], num_warps=4)


def chunk_size(kv_len: int, split_kv: int) -> int:
    """Cache positions per chunk, as the kernel computes them (whole runs of :data:`CHUNK_ALIGN`)."""
    return helion.cdiv(helion.cdiv(kv_len, split_kv), CHUNK_ALIGN) * CHUNK_ALIGN


@functools.cache  # on every launch
def default_config(batch_heads: int, rows: int, kv_len: int) -> helion.Config:
    """Enough cache chunks for about :data:`TARGET_PROGRAMS` programs, 64-position blocks, a chunk's mask read
    in steps of up to :data:`MAX_SCAN_BLOCK`. More splits pay while the batch leaves SMs idle, and cost once
    it fills them (benchmarks/NOTES.md has the measurements)."""
    split = 1
    while batch_heads * split * 2 <= TARGET_PROGRAMS and chunk_size(kv_len, split * 2) < chunk_size(kv_len, split):
        split *= 2
    block_r = max(16, 1 << (rows - 1).bit_length())
    block_scan = min(MAX_SCAN_BLOCK, 1 << (chunk_size(kv_len, split) - 1).bit_length())
    return helion.Config(block_sizes=[CHUNK_ALIGN, block_scan, block_r], split_kv=split, num_warps=4, num_stages=2)


class AttentionSignature(NamedTuple):
    """What the compiled kernels depend on besides the config (Helion specializes on static shapes)."""

    q: Layout
    k: Layout
    v: Layout
    bias: Layout | None
    keep: Layout | None
    out: Layout
    skip_reads: bool  # a boolean mask whose fill drops masked positions out: they are not read
    finite_fill: bool  # ... and that fill is finite: a row that keeps none of a chunk attends to all of it


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Reject what the kernel would compute wrongly or fail on deep inside Helion."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"expected 4-D q, k, v [B, H, rows, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    b, h, _, d = q.shape
    if k.shape[0] != b or k.shape[1] == 0 or h % k.shape[1] or k.shape[3] != d or v.shape != k.shape:
        raise ValueError(f"k and v must be [{b}, H_kv, L, {d}] with H_kv dividing the {h} query heads, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if q.dtype not in ATTENTION_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one of {ATTENTION_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[2] == 1:  # Helion 1.4 drops the mask of a tiled dimension of static size one (kernels/gemm.py)
        raise ValueError(f"a key/value length of 1 (k {tuple(k.shape)}): Helion's tiling of it is wrong, so the "
                         "kernel refuses it")
    if d > ATTENTION_MAX_HEAD_DIM:  # the [rows, D] accumulator and q tile live in registers
        raise ValueError(f"head dimension {d} > {ATTENTION_MAX_HEAD_DIM}")
    if mask is not None and not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
        raise ValueError(f"the mask must be boolean or an additive float bias, got {mask.dtype}")


def decode_attention_helion(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    config: helion.Config | None = None,
    out: torch.Tensor | None = None,
    masked_bias: float = -math.inf,
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)`` as a
    [B, H, R, D] tensor of q's dtype, written into ``out`` (any strides) when given: ``mask`` is None,
    boolean (True attends; the others add ``masked_bias`` to their logits, so that a finite one computes
    ``attn_mask=where(mask, 0, masked_bias)``) or an additive float bias, any shape that broadcasts to
    [B, H, R, L]; ``scale`` defaults to ``1/sqrt(D)``. With fewer key/value heads than query heads
    (grouped-query attention), the query heads of one key/value head are its rows, so each cache is read
    once."""
    check_inputs(q, k, v, mask)
    b, h, r, d = q.shape
    if out is None:
        out = torch.empty((b, h, r, d), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")
    kv_heads, kv_len = k.shape[1], k.shape[2]
    rows = h // kv_heads * r  # [B, H, R] query rows as [B, H_kv, H / H_kv * R]
    mask = None if mask is None else mask.expand(b, h, r, kv_len).reshape(b, kv_heads, rows, kv_len)
    grouped_out = _view_or_none(out, (b, kv_heads, rows, d))
    result = grouped_out if grouped_out is not None else out.new_empty((b, kv_heads, rows, d))
    _launch(q.reshape(b, kv_heads, rows, d), k, v, mask, 1.0 / math.sqrt(d) if scale is None else float(scale),
            float(masked_bias), config, result)
    if grouped_out is None:
        out.copy_(result.view(b, h, r, d))
    return out


def _view_or_none(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``t`` seen as ``shape`` without a copy, or None where its strides do not allow it."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            masked_bias: float, config: helion.Config | None, out: torch.Tensor) -> None:
    """The kernel (and with a split cache, the combine) on q [B, H, R, D] against k, v [B, H, L, D] into
    ``out`` [B, H, R, D]; ``mask`` is [B, H, R, L] (broadcast views)."""
    b, h, r, d = q.shape
    kv_len = k.shape[2]
    bias, keep = (mask, None) if mask is not None and mask.dtype.is_floating_point else (None, mask)
    config = config or default_config(b * h, r, kv_len)
    splits = helion.cdiv(kv_len, chunk_size(kv_len, config.get("split_kv", 1)))
    target = out.unsqueeze(0) if splits == 1 else q.new_empty((splits, b, h, r, d), dtype=torch.float32)
    lse = q.new_empty((splits, b, h, r), dtype=torch.float32)
    skip_reads = keep is not None and masked_bias <= SKIP_READS_FILL
    finite_fill = skip_reads and math.isfinite(masked_bias)
    layouts = (None if t is None else Layout.of(t) for t in (q, k, v, bias, keep, out))
    sig = AttentionSignature(*layouts, skip_reads, finite_fill)
    args = (q, k, v, bias, keep, scale, masked_bias, skip_reads, finite_fill, target, lse)
    compiled_kernel(decode_attention_kernel, args, sig, config, splits)(*args)
    if splits > 1:
        combine_args = (target, lse, out)
        config = combine_config(splits, r, d)
        compiled_kernel(combine_kernel, combine_args, sig, config, splits)(*combine_args)
