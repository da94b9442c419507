"""Helion configs for the GEMM + epilogue kernels: measured ones where the GPU's table has the shape
(``tuned/<gpu>.json``, and the user's tables that ``python -m helion_backend tune`` writes), hand-picked
ones otherwise. Nothing here autotunes.

Decode shapes (small M) are bound by reading the weight once, so the aim there is enough tiles in flight
to cover every SM; split-K supplies them when N alone does not.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from pathlib import Path
import helion
import torch

from ..vocabulary import CONFIG_FALLBACK, DEFAULT_KERNEL_FAMILY, INT4_FAMILY, dtype_name
from ..policy import NO_EVIDENCE, Decision, Entry, TableShape, decide

log = logging.getLogger(__name__)

# Measured configs, one JSON file per GPU (`python -m helion_backend tune --effort sweep --table ...` writes them).
TUNED_DIR = Path(__file__).resolve().parent / "tuned"

NUM_SMS = 132  # H200: split-K grids are sized by it (the default configs and the tuner's candidates)
_DECODE_MAX_M = 32
# Each split must still run a few K blocks, or its atomic adds and the extra epilogue pass cost more
# than the parallelism gains.
_MIN_K_PER_SPLIT = 1024
_MAX_SPLIT_K = 16

# A key of ours in the quantized families' configs (removed before Helion sees them): quantize the
# activation once, in a kernel of its own, instead of in every output tile (see kernels/quant_gemm.py).
PREQUANTIZE = "prequantize"
# Another, in the int4 configs: read the activation as [M, K/2, 2] pairs and split them in registers.
PAIRED_LOADS = "paired_loads"
# Another, in the 16-bit GEMM's configs: run the GEMV kernel (elementwise products summed over K after the
# loop, no tensor-core dot, whose rows Helion pads to 16; see kernels/gemm.py's ``gemv_kernel``).
GEMV = "gemv"
# Another, in the fp8, int8 and int8 weight-only configs: run ``swapped_lowp_gemm_kernel``, which multiplies
# the weight by the rows (``w @ x.T``) so that the dot's 64-row side is the weight's (kernels/quant_gemm.py).
SWAP_AB = "swap_ab"
_QUANTIZED_INPUTS = (torch.float8_e4m3fn, torch.int8)
# A table entry's field: option autotune_missing measured the key before a compiled graph's first run.
CALIBRATED = "calibrated"

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


def gpu_key(device: torch.device) -> str:
    """``NVIDIA H200`` -> ``nvidia_h200``: the name of the GPU's table file."""
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def tables_digest(user_dir: str | None = None) -> str:
    """sha256 of every table (shipped, then the user's): they decide where sites run, so they are part of
    the compile's identity."""
    digest = hashlib.sha256()
    for directory in (TUNED_DIR, *([Path(user_dir)] if user_dir else [])):
        for path in sorted(directory.glob("*.json")):
            digest.update(str(path).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


TunedEntry = Entry  # one measured key of a GPU's table (see :class:`..policy.Entry`)


def _read_table(path: Path) -> dict[TableShape, list[TunedEntry]]:
    """One table file; a missing file is empty, a malformed one is skipped with a warning naming it."""
    if not path.exists():
        return {}
    table: dict[TableShape, list[TunedEntry]] = {}
    try:
        for entry in json.loads(path.read_text())["entries"]:
            key = TableShape(entry.get("kernel", DEFAULT_KERNEL_FAMILY), entry["dtype"], int(entry["k"]), int(entry["n"]))
            table.setdefault(key, []).append(_entry(entry))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("helion_inductor: ignoring the config table %s (%s)", path, e)
        return {}
    return table


def _entry(entry: dict) -> Entry:
    """A table entry's fields: its lead is the fallback's time over Helion's, where both were recorded."""
    wins, us, fallback_us = entry.get("helion_wins"), entry.get("us"), entry.get("fallback_us")
    lead = float(fallback_us) / float(us) if us and fallback_us else None
    return Entry(int(entry["m"]), helion.Config(**entry["config"]), None if wins is None else bool(wins), lead,
                 bool(entry.get(CALIBRATED, False)))


@functools.cache
def _table(gpu: str, user_dir: str | None = None) -> dict[TableShape, list[TunedEntry]]:
    """(kernel, dtype, K, N) -> entries sorted by M: the shipped table, overridden M by M by the user's."""
    merged: dict[TableShape, dict[int, TunedEntry]] = {}
    for directory in (TUNED_DIR, *([Path(user_dir)] if user_dir else [])):
        for key, entries in _read_table(directory / f"{gpu}.json").items():
            merged.setdefault(key, {}).update((e.m, e) for e in entries)
    return {key: sorted(by_m.values(), key=lambda e: e.m) for key, by_m in merged.items()}


def has_entry(kernel: str, dtype: str, k: int, n: int, m: int, device: torch.device, user_dir: str | None) -> bool:
    """Whether the shipped or user table of ``device`` holds this exact key: :func:`config_for` falls back to
    the nearest tuned M, which compile-time autotuning (option ``autotune_missing``) must not count."""
    return any(entry.m == m for entry in _table(gpu_key(device), user_dir).get((kernel, dtype, k, n), []))


def forget_tables() -> None:
    """Drop the memoized tables and lookups, so that entries written in this process take effect at once
    (the fused op looks its config up on every call)."""
    for memo in (_table, _shapes, config_for, decision):
        memo.cache_clear()


def _without_member_only_forms(entries: list[Entry]) -> list[Entry]:
    """A member family's entries as a fused family borrows them: without the :data:`GEMV` and
    :data:`SWAP_AB` ones (the fused kernels always dot ``x @ w``, and a GEMV's narrow N tiles are no dot's)."""
    return [entry for entry in entries if not (entry.config.get(GEMV) or entry.config.get(SWAP_AB))]


@functools.cache
def _shapes(gpu: str, user_dir: str | None, kernel: str, dtype: str) -> dict[tuple[int, int], list[Entry]]:
    """(K, N) -> entries of the family at this dtype; for a fused quantized family, its member family's
    (:data:`~helion_backend.vocabulary.CONFIG_FALLBACK`: the sites it fuses, run alone) at the shapes it has
    none of its own."""
    table = _table(gpu, user_dir)
    shapes = {(k, n): entries for (family, dt, k, n), entries in table.items() if (family, dt) == (kernel, dtype)}
    member = CONFIG_FALLBACK.get(kernel)
    if member is not None:
        for (family, dt, k, n), entries in table.items():
            if (family, dt) == (member, dtype) and (k, n) not in shapes:
                shapes[(k, n)] = _without_member_only_forms(entries)
    return {shape: entries for shape, entries in shapes.items() if entries}


def _entries(
    k: int, n: int, dtype: torch.dtype, device: torch.device, user_dir: str | None, kernel: str
) -> list[Entry]:
    """The family's entries at (K, N) (see :func:`_shapes`); none off CUDA."""
    if device.type != "cuda":
        return []
    return _shapes(gpu_key(device), user_dir, kernel, dtype_name(dtype)).get((k, n), [])


@functools.cache
def decision(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, user_dir: str | None = None,
    kernel: str = DEFAULT_KERNEL_FAMILY,
) -> Decision:
    """Where the ``kernel`` family's key runs and on what evidence (:func:`helion_backend.policy.decide` over the shipped
    and user tables of ``device``); no evidence off CUDA."""
    if device.type != "cuda":
        return NO_EVIDENCE
    return decide(_shapes(gpu_key(device), user_dir, kernel, dtype_name(dtype)), k, n, m)


@functools.cache
def config_for(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, user_dir: str | None = None,
    kernel: str = DEFAULT_KERNEL_FAMILY,
) -> helion.Config:
    """The config the :func:`decision` rests on (the key's own entry, the smallest tuned M >= m at this
    (K, N), or the closest measured shape's); else the largest tuned M's at this (K, N), else
    :func:`default_config` (a fused quantized family without entries: its member family's, see
    :func:`_shapes`). ``user_dir`` holds user-tuned tables that override the shipped ones. Memoized: the
    hot path pays one dict lookup (a table written later is read by the next process, or after
    :func:`forget_tables`)."""
    decided = decision(m, k, n, dtype, device, user_dir, kernel).config
    if decided is not None:
        return decided
    entries = _entries(k, n, dtype, device, user_dir, kernel)
    if not entries:
        return default_config(m, k, n, dtype, CONFIG_FALLBACK.get(kernel, kernel))
    for entry in entries:
        if entry.m >= m:
            return entry.config
    return entries[-1].config
