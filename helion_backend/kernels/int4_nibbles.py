"""The dequantization of packed int4 weights inside the int4 kernels (:mod:`.quant_gemm`): each byte holds two
values (low nibble, high nibble), each value minus the zero point times its group's scale, in the
activation's dtype, as the graph computes it (``helion_backend.layers.quantize.Int4WeightOnlyLinear``).

One function, ``(bytes, scales, zero points) -> (low values, high values)``, which the kernels take as an
argument, in two formats (the fixed zero point 8, where the zero points passed are not read, or one zero
point per group) and two forms: Helion's arithmetic (any dtype; what Triton's interpreter runs), and, on
CUDA for bf16 and fp16, the same values by bit operations in inline PTX (:func:`int4_dequantizer` picks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import helion.language as hl
import torch

from helion_backend.vocabulary import INT4_HIGH_SHIFT, INT4_LOW_MASK, INT4_ZERO_POINT


def int4_nibbles(pair: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both weights of each int4 byte dequantized as the graph does: nibble, minus the fixed zero point, times
    its group's scale, in the scale's dtype (the activation's). ``zero`` is not read."""
    low = ((pair & INT4_LOW_MASK).to(scale.dtype) - INT4_ZERO_POINT) * scale
    high = ((pair >> INT4_HIGH_SHIFT).to(scale.dtype) - INT4_ZERO_POINT) * scale
    return low, high


def int4_zero_point_nibbles(pair: torch.Tensor, scale: torch.Tensor,
                            zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both weights of each int4 byte dequantized as the graph does with zero points: nibble, minus its group's
    zero point, times its group's scale, in the scale's dtype."""
    low = ((pair & INT4_LOW_MASK).to(scale.dtype) - zero) * scale
    high = ((pair >> INT4_HIGH_SHIFT).to(scale.dtype) - zero) * scale
    return low, high


# int4_nibbles by bit operations, four bytes at a time (PTX, sm_80 and later), the way Marlin-class kernels
# dequantize: each byte's nibbles are moved into the mantissa of a 16-bit float whose exponent makes it
# MAGIC + nibble (one prmt and one lop3 for two values), then one fused multiply-add subtracts
# MAGIC + zero point (exact) and one multiplies by the scale (rounded once, as the graph's product). Two
# values a 32-bit register; $4 holds the four bytes, $5 and $6 their scales, $0-$1 the low nibbles' values
# and $2-$3 the high ones'. _NIBBLES_INTO_MAGIC leaves MAGIC + the low nibbles of bytes 0-1 and 2-3 in q0
# and q1, MAGIC + the high ones in q2 and q3.
_NIBBLES_INTO_MAGIC = """prmt.b32 pair01, $4, zero, 0x4140;
prmt.b32 pair23, $4, zero, 0x4342;
lop3.b32 q0, pair01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 q1, pair23, 0x000F000F, MAGIC, 0xEA;
shr.b32 pair01, pair01, 4;
shr.b32 pair23, pair23, 4;
lop3.b32 q2, pair01, 0x000F000F, MAGIC, 0xEA;
lop3.b32 q3, pair23, 0x000F000F, MAGIC, 0xEA;
"""
_TIMES_SCALES = """fma.rn.TYPE $0, q0, $5, negzero; fma.rn.TYPE $1, q1, $6, negzero;
fma.rn.TYPE $2, q2, $5, negzero; fma.rn.TYPE $3, q3, $6, negzero;
}"""
_INT4_NIBBLES_PTX = """{
.reg .b32 pair01, pair23, q0, q1, q2, q3, one, bias, negzero, zero;
mov.b32 one, ONE; mov.b32 bias, BIAS; mov.b32 negzero, 0x80008000; mov.b32 zero, 0;
""" + _NIBBLES_INTO_MAGIC + """fma.rn.TYPE q0, q0, one, bias; fma.rn.TYPE q1, q1, one, bias;
fma.rn.TYPE q2, q2, one, bias; fma.rn.TYPE q3, q3, one, bias;
""" + _TIMES_SCALES
# With zero points: the first FMA subtracts MAGIC alone (the nibble, exact), one more subtracts the group's
# zero point ($7 and $8, rounded once, as the graph's subtraction), and the last multiplies by the scale.
_INT4_ZERO_POINT_NIBBLES_PTX = """{
.reg .b32 pair01, pair23, q0, q1, q2, q3, one, negone, negmagic, negzero, zero;
mov.b32 one, ONE; mov.b32 negone, NEGONE; mov.b32 negmagic, NEGMAGIC; mov.b32 negzero, 0x80008000; mov.b32 zero, 0;
""" + _NIBBLES_INTO_MAGIC + """fma.rn.TYPE q0, q0, one, negmagic; fma.rn.TYPE q1, q1, one, negmagic;
fma.rn.TYPE q2, q2, one, negmagic; fma.rn.TYPE q3, q3, one, negmagic;
fma.rn.TYPE q0, $7, negone, q0; fma.rn.TYPE q1, $8, negone, q1;
fma.rn.TYPE q2, $7, negone, q2; fma.rn.TYPE q3, $8, negone, q3;
""" + _TIMES_SCALES


@dataclass(frozen=True)
class _NibbleFloats:
    """A 16-bit float type's constants, two to a 32-bit register: MAGIC (128.0 in bf16, 1024.0 in fp16, whose
    ulp is 1), MAGIC + the fixed zero point and MAGIC negated, 1.0 and -1.0."""

    ptx_type: str
    magic: str
    bias: str
    negmagic: str
    one: str
    negone: str

    def ptx(self, template: str) -> str:
        for name, value in (("TYPE", self.ptx_type), ("NEGMAGIC", self.negmagic), ("MAGIC", self.magic),
                            ("BIAS", self.bias), ("NEGONE", self.negone), ("ONE", self.one)):
            template = template.replace(name, value)
        return template


_NIBBLE_FLOATS = {
    torch.bfloat16: _NibbleFloats("bf16x2", "0x43004300", "0xC308C308", "0xC300C300", "0x3F803F80", "0xBF80BF80"),
    torch.float16: _NibbleFloats("f16x2", "0x64006400", "0xE408E408", "0xE400E400", "0x3C003C00", "0xBC00BC00"),
}
_BF16_NIBBLES_PTX, _FP16_NIBBLES_PTX = (_NIBBLE_FLOATS[dtype].ptx(_INT4_NIBBLES_PTX)
                                        for dtype in (torch.bfloat16, torch.float16))
_BF16_ZERO_POINT_NIBBLES_PTX, _FP16_ZERO_POINT_NIBBLES_PTX = (
    _NIBBLE_FLOATS[dtype].ptx(_INT4_ZERO_POINT_NIBBLES_PTX) for dtype in (torch.bfloat16, torch.float16))
_NIBBLES_CONSTRAINTS = "=r,=r,=r,=r,r,r,r"
_ZERO_POINT_NIBBLES_CONSTRAINTS = "=r,=r,=r,=r,r,r,r,r,r"


def int4_nibbles_bf16_ptx(pair: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_nibbles` by bit operations (``_INT4_NIBBLES_PTX``) for a bf16 activation."""
    return hl.inline_asm_elementwise(_BF16_NIBBLES_PTX, _NIBBLES_CONSTRAINTS, [pair, scale],
                                     (torch.bfloat16, torch.bfloat16), True, 4)


def int4_nibbles_fp16_ptx(pair: torch.Tensor, scale: torch.Tensor,
                          zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_nibbles` by bit operations (``_INT4_NIBBLES_PTX``) for an fp16 activation."""
    return hl.inline_asm_elementwise(_FP16_NIBBLES_PTX, _NIBBLES_CONSTRAINTS, [pair, scale],
                                     (torch.float16, torch.float16), True, 4)


def int4_zero_point_nibbles_bf16_ptx(pair: torch.Tensor, scale: torch.Tensor,
                                     zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_zero_point_nibbles` by bit operations (``_INT4_ZERO_POINT_NIBBLES_PTX``), bf16."""
    return hl.inline_asm_elementwise(_BF16_ZERO_POINT_NIBBLES_PTX, _ZERO_POINT_NIBBLES_CONSTRAINTS,
                                     [pair, scale, zero], (torch.bfloat16, torch.bfloat16), True, 4)


def int4_zero_point_nibbles_fp16_ptx(pair: torch.Tensor, scale: torch.Tensor,
                                     zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int4_zero_point_nibbles` by bit operations (``_INT4_ZERO_POINT_NIBBLES_PTX``), fp16."""
    return hl.inline_asm_elementwise(_FP16_ZERO_POINT_NIBBLES_PTX, _ZERO_POINT_NIBBLES_CONSTRAINTS,
                                     [pair, scale, zero], (torch.float16, torch.float16), True, 4)


Nibbles = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (zero points?, dtype) -> the bit-operation form on CUDA; the arithmetic forms by zero points?
_PTX_FORMS: dict[tuple[bool, torch.dtype], Nibbles] = {
    (False, torch.bfloat16): int4_nibbles_bf16_ptx,
    (False, torch.float16): int4_nibbles_fp16_ptx,
    (True, torch.bfloat16): int4_zero_point_nibbles_bf16_ptx,
    (True, torch.float16): int4_zero_point_nibbles_fp16_ptx,
}
_ARITHMETIC_FORMS: dict[bool, Nibbles] = {False: int4_nibbles, True: int4_zero_point_nibbles}


def int4_dequantizer(x: torch.Tensor, zero_points: bool) -> Nibbles:
    """The int4 kernels' ``nibbles`` argument for ``x`` and the format (``zero_points``: one per group, else
    the fixed one): the bit-operation form on a CUDA device for 16-bit floats, else the arithmetic one (fp32,
    and Triton's interpreter, which runs no PTX)."""
    if x.is_cuda and (zero_points, x.dtype) in _PTX_FORMS:
        return _PTX_FORMS[zero_points, x.dtype]
    return _ARITHMETIC_FORMS[zero_points]
