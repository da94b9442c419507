"""The one fixed vocabulary of the backend: GEMM anchors and epilogue steps.

Rule files, the matcher, the fused op, the kernels and the report all speak in these names; nothing
else in the package spells a step name or an anchor name as a literal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# The torch.compile backend's name, and the namespace of its custom ops (``torch.ops.helion_inductor``):
# the compile side names the ops it inserts through it, the run time registers them under it.
BACKEND_NAME = "helion_inductor"
OP_NAMESPACE = "helion_inductor"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Operand(enum.Enum):
    """What extra input an epilogue step reads, and the shape the fused op expects it in."""

    NONE = "none"
    SCALAR = "scalar"  # a Python float, carried in the op's ``scalars`` list
    ROW = "row"  # a length-N vector broadcast over the M rows (bias, per-channel scales)
    COL = "col"  # a length-M column [M, 1] broadcast over the N columns (per-token scales)
    ELEMENT = "element"  # a one-element tensor broadcast everywhere (per-tensor scales)
    FULL = "full"  # a tensor with the output's shape [M, N] (residual, mul)


# The gated MLP families: gate and up projections of one activation in one kernel, storing silu(gate) * up;
# in 16 bits, and on quantized rows (each projection rescaled by its own token and channel scales first).
GLU_FAMILY = "gemm_glu"
GLU_FP8_FAMILY = "gemm_glu_fp8"
GLU_INT8_FAMILY = "gemm_glu_int8"
GLU_FAMILIES = (GLU_FAMILY, GLU_FP8_FAMILY, GLU_INT8_FAMILY)


# Step names: what rule files, the report and the fused op's ``steps`` argument say. Plain strings (they travel
# in op arguments, JSON and TOML), spelled only here; the tables below describe each.
BIAS, RESIDUAL, SCALE, MUL = "bias", "residual", "scale", "mul"
TOKEN_SCALE, CHANNEL_SCALE, TENSOR_SCALE = "token_scale", "channel_scale", "tensor_scale"
ACT_SCALE, UP_MUL, CAST = "act_scale", "up_mul", "cast"
RELU, GELU, GELU_TANH, SILU, SIGMOID = "relu", "gelu", "gelu_tanh", "silu", "sigmoid"
QUANT_FP8_PER_TOKEN, QUANT_INT8_PER_TOKEN = "quant_fp8_per_token", "quant_int8_per_token"
DEQUANT_INT8, DEQUANT_INT4, DEQUANT_INT4_ZP = "dequant_int8", "dequant_int4", "dequant_int4_zp"
QUANT_FP8_PER_GROUP, DEQUANT_FP8_BLOCK = "quant_fp8_per_group", "dequant_fp8_block"
# Transparent steps: views the matcher follows between a GEMM and its epilogue (Inductor's padding undone,
# the 2-D <-> 3-D reshapes of F.linear). They compute nothing, and no rule names them.
UNPAD, RESHAPE = "unpad", "reshape"


@dataclass(frozen=True)
class StepKind:
    name: str
    operand: Operand
    doc: str
    multiplies: bool = False  # a tensor operand multiplies the value (else it is added)
    only_in: tuple[str, ...] = ()  # the kernel families that can run this step, if not all of them


# Unary activations. Their fp32 formulas live in :mod:`helion_backend.semantics.epilogue`; the matcher
# identifies decomposed activation regions against those same formulas.
ACTIVATIONS: tuple[str, ...] = (RELU, GELU, GELU_TANH, SILU, SIGMOID)

EPILOGUE_STEPS: dict[str, StepKind] = {
    step.name: step
    for step in (
        StepKind(BIAS, Operand.ROW, "add a length-N vector to every row"),
        StepKind(RESIDUAL, Operand.FULL, "add a tensor of the output's shape"),
        StepKind(SCALE, Operand.SCALAR, "multiply by a Python scalar"),
        StepKind(MUL, Operand.FULL, "multiply elementwise by a tensor of the output's shape", True),
        StepKind(TOKEN_SCALE, Operand.COL, "multiply each row by its own scale ([M, 1])", True),
        StepKind(CHANNEL_SCALE, Operand.ROW, "multiply each column by its own scale ([N])", True),
        StepKind(TENSOR_SCALE, Operand.ELEMENT, "multiply by a one-element tensor", True),
        StepKind(ACT_SCALE, Operand.NONE, "multiply each row by the scale the fused activation "
                 "quantization computed (a token_scale whose operand the prologue produces)", True),
        StepKind(UP_MUL, Operand.NONE, "multiply by a second GEMM of the same activation (a gated MLP's "
                 "up projection), computed in the same kernel", True, only_in=GLU_FAMILIES),
        *(StepKind(name, Operand.NONE, f"apply {name}") for name in ACTIVATIONS),
        StepKind(CAST, Operand.NONE, "change the output dtype (the epilogue itself runs in fp32)"),
    )
}

# Steps that only scale the accumulator: they commute with each other (up to fp32 rounding), so the
# fused activation quantization may take its ``act_scale`` from behind them.
SCALING_STEPS = frozenset(s.name for s in EPILOGUE_STEPS.values() if s.multiplies and s.name not in (MUL, UP_MUL))

# Prologue steps: what happens to the GEMM's operands before the multiply, inside the kernel.
QUANT_DTYPES: dict[str, torch.dtype] = {"float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8}
# Dynamic per-token activation quantization, by the dtype it quantizes to.
ACTIVATION_QUANT_STEPS: dict[torch.dtype, str] = {
    torch.float8_e4m3fn: QUANT_FP8_PER_TOKEN,
    torch.int8: QUANT_INT8_PER_TOKEN,
}
# The packed int4 weight format that ``dequant_int4`` reads (helion_backend.layers.quantize.Int4WeightOnlyLinear):
# uint8 [N, K/2], byte j of a row holding column 2j in its low nibble and 2j + 1 in its high nibble,
# values 0..15 standing for q - INT4_ZERO_POINT, and a [N, K/G] scale per group of G columns. With zero
# points (``dequant_int4_zp``), a [N, K/G, 2] tensor holds each group's scale and zero point, the value
# standing for (q - zero) * scale.
INT4_ZERO_POINT = 8
INT4_LOW_MASK, INT4_HIGH_SHIFT = 15, 4  # p & 15 is the low nibble, p >> 4 the high one
# Block fp8 (DeepSeek-V3): the activation quantized per 1 x FP8_BLOCK group along K, the weight scaled per
# FP8_BLOCK x FP8_BLOCK block.
FP8_BLOCK = 128
# RMSNorm feeding a float GEMM: the kernel reads the un-normalized activation and the norm's weight.
RMSNORM = "rmsnorm"
PROLOGUE_STEPS: dict[str, StepKind] = {
    step.name: step
    for step in (
        *(StepKind(name, Operand.NONE, f"quantize the activation to {dtype_name(dtype)} with a dynamic "
                   "per-token scale (amax over K)") for dtype, name in ACTIVATION_QUANT_STEPS.items()),
        StepKind(DEQUANT_INT8, Operand.NONE, "convert an int8 weight to the activation's dtype"),
        StepKind(DEQUANT_INT4, Operand.NONE, "unpack an int4 weight stored two per byte (low nibble first), "
                 f"subtract the zero point {INT4_ZERO_POINT} and multiply by its scale per group along K"),
        StepKind(DEQUANT_INT4_ZP, Operand.NONE, "unpack an int4 weight stored two per byte (low nibble first), "
                 "subtract its group's zero point and multiply by its group's scale ([N, K/G, 2] scales and "
                 "zero points along K)"),
        StepKind(QUANT_FP8_PER_GROUP, Operand.NONE, f"quantize the activation to float8_e4m3fn with a dynamic "
                 f"scale per 1 x {FP8_BLOCK} group along K (amax over the group)"),
        StepKind(DEQUANT_FP8_BLOCK, Operand.NONE, f"scale a float8_e4m3fn weight per {FP8_BLOCK} x {FP8_BLOCK} "
                 "block"),
        StepKind(RMSNORM, Operand.NONE, "RMS-normalize each row of the activation over K in float32 and "
                 "scale it by the norm's weight [K] (the norm's eps and dtype round trips as the graph has them)"),
    )
}


class Anchor(enum.Enum):
    """GEMM forms a rule can anchor on, named as rule files name them."""

    MM = "mm"  # aten.mm with a [K, N] right-hand side
    ADDMM = "addmm"  # aten.addmm, i.e. mm whose first epilogue step is a bias
    LINEAR = "linear"  # mm/addmm whose weight is an [N, K] tensor seen through permute([1, 0])
    SCALED_MM = "scaled_mm"  # aten._scaled_mm (fp8): its scales and bias become leading epilogue steps (block
    # scales: the block fp8 prologue)
    INT_MM = "int_mm"  # aten._int_mm (int8 x int8 -> int32)


ANCHOR_OPS: dict[str, torch._ops.OpOverload] = {
    "mm": torch.ops.aten.mm.default,
    "addmm": torch.ops.aten.addmm.default,
    "scaled_mm": torch.ops.aten._scaled_mm.default,
    "int_mm": torch.ops.aten._int_mm.default,
}

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}

# Input dtypes a rule may name: the float ones above, and the quantized ones a GEMM may take.
RULE_DTYPES: dict[str, torch.dtype] = {**SUPPORTED_DTYPES, **QUANT_DTYPES}

# Names a rule's ``where`` constraints may use.
CONSTRAINT_NAMES = ("m", "k", "n")

@dataclass(frozen=True)
class FamilyContract:
    """What a rule may ask of one kernel family: the GEMM input dtypes it multiplies and the prologue steps it
    runs. How the family runs (its kernel, configs, tuning problem, reference) is its registry row,
    :class:`helion_backend.kernels.family.KernelFamily`, one layer up."""

    name: str
    dtypes: tuple[str, ...]
    prologue: tuple[str, ...] = ()
    needs_prologue: bool = False  # e.g. the weight-only kernel exists for its dequantization
    needs_steps: tuple[str, ...] = ()  # epilogue steps every site of the family has (the gated MLP's up_mul)


# The int8 weight-only family: a float activation, the weight converted to its dtype in the K loop.
WEIGHT_ONLY_FAMILY = "gemm_weight_only"
# The packed int4 weight-only family (its configs count the K block in bytes, see kernels/configs.py).
INT4_FAMILY = "gemm_int4"
# The block fp8 family (its K block is always FP8_BLOCK: one activation group, one weight block).
FP8_BLOCK_FAMILY = "gemm_fp8_block"
DEFAULT_KERNEL_FAMILY = "gemm"
# The per-token quantized families (fp8 ``_scaled_mm``, int8 ``_int_mm``).
FP8_FAMILY, INT8_FAMILY = "gemm_fp8", "gemm_int8"
# Kernel families a rule may name; the kernels package has a registry row for each.
KERNEL_FAMILIES: dict[str, FamilyContract] = {
    family.name: family
    for family in (
        FamilyContract(DEFAULT_KERNEL_FAMILY, tuple(SUPPORTED_DTYPES), (RMSNORM,)),
        FamilyContract(FP8_FAMILY, ("float8_e4m3fn",), (ACTIVATION_QUANT_STEPS[torch.float8_e4m3fn],)),
        FamilyContract(INT8_FAMILY, ("int8",), (ACTIVATION_QUANT_STEPS[torch.int8],)),
        FamilyContract(WEIGHT_ONLY_FAMILY, tuple(SUPPORTED_DTYPES), ("dequant_int8",), needs_prologue=True),
        FamilyContract(INT4_FAMILY, tuple(SUPPORTED_DTYPES), (DEQUANT_INT4, DEQUANT_INT4_ZP), needs_prologue=True),
        FamilyContract(FP8_BLOCK_FAMILY, tuple(SUPPORTED_DTYPES), ("quant_fp8_per_group", "dequant_fp8_block"),
                       needs_prologue=True),
        FamilyContract(GLU_FAMILY, tuple(SUPPORTED_DTYPES), (RMSNORM,), needs_steps=("up_mul",)),
        # On rows quantized before the GEMM (Inductor's per-token quantization, the default): no prologue.
        FamilyContract(GLU_FP8_FAMILY, ("float8_e4m3fn",), needs_steps=("up_mul",)),
        FamilyContract(GLU_INT8_FAMILY, ("int8",), needs_steps=("up_mul",)),
    )
}
# Not a rule's family: the one launch that runs several GEMMs of one activation (passes/shared_input.py
# groups them), by the family of the sites it takes; its configs are keyed by the sum of their N.
MULTI_GEMM_FAMILY = "gemm_multi"
MULTI_GEMM_FAMILIES: dict[str, str] = {
    DEFAULT_KERNEL_FAMILY: MULTI_GEMM_FAMILY,
    FP8_FAMILY: "gemm_multi_fp8",  # q, k and v on the same quantized rows (and token scale)
    INT8_FAMILY: "gemm_multi_int8",
}
MULTI_GEMM_FP8_FAMILY, MULTI_GEMM_INT8_FAMILY = MULTI_GEMM_FAMILIES[FP8_FAMILY], MULTI_GEMM_FAMILIES[INT8_FAMILY]
MULTI_GEMM_SLOTS = 3  # sites one such launch runs (a decoder's q, k and v)
# The single-GEMM family whose kernel each fused family's sites would run alone: a quantized fused family
# without config table entries for a shape takes that family's (then its defaults) at the same (K, N).
MEMBER_FAMILY: dict[str, str] = {
    **{multi: member for member, multi in MULTI_GEMM_FAMILIES.items()},
    GLU_FAMILY: DEFAULT_KERNEL_FAMILY, GLU_FP8_FAMILY: FP8_FAMILY, GLU_INT8_FAMILY: INT8_FAMILY,
}
CONFIG_FALLBACK: dict[str, str] = {family: MEMBER_FAMILY[family]
                                   for family in ("gemm_multi_fp8", "gemm_multi_int8", GLU_FP8_FAMILY, GLU_INT8_FAMILY)}

# Decode attention (passes/attention.py, kernels/attention.py): the aten forms ``scaled_dot_product_attention``
# takes in a post-grad graph, by the name of their mask argument (None: the form takes no mask).
SDPA_OPS: dict[torch._ops.OpOverload, str | None] = {
    torch.ops.aten._scaled_dot_product_flash_attention.default: None,
    torch.ops.aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
}
# The dtypes and the largest head dimension the decode attention kernel takes.
ATTENTION_DTYPES = tuple(SUPPORTED_DTYPES.values())
ATTENTION_MAX_HEAD_DIM = 256

# What a placement decision rests on (helion_backend/policy.py), as the site report names it.
EVIDENCE_EXACT = "exact"  # the config table's entry at the key (family, dtype, K, N, M)
EVIDENCE_CALIBRATED = "calibrated"  # the same, measured by option autotune_missing before a first run
EVIDENCE_NEAREST = "nearest"  # the same (K, N) at the tuned Ms on either side of M
EVIDENCE_PREDICTED = "predicted"  # the tuned shapes of the family close to (K, N)
EVIDENCE_NONE = "none"  # nothing close enough was measured
EVIDENCE = (EVIDENCE_EXACT, EVIDENCE_CALIBRATED, EVIDENCE_NEAREST, EVIDENCE_PREDICTED, EVIDENCE_NONE)
# torch.distributed in a post-grad graph (tensor parallelism): the op namespaces of collectives and their
# waits, functional (``torch.distributed._functional_collectives``, DTensor's redistributions) or not, and of
# the fused collective matmuls Inductor's micro-pipeline TP pass makes. A site never takes one in, and never
# moves a GEMM or its epilogue past one (``patterns.collective_between``).
COLLECTIVE_NAMESPACES = frozenset({
    "_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "c10d", "_dtensor", "symm_mem",
})
# Op namespaces whose ops CUDA graphs capture: PyTorch's own and Inductor's (Inductor partitions around those of them that
# sync, such as ``aten.nonzero``), this backend's, the collectives (NCCL kernels capture), and the quantization
# decompositions (pure tensor math). Other custom ops run outside CUDA graphs unless the option
# ``cudagraph_safe_ops`` vouches for them (:mod:`helion_backend.cuda_graphs`).
CAPTURE_SAFE_NAMESPACES = frozenset({
    "aten", "prims", "inductor", OP_NAMESPACE, "quantized_decomposed", *COLLECTIVE_NAMESPACES,
})
