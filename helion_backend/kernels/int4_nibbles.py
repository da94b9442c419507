"""The dequantization of packed int4 weights inside the int4 kernels (:mod:`.quant_gemm`): each byte holds two
values (low nibble, high nibble), each value minus the zero point times its group's scale, in the
activation's dtype, as the graph computes it (``helion_backend.layers.quantize.Int4WeightOnlyLinear``).

Two forms of one function, ``(bytes, scales) -> (low values, high values)``, which the kernels take as an
argument: :func:`int4_nibbles` in Helion's arithmetic (any dtype; what Triton's interpreter runs), and, on
CUDA for bf16 and fp16, the same values by bit operations in inline PTX (:func:`int4_dequantizer` picks).
"""

from __future__ import annotations

from collections.abc import Callable

import helion.language as hl
import torch

from helion_backend.vocabulary import INT4_HIGH_SHIFT, INT4_LOW_MASK, INT4_ZERO_POINT


def int4_nibbles(pair: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both weights of each int4 byte dequantized as the graph does: nibble, minus the zero point, times its
    group's scale, in the scale's dtype (the activation's)."""
    low = ((pair & INT4_LOW_MASK).to(scale.dtype) - INT4_ZERO_POINT) * scale
    high = ((pair >> INT4_HIGH_SHIFT).to(scale.dtype) - INT4_ZERO_POINT) * scale
    return low, high


# int4_nibbles by bit operations, four bytes at a time (PTX, sm_80 and later), the way Marlin-class kernels
# dequantize: each byte's nibbles are moved into the mantissa of a 16-bit float whose exponent makes it
# MAGIC + nibble (one prmt and one lop3 for two values), then one fused multiply-add subtracts
# MAGIC + zero point (exact) and one multiplies by the scale (rounded once, as the graph's product). Two
# values a 32-bit register; $4 holds the four bytes, $5 and $6 their scales, $0-$1 the low nibbles' values
# and $2-$3 the high ones'.
_INT4_NIBBLES_PTX = """{
.reg .b32 pair01, pair23, q0, q1, q2, q3, one, bias, negzero, zero;
mov.b32 one, ONE; mov.b32 bias, BIAS; mov.b32 negzero, 0x80008000; mov.b32 zero, 0;
prmt.b32 pair01, $4, zero, 0x4140;
prmt.b32 pair23, $4, zero, 0x4342;
lop3.b32 q0, pair01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 q1, pair23, 0x000F000F, MAGIC, 0xEA;
shr.b32 pair01, pair01, 4;
shr.b32 pair23, pair23, 4;
lop3.b32 q2, pair01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 q3, pair23, 0x000F000F, MAGIC, 0xEA;
fma.rn.TYPE q0, q0, one, bias; fma.rn.TYPE q1, q1, one, bias;
fma.rn.TYPE q2, q2, one, bias; fma.rn.TYPE q3, q3, one, bias;
fma.rn.TYPE $0, q0, $5, negzero; fma.rn.TYPE $1, q1, $6, negzero;
fma.rn.TYPE $2, q2, $5, negzero; fma.rn.TYPE $3, q3, $6, negzero;
}"""
# Per dtype: MAGIC (two of 128.0 in bf16, 1024.0 in fp16, whose ulp is 1), MAGIC + zero point negated, 1.0.
_NIBBLE_FLOATS = {
    torch.bfloat16: ("bf16x2", "0x43004300", "0xC308C308", "0x3F803F80"),
    torch.float16: ("f16x2", "0x64006400", "0xE408E408", "0x3C003C00"),
}


def _nibbles_ptx(dtype: torch.dtype) -> str:
    ptx_type, magic, bias, one = _NIBBLE_FLOATS[dtype]
    return (_INT4_NIBBLES_PTX.replace("TYPE", ptx_type).replace("MAGIC", magic).replace("BIAS", bias)
            .replace("ONE", one))


_BF16_NIBBLES_PTX, _FP16_NIBBLES_PTX = _nibbles_ptx(torch.bfloat16), _nibbles_ptx(torch.float16)
_NIBBLES_CONSTRAINTS = "=r,=r,=r,=r,r,r,r"


def int4_nibbles_bf16_ptx(pair: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_nibbles` by bit operations (``_INT4_NIBBLES_PTX``) for a bf16 activation."""
    return hl.inline_asm_elementwise(_BF16_NIBBLES_PTX, _NIBBLES_CONSTRAINTS, [pair, scale],
                                     (torch.bfloat16, torch.bfloat16), True, 4)


def int4_nibbles_fp16_ptx(pair: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_nibbles` by bit operations (``_INT4_NIBBLES_PTX``) for an fp16 activation."""
    return hl.inline_asm_elementwise(_FP16_NIBBLES_PTX, _NIBBLES_CONSTRAINTS, [pair, scale],
                                     (torch.float16, torch.float16), True, 4)


def int4_dequantizer(x: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The int4 kernels' ``nibbles`` argument for ``x``: the bit-operation form on a CUDA device for 16-bit
    floats, else the arithmetic one (fp32, and Triton's interpreter, which runs no PTX)."""
    if x.is_cuda and x.dtype == torch.bfloat16:
        return int4_nibbles_bf16_ptx
    if x.is_cuda and x.dtype == torch.float16:
        return int4_nibbles_fp16_ptx
    return int4_nibbles
