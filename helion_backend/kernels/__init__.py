"""Helion kernels behind the fused op: one implementation per kernel family that rules may name."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..vocabulary import KERNEL_FAMILIES
from .gemm import gemm_epilogue_helion

KERNELS: dict[str, Callable[..., torch.Tensor]] = {"gemm": gemm_epilogue_helion}
assert KERNELS.keys() == set(KERNEL_FAMILIES)


def run_kernel(
    kernel: str,
    x: torch.Tensor,
    w_kn: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    config_dir: str | None = None,
) -> torch.Tensor:
    """Run the ``kernel`` family's Helion implementation with the config tables' pick for the shape
    (user-tuned ones in ``config_dir`` first)."""
    return KERNELS[kernel](x, w_kn, steps, operands, scalars, out_dtype, config_dir=config_dir)


__all__ = ["KERNELS", "gemm_epilogue_helion", "run_kernel"]
