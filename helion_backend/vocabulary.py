"""The one fixed vocabulary of the backend: GEMM anchors and epilogue steps.

Rule files, the matcher, the fused op, the kernels and the report all speak in these names; nothing
else in the package spells a step name or an anchor name as a literal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Operand(enum.Enum):
    """What extra input an epilogue step reads, and the shape the fused op expects it in."""

    NONE = "none"
    SCALAR = "scalar"  # a Python float, carried in the op's ``scalars`` list
    ROW = "row"  # a length-N vector broadcast over the M rows (bias)
    FULL = "full"  # a tensor with the output's shape [M, N] (residual, mul)


@dataclass(frozen=True)
class StepKind:
    name: str
    operand: Operand
    doc: str


# Unary activations. Their fp32 formulas live in :mod:`helion_backend.epilogue`; the matcher
# identifies decomposed activation regions against those same formulas.
ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid")

EPILOGUE_STEPS: dict[str, StepKind] = {
    step.name: step
    for step in (
        StepKind("bias", Operand.ROW, "add a length-N vector to every row"),
        StepKind("residual", Operand.FULL, "add a tensor of the output's shape"),
        StepKind("scale", Operand.SCALAR, "multiply by a Python scalar"),
        StepKind("mul", Operand.FULL, "multiply elementwise by a tensor of the output's shape"),
        *(StepKind(name, Operand.NONE, f"apply {name}") for name in ACTIVATIONS),
        StepKind("cast", Operand.NONE, "change the output dtype (the epilogue itself runs in fp32)"),
    )
}

# Prologue steps (activation quantization, weight dequantization, casts) arrive with the quantized
# kernels; rule files may already carry an empty ``prologue`` list.
PROLOGUE_STEPS: dict[str, StepKind] = {}


class Anchor(enum.Enum):
    """GEMM forms a rule can anchor on, named as rule files name them."""

    MM = "mm"  # aten.mm with a [K, N] right-hand side
    ADDMM = "addmm"  # aten.addmm, i.e. mm whose first epilogue step is a bias
    LINEAR = "linear"  # mm/addmm whose weight is an [N, K] tensor seen through permute([1, 0])


ANCHOR_OPS: dict[str, torch._ops.OpOverload] = {
    "mm": torch.ops.aten.mm.default,
    "addmm": torch.ops.aten.addmm.default,
}

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# Names a rule's ``where`` constraints may use.
CONSTRAINT_NAMES = ("m", "k", "n")

# Kernel families a rule may name; the kernels package registers an implementation for each.
KERNEL_FAMILIES = ("gemm",)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
