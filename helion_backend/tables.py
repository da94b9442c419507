"""The GPU config tables: measured configs, one JSON file per GPU (``kernels/tuned/<gpu>.json``, and the
user's tables that ``python -m helion_backend tune`` writes), read into plain entries, and where a key runs
by them (:mod:`helion_backend.policy`).

No Helion import: the compile side reads the tables to place sites; :mod:`helion_backend.kernels.configs`
turns an entry's config into a ``helion.Config``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import torch

from helion_backend import environment
from helion_backend.policy import NO_EVIDENCE, Decision, Entry, TableShape, decide
from helion_backend.vocabulary import CONFIG_FALLBACK, DEFAULT_KERNEL_FAMILY, dtype_name

log = logging.getLogger(__name__)

# The shipped tables (package data); `python -m helion_backend tune --effort sweep --table ...` writes them.
TUNED_DIR = Path(__file__).resolve().parent / "kernels" / "tuned"

# Keys of ours in a table's configs (removed before Helion sees them; see kernels/configs.py). Quantize the
# activation once, in a kernel of its own, instead of in every output tile (kernels/quant_gemm.py):
PREQUANTIZE = "prequantize"
# In the int4 configs: read the activation as [M, K/2, 2] pairs and split them in registers.
PAIRED_LOADS = "paired_loads"
# In the configs of a few rows (16-bit, fp8, int8, int8 and int4 weight-only): run the family's GEMV kernel
# (elementwise products summed over K after the loop, no tensor-core dot, whose rows Helion pads to 16; see
# kernels/gemm.py's ``gemv_kernel`` and kernels/quant_gemm.py's ``int4_gemv_kernel``).
GEMV = "gemv"
# In the fp8, int8, int8 and int4 weight-only configs: run ``swapped_lowp_gemm_kernel`` (int4:
# ``swapped_int4_gemm_kernel``), which multiplies the weight by the rows (``w @ x.T``) so that the dot's
# 64-row side is the weight's (kernels/quant_gemm.py).
SWAP_AB = "swap_ab"
# An int4 entry's field: tinygemm's time at the key (``aten._weight_int4pack_mm`` and the epilogue over its
# product, kernels/tinygemm.py), which a site runs instead of the entry's config where it is the faster and
# option frozen_weights lets the site keep tinygemm's form of the weight.
TINYGEMM_US = "tinygemm_us"
# A table entry's field: option autotune_missing measured the key before a compiled graph's first run.
CALIBRATED = "calibrated"

TunedEntry = Entry  # one measured key of a GPU's table (see :class:`helion_backend.policy.Entry`)

# GPUs that read another GPU's shipped table under their own: the same architecture and SM count, so the same
# tiles and splits fill them (the H100 SXM has the H200's 132 SMs and less bandwidth; measured in
# benchmarks/NOTES.md). The GPU's own shipped table, where it has one, overrides the stand-in's key by key
# (the keys measured on that GPU), and a user table under the GPU's own name overrides both.
SHIPPED_STAND_INS = {"nvidia_h100_80gb_hbm3": "nvidia_h200"}


def gpu_key(device: torch.device) -> str:
    """``NVIDIA H200`` -> ``nvidia_h200``: the name of the GPU's table file."""
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def shipped_table_names(gpu: str) -> list[str]:
    """The shipped tables ``gpu`` reads, the later overriding the earlier key by key: its stand-in's
    (:data:`SHIPPED_STAND_INS`), then its own where one is shipped (no file at all: an empty table)."""
    stand_in = SHIPPED_STAND_INS.get(gpu)
    own = [gpu] if (TUNED_DIR / f"{gpu}.json").exists() or stand_in is None else []
    return [*([stand_in] if stand_in else []), *own]


def tables_digest(user_dir: str | None = None) -> str:
    """sha256 of every table (shipped, then the user's): they decide where sites run, so they are part of
    the compile's identity."""
    digest = hashlib.sha256()
    for directory in (TUNED_DIR, *([Path(user_dir)] if user_dir else [])):
        for path in sorted(directory.glob("*.json")):
            digest.update(str(path).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def placement_digest(config_dir: str) -> str:
    """What, besides options and rules, decides where a site runs: the GPU config tables (no GPU: none)."""
    if environment.helion_unavailable_reason() is not None:
        return ""
    return tables_digest(config_dir)


def _read_table(path: Path) -> dict[TableShape, list[TunedEntry]]:
    """One table file; a missing file is empty, a malformed one is skipped with a warning naming it."""
    if not path.exists():
        return {}
    table: dict[TableShape, list[TunedEntry]] = {}
    try:
        for entry in json.loads(path.read_text())["entries"]:
            key = TableShape(entry.get("kernel", DEFAULT_KERNEL_FAMILY), entry["dtype"], int(entry["k"]),
                             int(entry["n"]))
            table.setdefault(key, []).append(_entry(entry))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("helion_inductor: ignoring the config table %s (%s)", path, e)
        return {}
    return table


def _entry(entry: dict[str, Any]) -> Entry:
    """A table entry's fields: its lead is the fallback's time over Helion's, where both were recorded."""
    wins, us, fallback_us = entry.get("helion_wins"), entry.get("us"), entry.get("fallback_us")
    lead = float(fallback_us) / float(us) if us and fallback_us else None
    config = entry["config"]
    if not isinstance(config, dict):
        raise TypeError(f"config of M={entry['m']} is {type(config).__name__}, not an object")
    tinygemm_us = entry.get(TINYGEMM_US)
    tinygemm_lead = float(us) / float(tinygemm_us) if us and tinygemm_us else None
    return Entry(int(entry["m"]), dict(config), None if wins is None else bool(wins), lead,
                 bool(entry.get(CALIBRATED, False)), tinygemm_lead)


@functools.cache
def _table(gpu: str, user_dir: str | None = None) -> dict[TableShape, list[TunedEntry]]:
    """(kernel, dtype, K, N) -> entries sorted by M: the shipped tables (:func:`shipped_table_names`), overridden
    M by M by the user's."""
    shipped = shipped_table_names(gpu)
    if shipped[:1] != [gpu]:
        log.info("helion_inductor: config tables for %s: %s (a stand-in: same architecture and SM count)",
                 gpu, " under ".join(reversed(shipped)))
    paths = [*(TUNED_DIR / f"{name}.json" for name in shipped), *([Path(user_dir) / f"{gpu}.json"] if user_dir else [])]
    merged: dict[TableShape, dict[int, TunedEntry]] = {}
    for path in paths:
        for key, entries in _read_table(path).items():
            merged.setdefault(key, {}).update((e.m, e) for e in entries)
    return {key: sorted(by_m.values(), key=lambda e: e.m) for key, by_m in merged.items()}


def has_entry(kernel: str, dtype: str, k: int, n: int, m: int, device: torch.device, user_dir: str | None) -> bool:
    """Whether the shipped or user table of ``device`` holds this exact key: a lookup falls back to the
    nearest tuned M, which compile-time autotuning (option ``autotune_missing``) must not count."""
    return any(entry.m == m for entry in _table(gpu_key(device), user_dir).get((kernel, dtype, k, n), []))


@functools.cache  # on every int4 launch of a site with frozen weights
def tinygemm_measured_faster(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                             user_dir: str | None, kernel: str) -> bool:
    """Whether the entry whose config ``m`` rows run at (K, N) (the smallest tuned M >= m, as the config lookup
    picks) timed tinygemm faster than that config; False without such an entry, off CUDA."""
    for entry in entries(k, n, dtype, device, user_dir, kernel):
        if entry.m >= m:
            return entry.tinygemm_lead is not None and entry.tinygemm_lead > 1
    return False


@functools.cache
def tinygemm_lead_over_fallback(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                                user_dir: str | None, kernel: str) -> float | None:
    """The fallback's time over tinygemm's at the key's own entry, where both were timed; else None."""
    for entry in entries(k, n, dtype, device, user_dir, kernel):
        if entry.m == m and entry.lead is not None and entry.tinygemm_lead is not None:
            return entry.lead * entry.tinygemm_lead
    return None


def forget_tables() -> None:
    """Drop the memoized tables and decisions, so that entries written in this process take effect at once."""
    for memo in (_table, _shapes, decision, tinygemm_measured_faster, tinygemm_lead_over_fallback):
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


def entries(
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
    """Where the ``kernel`` family's key runs and on what evidence (:func:`helion_backend.policy.decide` over
    the shipped and user tables of ``device``); no evidence off CUDA."""
    if device.type != "cuda":
        return NO_EVIDENCE
    return decide(_shapes(gpu_key(device), user_dir, kernel, dtype_name(dtype)), k, n, m)


def placement_decision(
    m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, config_dir: str,
    kernel: str = DEFAULT_KERNEL_FAMILY,
) -> Decision | None:
    """What the config tables say about running this key on Helion (:func:`decision`); None off CUDA or
    without Helion, where no table applies."""
    if device.type != "cuda" or environment.helion_unavailable_reason() is not None:
        return None
    return decision(m, k, n, dtype, device, config_dir or None, kernel)
