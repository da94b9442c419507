"""Helion kernels behind the fused op: one implementation per kernel family that rules may name."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from helion_backend.kernels.helion_import import (
    helion,  # Helion's first import here: it defers scikit-learn (see .helion_import)
)

# isort: split
import torch

from helion_backend.kernels.gemm import gemm_epilogue_helion, glu_gemm_helion
from helion_backend.kernels.multi_gemm import multi_gemm_helion
from helion_backend.kernels.quant_gemm import block_fp8_gemm_helion, int4_gemm_helion, quant_gemm_helion
from helion_backend.semantics.norm import RmsNormSpec
from helion_backend.semantics.quant_program import QuantProgram
from helion_backend.vocabulary import FP8_BLOCK_FAMILY, GLU_FAMILIES, INT4_FAMILY, KERNEL_FAMILIES

KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "gemm": gemm_epilogue_helion,
    **{family: functools.partial(glu_gemm_helion, kernel_family=family) for family in GLU_FAMILIES},
    INT4_FAMILY: int4_gemm_helion,
    FP8_BLOCK_FAMILY: block_fp8_gemm_helion,
    **{family: functools.partial(quant_gemm_helion, kernel_family=family)
       for family in ("gemm_fp8", "gemm_int8", "gemm_weight_only")},
}
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
    program: QuantProgram | None = None,
    up_kn: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None,
    config: helion.Config | None = None,
    up_steps: tuple[str, ...] = (),
) -> torch.Tensor:
    """Run the ``kernel`` family's Helion implementation with ``config``, by default the config tables' pick
    for the shape (user-tuned ones in ``config_dir`` first); ``program`` is a fused activation quantization, ``up_kn``
    a gated MLP's up projection (``up_steps``: its own rescaling on quantized rows, reading ``operands``
    after the epilogue's), ``weight_scale`` the scales of a dequantized ``w_kn`` (packed int4's
    group scales, block fp8's block scales; block fp8 also has its activation's ``program``), ``norm``
    a fused RMSNorm's weight and spec (the ``gemm`` and ``gemm_glu`` families' prologue)."""
    if weight_scale is not None:
        extra = () if program is None else (program,)
        return KERNELS[kernel](x, w_kn, weight_scale, steps, operands, scalars, out_dtype, *extra,
                               config=config, config_dir=config_dir)
    if up_kn is not None:
        return KERNELS[kernel](x, w_kn, up_kn, steps, operands, scalars, out_dtype, config=config,
                               config_dir=config_dir, norm=norm, up_steps=up_steps)
    if norm is not None:
        return KERNELS[kernel](x, w_kn, steps, operands, scalars, out_dtype, config=config, config_dir=config_dir,
                               norm=norm)
    if program is not None:
        return KERNELS[kernel](x, w_kn, steps, operands, scalars, out_dtype, program, config=config,
                               config_dir=config_dir)
    return KERNELS[kernel](x, w_kn, steps, operands, scalars, out_dtype, config=config, config_dir=config_dir)


__all__ = ["KERNELS", "block_fp8_gemm_helion", "gemm_epilogue_helion", "glu_gemm_helion", "int4_gemm_helion",
           "multi_gemm_helion", "quant_gemm_helion", "run_kernel"]
