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
from .helion_import import helion  # isort: skip  (first: it defers scikit-learn)
import torch

from ..policy import NO_EVIDENCE, Decision, Entry, TableShape, decide
from ..vocabulary import CONFIG_FALLBACK, DEFAULT_KERNEL_FAMILY, dtype_name
from .family import GEMV, NUM_SMS, PAIRED_LOADS, PREQUANTIZE, SWAP_AB, split_k_choices
from .family import family as family_row

log = logging.getLogger(__name__)

# Measured configs, one JSON file per GPU (`python -m helion_backend tune --effort sweep --table ...` writes them).
TUNED_DIR = Path(__file__).resolve().parent / "tuned"

# Our keys in the families' configs (GEMV, PAIRED_LOADS, PREQUANTIZE, SWAP_AB) and the split-K sizing
# (NUM_SMS, split_k_choices) live with the registry rows in .family.
__all__ = ["GEMV", "NUM_SMS", "PAIRED_LOADS", "PREQUANTIZE", "SWAP_AB", "config_for", "decision", "default_config",
           "split_k_choices"]
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


@functools.cache  # called on every kernel launch without an explicit config
def default_config(m: int, k: int, n: int, dtype: torch.dtype, kernel: str = DEFAULT_KERNEL_FAMILY) -> helion.Config:
    """The ``kernel`` family's hand-picked config at this shape (its registry row's); never autotuned."""
    return helion.Config(**family_row(kernel).default_config(m, k, n, dtype))


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
