"""Helion configs for the GEMM + epilogue kernels: measured ones where the GPU's table has the shape
(:mod:`helion_backend.tables`), hand-picked ones otherwise. Nothing here autotunes.

Decode shapes (small M) are bound by reading the weight once, so the aim there is enough tiles in flight
to cover every SM; split-K supplies them when N alone does not.
"""

from __future__ import annotations

import functools

from helion_backend.kernels.helion_import import helion  # isort: skip  (first: it defers scikit-learn)
import torch

from helion_backend import tables
from helion_backend.kernels.family import NUM_SMS, split_k_choices  # noqa: F401  (the tuner's candidates read them here)
from helion_backend.kernels.family import family as family_row
from helion_backend.tables import CALIBRATED, GEMV, PAIRED_LOADS, PREQUANTIZE, SWAP_AB  # noqa: F401
from helion_backend.vocabulary import CONFIG_FALLBACK, DEFAULT_KERNEL_FAMILY

# The split-K finishing pass only reads the fp32 partial sums once; any coalesced tile will do.
EPILOGUE_CONFIG = helion.Config(block_sizes=[16, 128], num_warps=4, num_stages=1)


@functools.cache  # on every launch
def split_key(config: helion.Config, ours: str) -> tuple[bool, helion.Config]:
    """Our boolean key ``ours`` (:data:`PREQUANTIZE`, :data:`PAIRED_LOADS`, :data:`GEMV`, :data:`SWAP_AB`) and
    the config without it, which is what Helion sees."""
    rest = helion.Config(**{key: value for key, value in config.items() if key != ours})
    return bool(config.get(ours, False)), rest


@functools.cache  # called on every kernel launch without an explicit config
def default_config(m: int, k: int, n: int, dtype: torch.dtype, kernel: str = DEFAULT_KERNEL_FAMILY) -> helion.Config:
    """The ``kernel`` family's hand-picked config at this shape (its registry row's); never autotuned."""
    return helion.Config(**family_row(kernel).default_config(m, k, n, dtype))


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
