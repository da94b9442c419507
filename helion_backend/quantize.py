"""The public import path of the quantized layers, :mod:`helion_backend.layers.quantize`."""

from helion_backend.layers.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    INT_MM_MIN_M,
    QUANT_FORMATS,
    BlockFp8Linear,
    Fp8DynamicLinear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    quantize,
)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "INT_MM_MIN_M",
    "QUANT_FORMATS",
    "BlockFp8Linear",
    "Fp8DynamicLinear",
    "Int4WeightOnlyLinear",
    "Int8DynamicLinear",
    "Int8WeightOnlyLinear",
    "quantize",
]
