"""Helion kernels behind the fused ops: one file per kernel family's kernels, one registry row per family
(:mod:`.family`). Importing the package imports no Helion: the kernel modules do (through
:mod:`.helion_import`, which defers scikit-learn), and their entry points load on first access."""

from __future__ import annotations

import importlib
from typing import Any

from .family import FAMILIES, KernelCall, KernelFamily, run_kernel

_ENTRY_POINTS = {
    "gemm_epilogue_helion": ".gemm",
    "glu_gemm_helion": ".gemm",
    "multi_gemm_helion": ".multi_gemm",
    "quant_gemm_helion": ".quant_gemm",
    "int4_gemm_helion": ".quant_gemm",
    "block_fp8_gemm_helion": ".quant_gemm",
}


def __getattr__(name: str) -> Any:
    """An entry point, imported on first access and then bound here (later lookups skip this)."""
    if name in _ENTRY_POINTS:
        value = globals()[name] = getattr(importlib.import_module(_ENTRY_POINTS[name], __name__), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FAMILIES", "KernelCall", "KernelFamily", *_ENTRY_POINTS, "run_kernel"]
