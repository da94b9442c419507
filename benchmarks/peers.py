"""The library GEMMs a quantized row is compared with, each alone: the kernel the machine already has for the
format, on inputs already in its form (activation quantized, weight packed), with no epilogue, and the bf16
GEMM of the float weight.

- ``peer``: tinygemm (``aten._weight_int4pack_mm``) for int4 weight-only, ``aten._weight_int8pack_mm`` for
  int8 weight-only, cuBLASLt ``_scaled_mm`` for fp8 per token, cuBLAS ``_int_mm`` for int8 W8A8 (rows padded
  to 17 where M <= 16, as cuBLAS needs); none for block fp8 (its blockwise ``_scaled_mm`` exists only on some
  builds and GPUs).
- ``cublas_bf16``: ``torch.mm`` of the activation and the float weight (cuBLAS), what not quantizing costs.

A peer time is a lower bound on what the library path costs (it leaves out the activation's quantization
and the epilogue), so a row that beats it beats the machine's best kernel, not just torch.compile. Each peer
is checked against the float64 product of the same prepared inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from benchmarks.common import QUANT_RECIPES
from helion_backend.kernels.tinygemm import tinygemm_mm, tinygemm_operands, tinygemm_problem
from helion_backend.layers.quantize import (
    INT_MM_MIN_M,
    Fp8DynamicLinear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
)
from helion_backend.semantics.reference import dequantize_int4

PEER, CUBLAS_BF16 = "peer", "cublas_bf16"
PEER_VARIANTS = (PEER, CUBLAS_BF16)


@dataclasses.dataclass
class PeerCall:
    """One library GEMM on prepared inputs: ``run()`` launches it; ``reference()`` computes its float64
    product (only the checked copy's is ever computed: a float64 weight is 8 bytes an element)."""

    kernel: str
    run: Callable[[], torch.Tensor]
    reference: Callable[[], torch.Tensor]


def peer_call(variant: str, quant: str | None, weight: torch.Tensor, quantized: torch.nn.Module | None,
              x: torch.Tensor) -> PeerCall | None:
    """The ``variant``'s library GEMM for this layer (float ``weight``, ``quantized`` as the benchmark format
    ``quant`` of :data:`~benchmarks.common.QUANT_RECIPES`) and activation ``x`` [M, K]; None where the format
    has no peer (``peer`` of a float row, block fp8)."""
    if variant == CUBLAS_BF16:
        w = weight.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        return PeerCall("cuBLAS mm (bf16 weight)", lambda: torch.mm(xb, w.t()), lambda: xb.double() @ w.double().t())
    if variant != PEER:
        raise ValueError(f"unknown peer variant {variant!r}; valid: {', '.join(PEER_VARIANTS)}")
    build = _PEERS.get(QUANT_RECIPES[quant][0]) if quant else None
    return None if build is None else build(quantized, x)


def _scaled_mm_peer(layer: Fp8DynamicLinear, x: torch.Tensor) -> PeerCall:
    xq, scale = layer.quantize_activation(x)
    wq = layer.qweight.t()

    def run() -> torch.Tensor:
        return torch._scaled_mm(xq, wq, scale_a=scale, scale_b=layer.weight_scale, out_dtype=x.dtype)

    def reference() -> torch.Tensor:
        return (xq.double() * scale.double()) @ (wq.double() * layer.weight_scale.double())

    return PeerCall("cuBLASLt _scaled_mm (row-wise scales)", run, reference)


def _int_mm_peer(layer: Int8DynamicLinear, x: torch.Tensor) -> PeerCall:
    xq, _ = layer.quantize_activation(x)
    rows = max(x.shape[0], INT_MM_MIN_M) if x.is_cuda else x.shape[0]
    padded = torch.zeros(rows, x.shape[1], dtype=torch.int8, device=x.device)
    padded[: x.shape[0]] = xq
    wq = layer.qweight.t()
    def reference() -> torch.Tensor:
        return padded.double() @ wq.double()  # the padding rows are zeros, as _int_mm gives them

    return PeerCall(f"cuBLAS _int_mm ({rows} rows)", lambda: torch._int_mm(padded, wq), reference)


def _int8pack_mm_peer(layer: Int8WeightOnlyLinear, x: torch.Tensor) -> PeerCall:
    def run() -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.weight_scale)

    def reference() -> torch.Tensor:
        return (x.double() @ layer.qweight.double().t()) * layer.weight_scale.double()

    return PeerCall("aten _weight_int8pack_mm", run, reference)


def _tinygemm_peer(layer: Int4WeightOnlyLinear, x: torch.Tensor) -> PeerCall | None:
    if tinygemm_problem(x.dtype, layer.in_features, layer.out_features, layer.group_size) is not None:
        return None
    tiled, scales_and_zeros = tinygemm_operands(layer.packed, layer.group_params)

    def run() -> torch.Tensor:
        return tinygemm_mm(x, tiled, scales_and_zeros)

    def reference() -> torch.Tensor:
        # The layer's own weight: tinygemm's bf16 zeros ((8 - z) * scale, rounded) count as its error.
        return x.double() @ dequantize_int4(layer.packed, layer.group_params, torch.float64).t()

    return PeerCall("tinygemm _weight_int4pack_mm", run, reference)


_PEERS: dict[str, Callable[[torch.nn.Module, torch.Tensor], PeerCall | None]] = {
    "fp8_dynamic": _scaled_mm_peer,
    "int8_dynamic": _int_mm_peer,
    "int8_weight_only": _int8pack_mm_peer,
    "int4_weight_only": _tinygemm_peer,
}
