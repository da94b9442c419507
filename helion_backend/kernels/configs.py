"""Helion configs for the GEMM + epilogue kernels: measured ones where the GPU's table has the shape
(:mod:`helion_backend.tables`), hand-picked ones otherwise. Nothing here autotunes.

Decode shapes (small M) are bound by reading the weight once, so the aim there is enough tiles in flight
to cover every SM; split-K supplies them when N alone does not.
"""

from __future__ import annotations

import functools

import helion
import torch

from helion_backend import tables
from helion_backend.tables import CALIBRATED, GEMV, PAIRED_LOADS, PREQUANTIZE, SWAP_AB  # noqa: F401
from helion_backend.vocabulary import CONFIG_FALLBACK, DEFAULT_KERNEL_FAMILY, INT4_FAMILY

NUM_SMS = 132  # H200: split-K grids are sized by it (the default configs and the tuner's candidates)
_DECODE_MAX_M = 32
# Each split must still run a few K blocks, or its atomic adds and the extra epilogue pass cost more
# than the parallelism gains.
_MIN_K_PER_SPLIT = 1024
_MAX_SPLIT_K = 16

_QUANTIZED_INPUTS = (torch.float8_e4m3fn, torch.int8)

# The split-K finishing pass only reads the fp32 partial sums once; any coalesced tile will do.
EPILOGUE_CONFIG = helion.Config(block_sizes=[16, 128], num_warps=4, num_stages=1)


@functools.cache  # on every launch
def split_key(config: helion.Config, ours: str) -> tuple[bool, helion.Config]:
    """Our boolean key ``ours`` (:data:`PREQUANTIZE`, :data:`PAIRED_LOADS`, :data:`GEMV`, :data:`SWAP_AB`) and
    the config without it, which is what Helion sees."""
    rest = helion.Config(**{key: value for key, value in config.items() if key != ours})
    return bool(config.get(ours, False)), rest


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_k_choices(k: int) -> list[int]:
    """The split-K factors worth trying at this K: powers of two up to the cap that leave every split deep
    enough (what :func:`default_config` picks from, and what the tuner searches)."""
    choices = [1]
    while choices[-1] * 2 <= _MAX_SPLIT_K and k // (choices[-1] * 2) >= _MIN_K_PER_SPLIT:
        choices.append(choices[-1] * 2)
    return choices


def _split_k(m_tiles: int, n_tiles: int, k: int) -> int:
    """The largest choice that keeps the grid within one wave of SMs."""
    return max(s for s in split_k_choices(k) if s == 1 or m_tiles * n_tiles * s <= NUM_SMS)


@functools.cache  # called on every kernel launch without an explicit config
def default_config(m: int, k: int, n: int, dtype: torch.dtype, kernel: str = DEFAULT_KERNEL_FAMILY) -> helion.Config:
    """A config for the ``kernel`` family's GEMM at this shape; never autotuned."""
    # fp32 tiles take twice the shared memory of 16-bit ones: halve the K block to keep the stages
    # (fp8/int8 GEMMs keep the 16-bit block: the quantized kernel stages its activation in 16 bits).
    k_scale = 2 if dtype == torch.float32 else 1
    if m <= _DECODE_MAX_M:
        # Narrow N tiles and deep K blocks won most decode keys of the H200 sweep (tuned/nvidia_h200.json).
        block_m, block_n, block_k, num_warps, num_stages = 16, 32, 512 // k_scale, 4, 3
    elif m <= 128:
        block_m, block_n, block_k, num_warps, num_stages = 64, 128, 64 // k_scale, 4, 4
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 128, 64 // k_scale, 8, 3
    if kernel == INT4_FAMILY:
        block_k = _int4_block_k(block_k)
    # Every fp8/int8 key of the H200 sweep ran fastest with the activation quantized once, up front.
    extra = {PREQUANTIZE: True} if dtype in _QUANTIZED_INPUTS else {}
    return helion.Config(
        block_sizes=[block_m, block_n, block_k],
        num_warps=num_warps,
        num_stages=num_stages,
        split_k=_split_k(_cdiv(m, block_m), _cdiv(n, block_n), k),
        **extra,
    )


def _int4_block_k(block_k: int) -> int:
    """The int4 kernel's K block for a 16-bit one: it counts packed bytes (two columns of K each), and every
    step holds four [block_k, block_n] tiles in registers (bytes, their group scales, two dequantized
    nibbles), so a quarter of the 16-bit depth, and 128 columns of K at the least."""
    return max(64, block_k // 4)


def forget_tables() -> None:
    """Drop the memoized tables, decisions and configs, so that entries written in this process take effect
    at once (the fused op looks its config up on every call)."""
    tables.forget_tables()
    config_for.cache_clear()


@functools.cache
def config_for(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, user_dir: str | None = None,
    kernel: str = DEFAULT_KERNEL_FAMILY,
) -> helion.Config:
    """The config the table's decision (:func:`helion_backend.tables.decision`) rests on: the key's own
    entry, the smallest tuned M >= m at this (K, N), or the closest measured shape's; else the largest tuned
    M's at this (K, N), else :func:`default_config` (a fused quantized family without entries: its member
    family's, see :func:`helion_backend.tables.entries`). ``user_dir`` holds user-tuned tables that override
    the shipped ones. Memoized: the hot path pays one dict lookup (a table written later is read by the next
    process, or after :func:`forget_tables`)."""
    decided = tables.decision(m, k, n, dtype, device, user_dir, kernel).config
    if decided is not None:
        return helion.Config(**decided)
    entries = tables.entries(k, n, dtype, device, user_dir, kernel)
    if not entries:
        return default_config(m, k, n, dtype, CONFIG_FALLBACK.get(kernel, kernel))
    for entry in entries:
        if entry.m >= m:
            return helion.Config(**entry.config)
    return helion.Config(**entries[-1].config)
