"""The unfused computation every fused site stands for: what its op computes without Helion (on the CPU,
past a kernel failure, for the self-check and as the tuner's fallback), and each family's reference.

Written with the graph's own ops in its order, so that it rounds as the model does: a scaled weight
dequantized as the graph does, the RMSNorm applied, the activation quantized as the site's program says,
the GEMM as eager runs it, the epilogue in fp32.
"""

from __future__ import annotations

from typing import Sequence

import torch

from helion_backend.semantics.epilogue import apply_epilogue, split_per_output
from helion_backend.semantics.norm import RmsNormSpec, rms_norm
from helion_backend.semantics.quant_program import QuantProgram, quantize_rows
from helion_backend.vocabulary import FP8_BLOCK, INT4_HIGH_SHIFT, INT4_LOW_MASK, INT4_ZERO_POINT, QUANT_DTYPES


def unfused(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    steps: Sequence[str],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    program: QuantProgram | None = None,
    up_kn: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None,
    up_steps: Sequence[str] = (),
) -> torch.Tensor:
    """What the fused op computes without Helion, from the arguments :func:`helion_backend.kernels.run_kernel`
    takes: a scaled weight dequantized as the graph does (packed uint8 int4 with group scales, or block fp8
    with its activation's program), the RMSNorm applied, then :func:`reference`."""
    if weight_scale is not None and w_kn.dtype == torch.uint8:
        w_kn = dequantize_int4(w_kn.t(), weight_scale, x.dtype).t()
    elif weight_scale is not None:
        x, w_kn = dequantize_block_fp8(x, program, w_kn.t(), weight_scale)
        program = None
    if norm is not None:
        x = rms_norm(x, *norm)
    return reference(x, w_kn, steps, operands, scalars, out_dtype, program, up_kn, up_steps)


def unfused_multi(
    x: torch.Tensor,
    w_kns: Sequence[torch.Tensor],
    steps: Sequence[Sequence[str]],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None,
) -> list[torch.Tensor]:
    """What the shared launch computes without Helion, from ``multi_gemm_helion``'s arguments: the norm once,
    then each output's :func:`reference`."""
    if norm is not None:
        x = rms_norm(x, *norm)
    per_output = split_per_output(steps, operands, scalars)
    return [reference(x, w, s, ops, scs, out_dtype) for w, s, (ops, scs) in zip(w_kns, steps, per_output)]


def reference(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    steps: Sequence[str],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    program: QuantProgram | None = None,
    up_kn: torch.Tensor | None = None,
    up_steps: Sequence[str] = (),
) -> torch.Tensor:
    """The unfused computation: the activation quantized as ``program`` says (if given), the GEMM (and a
    gated MLP's up projection ``up_kn``, rescaled by its own ``up_steps``, which read the operands and
    scalars after the epilogue's) as the graph ran it, the epilogue in fp32."""
    if program is None:
        (ops, scs), (up_ops, up_scs) = split_per_output((steps, up_steps), operands, scalars)
        up = None if up_kn is None else apply_epilogue(gemm_product(x, up_kn), up_steps, up_ops.__getitem__, up_scs)
        return apply_epilogue(gemm_product(x, w_kn), steps, ops.__getitem__, scs, up).to(out_dtype)
    quantized, scale = quantize_rows(program, x)
    acc = gemm_product(quantized, w_kn) * scale.to(torch.float32)
    return apply_epilogue(acc, steps, operands.__getitem__, scalars).to(out_dtype)


def gemm_product(x: torch.Tensor, w_kn: torch.Tensor) -> torch.Tensor:
    """``x @ w_kn`` in fp32 as the unfused graph computes it: float GEMMs in their dtype (as eager runs
    them), an int8 weight converted to the activation's dtype first, int8 x int8 exactly (as
    ``_int_mm``'s int32 result), fp8 x fp8 with fp32 accumulation (as ``_scaled_mm``)."""
    if x.dtype == torch.int8:
        return torch.mm(x.to(torch.float64), w_kn.to(torch.float64)).to(torch.float32)
    if x.dtype in QUANT_DTYPES.values():
        return torch.mm(x.to(torch.float32), w_kn.to(torch.float32))
    return torch.mm(x, w_kn.to(x.dtype)).to(torch.float32)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] ``dtype`` weight that ``dequant_int4`` (``dequant_int4_zp``) stands for, computed by the
    graph's own ops in its order (so rounding matches): nibbles low first, converted, minus the zero point,
    times the scale of each group of K / ``scales.shape[1]`` columns. ``scales`` is [N, K/G], or [N, K/G, 2]
    each group's scale and zero point."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    groups = scales.shape[1]
    q = torch.stack([packed & INT4_LOW_MASK, packed >> INT4_HIGH_SHIFT], dim=-1).reshape(n, k)
    if scales.dim() == 3:
        centered = q.to(dtype).reshape(n, groups, k // groups) - scales[:, :, 1:]
        return (centered * scales[:, :, :1]).reshape(n, k)
    centered = (q.to(dtype) - INT4_ZERO_POINT).reshape(n, groups, k // groups)
    return (centered * scales.reshape(n, groups, 1)).reshape(n, k)


def dequantize_block_fp8(
    x: torch.Tensor, program: QuantProgram, weight: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_dq [M, K], w_kn [K, N])`` in x's dtype, as the hand-written block fp8 graph computes them: x
    quantized per 1 x FP8_BLOCK group by ``program`` and dequantized, the fp8 [N, K] ``weight`` scaled per
    FP8_BLOCK x FP8_BLOCK block by ``scales`` [N/B, K/B], both in fp32 and then rounded to x's dtype."""
    (m, k), n, b = x.shape, weight.shape[0], FP8_BLOCK
    quantized, scale = quantize_rows(program, x.reshape(m, k // b, b))
    x_dq = (quantized.to(torch.float32) * scale).reshape(m, k).to(x.dtype)
    blocks = weight.to(torch.float32).reshape(n // b, b, k // b, b) * scales.reshape(n // b, 1, k // b, 1)
    return x_dq, blocks.reshape(n, k).to(x.dtype).t()
