"""Recognizers for quantization prologues in the forms the post-grad graph really has.

A packed int4 weight is found as the exact chain that unpacks, centers and scales it
(:func:`int4_weight_dequant`); the kernel reads the bytes and the group scales instead. Block fp8 written
by hand is found as the two dequantizations feeding a float GEMM (:func:`block_fp8_operands`), and
through ``torch._scaled_mm`` as its blockwise scales (:func:`block_scaled_mm_operands`); either way its
activation's quantization per group is recorded as a program like the per-token one.

Dynamic per-token activation quantization is found as the region of pointwise ops and one amax over K
that computes the GEMM's quantized input and its per-token scale from one float tensor. The region is
recorded op by op as a :class:`~helion_backend.semantics.quant_program.QuantProgram`, which the kernel replays
on tiles: no canonical formula is assumed, so any mix of ``amax``/``max``, ``div``/``mul``,
reciprocals, clamps and fp32 round trips is computed exactly as written. The amax may drop its
dimension and get it back (``x.abs().max(dim=-1)[0].unsqueeze(-1)``, vLLM's native form), and the GEMM
may read the [M, 1] scale through views (``scale.unsqueeze(-1).reshape(-1, 1)``, torchao's).
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from helion_backend.compile.recognize.patterns import RESHAPES, activation_identity, same_shape, val
from helion_backend.semantics.quant_program import (
    CONVERT,
    REDUCE,
    Instruction,
    QuantProgram,
    Value,
    check_program,
    ref,
)
from helion_backend.vocabulary import (
    INT4_HIGH_SHIFT,
    INT4_LOW_MASK,
    INT4_ZERO_POINT,
    QUANT_DTYPES,
    SUPPORTED_DTYPES,
    dtype_name,
)

aten = torch.ops.aten
prims = torch.ops.prims

_POINTWISE = {
    aten.abs.default: "abs", aten.neg.default: "neg", aten.reciprocal.default: "reciprocal",
    aten.round.default: "round", aten.add.Tensor: "add", aten.sub.Tensor: "sub",
    aten.mul.Tensor: "mul", aten.div.Tensor: "div", aten.clamp_min.default: "clamp_min",
    aten.clamp_max.default: "clamp_max", aten.clamp.default: "clamp", aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}
_MAX_REGION_NODES = 32
# Reductions a quantization may take besides its one amax, which a program cannot hold (named in the report).
_OTHER_REDUCTIONS = frozenset({aten.amin.default, aten.min.dim, aten.sum.dim_IntList, aten.mean.dim})


@dataclass(frozen=True)
class ActivationQuant:
    """``x`` quantized per token: the program, and the graph nodes it stands for."""

    x: fx.Node
    program: QuantProgram
    nodes: tuple[fx.Node, ...]


def activation_quant(quantized: fx.Node, scale: fx.Node, rank: int = 2) -> ActivationQuant | None:
    """The per-token quantization computing ``quantized`` and ``scale`` from one float tensor, or None.

    ``quantized`` must be an [M, K] fp8/int8 tensor and ``scale`` the [M, 1] column that rescales the
    GEMM's rows; both must be computed from one [M, K] float tensor x by pointwise ops and a single
    amax over K, with the scale depending on x only through that amax. With ``rank=3`` the tensors are
    [M, K/G, G] and [M, K/G, 1]: a quantization per group of G along K (block fp8), which is the same
    program run on each [M, G] slice.
    """
    q, s = val(quantized), val(scale)
    if q is None or s is None or q.dim() != rank or q.dtype not in QUANT_DTYPES.values():
        return None
    if quantized.target is not prims.convert_element_type.default:
        return None
    if rank == 2:
        scale = _column_source(scale)
    region = _region(quantized, scale)
    if region is None:
        return None
    nodes, x = region
    x_val = val(x)
    if x_val is None or x_val.dtype not in SUPPORTED_DTYPES.values() or not same_shape(x_val.shape, q.shape):
        return None
    program = _program(x, nodes, quantized, scale)
    if program is None:
        return None
    return ActivationQuant(x, program, tuple(nodes))


def quantized_rows(quantized: fx.Node, scale: fx.Node) -> tuple:
    """Which rows a GEMM on quantized rows multiplies, and under which token scale: the same for every
    per-token quantization of one activation by the same ops (each quantized linear quantizes its input
    itself, and the post-grad graph keeps each copy, so q, k and v read three equal quantizations), else
    the quantized node itself and its scale. Equal keys mean equal rows and scales."""
    found = activation_quant(quantized, scale)
    if found is None:
        return ("nodes", *activation_identity(quantized), scale)
    return ("program", *activation_identity(found.x), found.program.to_json())


def rows_without_scale(rows: tuple) -> tuple | None:
    """A :func:`quantized_rows` key without its token scale where it names one quantized node (equal results:
    the same node's rows under two scales), else None (a recognized quantization's key holds no scale node)."""
    return rows[:-1] if rows[0] == "nodes" else None


def activation_quant_problem(quantized: fx.Node, scale: fx.Node) -> str:
    """Why :func:`activation_quant` found no quantization of one activation behind ``quantized`` and
    ``scale``, for the report: most often a Python float that Dynamo made a graph input."""
    _, leaves = _ancestors(quantized, scale, root=None)
    lifted = [leaf.name for leaf in sorted(leaves, key=lambda n: n._sort_key) if _is_lifted_scalar(leaf)]
    if lifted:
        return (f"it reads {', '.join(lifted)}, a 0-d graph input: a Python float that torch.compile(dynamic=True) "
                "passes in per call, where the kernels compile the quantization's constants in; read the constant "
                "in the forward (e.g. torch.finfo(dtype).max) or mark only the token dimension dynamic")
    other = sorted({str(leaf.target) for leaf in leaves if leaf.target in _OTHER_REDUCTIONS})
    if other:  # torchao's int8 scale: max(-min(amin(x), 0), max(amax(x), 0)) / 127.5
        return (f"its scale also reduces the activation with {', '.join(other)}, where the kernels replay a single "
                "amax over K")
    return "it reads tensors other than the activation, or ops outside the vocabulary"


_VIEWS = frozenset({*RESHAPES, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default})


def _column_source(scale: fx.Node) -> fx.Node:
    """The [M, 1] column that the [M, 1] ``scale`` is a view of, or ``scale`` itself. Views of a tensor
    whose only dimension of size above one is the first (M) keep its elements in the same order, so the
    column and the view are the same scales."""
    found, node, m = scale, scale, val(scale).shape[0]
    while node.op == "call_function" and node.target in _VIEWS and isinstance(node.args[0], fx.Node):
        source = val(node.args[0])
        if source is None or source.dim() < 1 or not statically_known_true(source.shape[0] == m) or not all(
                statically_known_true(d == 1) for d in source.shape[1:]):
            break
        node = node.args[0]
        if same_shape(source.shape, val(scale).shape):
            found = node
    return found


def _is_lifted_scalar(node: fx.Node) -> bool:
    """A graph input that stands for a Python float: Dynamo passes an unspecialized float as a 0-d float64
    tensor (a model's own scalar buffer is a tensor in its dtype)."""
    value = val(node)
    return node.op == "placeholder" and (isinstance(value, torch.SymFloat) or (
        isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64))


def _region(quantized: fx.Node, scale: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """The ancestors of both outputs made of supported ops, down to the one tensor x they start from.

    x is searched along the single-input ops above the amax (``abs(x.float())``: x, then x.float()),
    farthest first: the kernel should read the tensor the model has, not an fp32 copy of it. The
    search stops at an op with two tensor inputs (an RMSNorm's last multiply is x, not part of it).
    """
    for candidate in _root_candidates(quantized, scale):
        members, leaves = _ancestors(quantized, scale, candidate)
        if members is not None and leaves == {candidate}:
            return sorted(members, key=lambda n: n._sort_key), candidate
    return None


def _ancestors(quantized: fx.Node, scale: fx.Node,
               root: fx.Node | None) -> tuple[set[fx.Node] | None, set[fx.Node]]:
    members: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [quantized, scale]
    while todo:
        node = todo.pop()
        if node in members or node in leaves:
            continue
        if node is root or not _supported(node):
            leaves.add(node)
            continue
        members.add(node)
        if len(members) > _MAX_REGION_NODES:
            return None, leaves
        todo.extend(node.all_input_nodes)
    return members, leaves


def _root_candidates(quantized: fx.Node, scale: fx.Node) -> list[fx.Node]:
    reduction = next((n for n in _walk_up(scale) if _is_reduction(n)), None)
    if reduction is None:
        return []
    chain, node = [], _reduction_input(reduction)
    while True:
        chain.append(node)
        tensor_inputs = node.all_input_nodes
        if not _supported(node) or len(tensor_inputs) != 1 or len(chain) > _MAX_REGION_NODES:
            break
        node = tensor_inputs[0]
    return chain[::-1]


def _walk_up(start: fx.Node) -> list[fx.Node]:
    """Supported ancestors of ``start`` (itself included), nearest first."""
    seen, order, todo = set(), [], [start]
    while todo and len(order) <= _MAX_REGION_NODES:
        node = todo.pop(0)
        if node in seen or not _supported(node):
            continue
        seen.add(node)
        order.append(node)
        todo.extend(node.all_input_nodes)
    return order


def _is_reduction(node: fx.Node) -> bool:
    """An amax or ``max.dim(..)[0]``, or the unsqueeze that gives one back the dimension it dropped."""
    if node.target is aten.unsqueeze.default:
        return isinstance(node.args[0], fx.Node) and _is_reduction(node.args[0])
    return node.target is aten.amax.default or (
        node.target is operator.getitem and getattr(node.args[0], "target", None) is aten.max.dim
    )


def _reduction_input(node: fx.Node) -> fx.Node:
    if node.target is aten.unsqueeze.default:
        return _reduction_input(node.args[0])
    return node.args[0].args[0] if node.target is operator.getitem else node.args[0]


def _read_through_unsqueeze(node: fx.Node) -> bool:
    """A reduction that dropped its dimension, read only by unsqueezes that give it back: the program
    takes those unsqueezes as the reduction (one [.., 1] column), and skips the node itself."""
    return (node.target is not aten.unsqueeze.default and _is_reduction(node) and bool(node.users)
            and all(user.target is aten.unsqueeze.default for user in node.users))


def _supported(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _POINTWISE or node.target in (aten.amax.default, aten.max.dim):
        return True
    if node.target is prims.convert_element_type.default:
        return True
    return _is_reduction(node)


def _program(x: fx.Node, nodes: list[fx.Node], quantized: fx.Node, scale: fx.Node) -> QuantProgram | None:
    refs: dict[fx.Node, str] = {x: ref(0)}
    instructions: list[Instruction] = []
    reductions: list[tuple[fx.Node, fx.Node]] = []  # (reduction's result, its input)
    rows = val(x).shape[:-1]  # [M], or [M, K/G] for a quantization per group
    for node in nodes:
        if node.target is aten.max.dim or _read_through_unsqueeze(node):
            continue  # read through its getitem, or through the unsqueeze that keeps the reduced dimension
        out = val(node)
        if out is None or not same_shape(out.shape[:-1], rows):
            return None
        ins = _instruction(node, refs)
        if ins is None:
            return None
        if ins.op == REDUCE:
            reductions.append((node, _reduction_input(node)))
        instructions.append(ins)
        refs[node] = ref(len(instructions))
    if len(reductions) != 1 or scale not in refs or quantized not in refs:
        return None
    amax, reduced = reductions[0]
    reduced_val = val(reduced)
    if not same_shape(reduced_val.shape, val(x).shape) or not statically_known_true(val(amax).shape[-1] == 1):
        return None
    if not same_shape(val(scale).shape, val(amax).shape):
        return None
    program = QuantProgram(
        tuple(instructions), refs[reduced], refs[amax], refs[scale], refs[quantized],
        dtype_name(reduced_val.dtype),
    )
    try:
        check_program(program)
    except ValueError:
        return None
    return program


def _instruction(node: fx.Node, refs: dict[fx.Node, str]) -> Instruction | None:
    def arg(a):
        if isinstance(a, fx.Node):
            return Value(refs[a]) if a in refs else _INVALID
        if a is None or (isinstance(a, numbers.Real) and not isinstance(a, bool)):
            return a
        return _INVALID

    if node.target is prims.convert_element_type.default:
        dtype = node.args[1]
        if not isinstance(dtype, torch.dtype) or (dtype not in SUPPORTED_DTYPES.values()
                                                   and dtype not in QUANT_DTYPES.values()):
            return None
        source = arg(node.args[0])
        return None if source is _INVALID else Instruction(CONVERT, (source, dtype_name(dtype)))
    if node.target is aten.unsqueeze.default:  # amax(v, -1) or max(v, -1)[0], unsqueezed back to [.., 1]
        reduction = node.args[0]
        source = val(reduction)
        if source is None or node.args[1] not in (-1, source.dim()):
            return None
        if reduction.target is operator.getitem:
            if reduction.args[1] != 0:
                return None
            reduction = reduction.args[0]
        if not _reduces_last_dim(reduction, *reduction.args[1:], keepdim_required=False):
            return None
        source = arg(reduction.args[0])
        return None if source is _INVALID else Instruction(REDUCE, (source,))
    if node.target is operator.getitem:  # max.dim(v, dim, keepdim)[0]
        reduction = node.args[0]
        if node.args[1] != 0 or not _reduces_last_dim(reduction, *reduction.args[1:]):
            return None
        source = arg(reduction.args[0])
        return None if source is _INVALID else Instruction(REDUCE, (source,))
    if node.target is aten.amax.default:
        if not _reduces_last_dim(node, *node.args[1:]):
            return None
        source = arg(node.args[0])
        return None if source is _INVALID else Instruction(REDUCE, (source,))
    if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
        return None
    if set(node.kwargs) - {"alpha", "rounding_mode"}:
        return None
    args = tuple(arg(a) for a in node.args)
    if any(a is _INVALID for a in args):
        return None
    return Instruction(_POINTWISE[node.target], args)


def _reduces_last_dim(node: fx.Node, dim=None, keepdim=False, *rest, keepdim_required: bool = True) -> bool:
    """Whether ``node`` (amax or max.dim) reduces only the last dimension, keeping it (or, with
    ``keepdim_required=False``, dropping it)."""
    source = val(node.args[0])
    if source is None or source.dim() < 2:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    keepdim = node.kwargs.get("keepdim", keepdim)
    return keepdim is keepdim_required and len(dims) == 1 and dims[0] in (-1, source.dim() - 1)


_INVALID = object()


# --------------------------------------------------------------------------------------------------
# Packed int4 weights, dequantized in the forward (helion_backend.layers.quantize.Int4WeightOnlyLinear)

_RIGHT_SHIFTS = frozenset({aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor_Scalar})
_BITWISE = frozenset({aten.bitwise_and.Scalar, *_RIGHT_SHIFTS})
_LAST_OF_3 = (-1, 2)  # the last dimension of a 3-D tensor, as the graph may spell it


@dataclass(frozen=True)
class Int4WeightDequant:
    """An [N, K] weight computed from packed int4 bytes and group scales (and zero points): the tensors, and
    the chain."""

    packed: fx.Node  # uint8 [N, K/2]
    scales: fx.Node  # [N, K/G] scales, or with zero_points [N, K/G, 2] scales and zero points; the weight's dtype
    nodes: tuple[fx.Node, ...]  # the dequantization, the dequantized weight last
    zero_points: bool = False


def int4_weight_dequant(weight: fx.Node, dtype: torch.dtype) -> Int4WeightDequant | str | None:
    """The int4 dequantization that computes the [N, K] ``weight`` in ``dtype``; a string saying which
    part differs when ``weight`` is unpacked from uint8 bytes in some other way; None when it is not.

    Only the documented formats are taken: ``q = stack([p & 15, p >> 4], -1).reshape(N, K)`` (low nibble
    first), then ``((q.to(dtype) - 8).reshape(N, K/G, G) * s.reshape(N, K/G, 1)).reshape(N, K)``, or with
    zero points ``((q.to(dtype).reshape(N, K/G, G) - sz[:, :, 1:]) * sz[:, :, :1]).reshape(N, K)`` with
    ``sz`` [N, K/G, 2]; an even G. Anything else (another nibble order or zero point, a subtraction before
    the conversion, where uint8 would wrap around, scales broadcast another way) would compute another
    weight in the kernel.
    """
    if not _unpacks_bytes(weight):
        return None
    try:
        return _int4_chain(weight, dtype)
    except _NotTheFormat as e:
        return str(e)


class _NotTheFormat(Exception):
    """A dequantization chain differs from the one format a kernel computes (the message says where)."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise _NotTheFormat(what)


def _unpacks_bytes(weight: fx.Node) -> bool:
    """Whether ``weight`` is computed (within a few ops) by a bitwise op on a uint8 tensor."""
    seen, todo = set(), [weight]
    while todo and len(seen) <= _MAX_REGION_NODES:
        node = todo.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        source = val(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
        if node.target in _BITWISE and source is not None and source.dtype == torch.uint8:
            return True
        todo.extend(node.all_input_nodes)
    return False


def _reshape_source(node: fx.Node, shape: tuple, what: str) -> fx.Node:
    """The input of ``node``, a reshape to ``shape`` (a row-major view, so the element order is kept)."""
    _expect(node.op == "call_function" and node.target in RESHAPES and val(node) is not None,
            f"{what} is not a reshape")
    _expect(same_shape(val(node).shape, shape), f"{what} has shape {tuple(val(node).shape)}, not {shape}")
    return node.args[0]


def _int4_chain(weight: fx.Node, dtype: torch.dtype) -> Int4WeightDequant:
    w = val(weight)
    _expect(w is not None and w.dim() == 2 and w.dtype == dtype, "the weight is not a 2-D tensor in the GEMM's dtype")
    n, k = w.shape
    mul = _reshape_source(weight, (n, k), "the dequantized weight")
    _expect(mul.target is aten.mul.Tensor and not mul.kwargs and len(mul.all_input_nodes) == 2,
            "the weight is not a product of grouped values and scales")
    grouped_view, scale_view = mul.args
    if val(grouped_view) is not None and val(grouped_view).shape[-1] == 1:  # s * q: the same product
        grouped_view, scale_view = scale_view, grouped_view
    grouped_val = val(grouped_view)
    _expect(grouped_val is not None and grouped_val.dim() == 3, "the grouped values are not 3-D")
    groups, group_size = grouped_val.shape[1:]
    _expect(isinstance(groups, int) and isinstance(group_size, int) and groups * group_size == k,
            "the groups do not split K")
    _expect(group_size % 2 == 0, f"group size {group_size} is odd (a byte's two columns would span two groups)")
    _expect(val(mul).dtype == dtype, "the product is not in the GEMM's dtype")
    if grouped_view.target is aten.sub.Tensor:
        convert, params, centering = _zero_point_centering(grouped_view, scale_view, (n, groups, group_size), dtype)
    else:
        convert, params, centering = _fixed_zero_point_centering(grouped_view, scale_view, (n, groups, group_size),
                                                                 dtype)
    _expect(convert.target is prims.convert_element_type.default and convert.args[1] == dtype,
            "the zero point is not subtracted after converting the nibbles to the GEMM's dtype")
    stacked = _reshape_source(convert.args[0], (n, k), "the unpacked nibbles")
    packed, nibble_nodes = _nibbles(stacked, n, k)
    nodes = (*nibble_nodes, stacked, convert.args[0], convert, *centering, mul, weight)
    return Int4WeightDequant(packed, params, nodes, zero_points=grouped_view.target is aten.sub.Tensor)


def _fixed_zero_point_centering(grouped_view: fx.Node, scale_view: fx.Node, grouped: tuple[int, int, int],
                                dtype: torch.dtype) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...]]:
    """``(q.to(dtype) - 8).reshape(N, K/G, G)`` times ``s.reshape(N, K/G, 1)``: the conversion, the [N, K/G]
    scales and the nodes between them and the product."""
    n, groups, _ = grouped
    centered = _reshape_source(grouped_view, grouped, "the grouped values")
    scales = _reshape_source(scale_view, (n, groups, 1), "the scales")
    scales_val = val(scales)
    _expect(scales_val is not None and scales_val.dtype == dtype and same_shape(scales_val.shape, (n, groups)),
            f"the scales are not an [N, K/G] = [{n}, {groups}] tensor in {dtype_name(dtype)}")
    _expect(centered.target is aten.sub.Tensor and centered.kwargs.get("alpha", 1) == 1
            and len(centered.args) == 2 and _is_number(centered.args[1], INT4_ZERO_POINT),
            f"the values are not centered by subtracting the zero point {INT4_ZERO_POINT}")
    return centered.args[0], scales, (centered, grouped_view, scale_view)


def _zero_point_centering(sub: fx.Node, scale_view: fx.Node, grouped: tuple[int, int, int],
                          dtype: torch.dtype) -> tuple[fx.Node, fx.Node, tuple[fx.Node, ...]]:
    """``q.to(dtype).reshape(N, K/G, G) - sz[:, :, 1:]`` times ``sz[:, :, :1]`` of one [N, K/G, 2] ``sz``:
    the conversion, ``sz`` and the nodes between them and the product."""
    n, groups, _ = grouped
    _expect(sub.kwargs.get("alpha", 1) == 1 and len(sub.args) == 2 and all(isinstance(a, fx.Node) for a in sub.args),
            "the grouped values are not centered by subtracting a tensor of zero points")
    values_view, zero_view = sub.args
    params = _last_dim_slice(zero_view, 1, "the zero points")
    _expect(_last_dim_slice(scale_view, 0, "the scales") is params,
            "the scales and the zero points are not the two halves of one [N, K/G, 2] tensor")
    params_val = val(params)
    _expect(params_val is not None and params_val.dtype == dtype and same_shape(params_val.shape, (n, groups, 2)),
            f"the scales and zero points are not an [N, K/G, 2] = [{n}, {groups}, 2] tensor in {dtype_name(dtype)}")
    convert = _reshape_source(values_view, grouped, "the grouped values")
    return convert, params, (values_view, zero_view, sub, scale_view)


def _last_dim_slice(node: fx.Node, index: int, what: str) -> fx.Node:
    """The [N, K/G, 2] tensor whose last-dimension entry ``index`` ``node`` slices out (``sz[:, :, i:i+1]``)."""
    _expect(isinstance(node, fx.Node) and node.target is aten.slice.Tensor and len(node.args) >= 3,
            f"{what} are not a slice of the last dimension")
    source, dim, start = node.args[:3]
    end = node.args[3] if len(node.args) > 3 else None
    source_val = val(source) if isinstance(source, fx.Node) else None
    _expect(source_val is not None and source_val.dim() == 3 and dim in _LAST_OF_3 and start == index
            and (end == index + 1 or (index == 1 and (end is None or (isinstance(end, int) and end >= 2)))),
            f"{what} are not entry {index} of the last dimension of a 3-D tensor")
    return source


def _nibbles(stacked: fx.Node, n: int, k: int) -> tuple[fx.Node, tuple[fx.Node, ...]]:
    """``cat([unsqueeze(p & 15), unsqueeze(p >> 4)], -1)`` of one uint8 [N, K/2] p: p and the nodes."""
    _expect(stacked.target is aten.cat.default and len(stacked.args[0]) == 2
            and all(isinstance(part, fx.Node) for part in stacked.args[0])
            and (stacked.args[1] if len(stacked.args) > 1 else 0) in _LAST_OF_3,
            "the nibbles are not stacked along a new last dimension")
    low, high = (_unsqueezed(part) for part in stacked.args[0])
    _expect(low.target is aten.bitwise_and.Scalar and low.args[1] == INT4_LOW_MASK,
            f"the first nibble is not the low one (p & {INT4_LOW_MASK})")
    packed = low.args[0]
    high_nodes = [high]
    if high.target is aten.bitwise_and.Scalar and high.args[1] == INT4_LOW_MASK:  # (p >> 4) & 15: the same
        high = high.args[0]
        high_nodes.append(high)
    _expect(high.target in _RIGHT_SHIFTS and high.args[1] == INT4_HIGH_SHIFT and high.args[0] is packed,
            f"the second nibble is not the high one of the same bytes (p >> {INT4_HIGH_SHIFT})")
    p = val(packed)
    _expect(p is not None and p.dtype == torch.uint8 and same_shape(p.shape, (n, k // 2)),
            f"the packed bytes are not a uint8 [N, K/2] = [{n}, {k // 2}] tensor")
    return packed, (low, *high_nodes, *stacked.args[0])


def _unsqueezed(node: fx.Node) -> fx.Node:
    _expect(node.op == "call_function" and node.target is aten.unsqueeze.default and node.args[1] in _LAST_OF_3,
            "a nibble is not unsqueezed along the last dimension")
    return node.args[0]


def _is_number(value: object, expected: float) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == expected


# --------------------------------------------------------------------------------------------------
# Block fp8 (DeepSeek-V3), written by hand (helion_backend.layers.quantize.BlockFp8Linear): the activation
# quantized per 1 x B group along K and dequantized, the fp8 weight dequantized per B x B block.


@dataclass(frozen=True)
class BlockFp8Operands:
    """The tensors a block-fp8 GEMM reads instead of its two dequantized operands, and those chains."""

    x: fx.Node  # the float activation [M, K], before its quantization per group
    program: QuantProgram  # the quantization of one [M, B] group (the graph's own ops)
    weight: fx.Node  # fp8 [N, K]
    weight_scale: fx.Node  # fp32 [N/B, K/B], or [K/B, N/B] with weight_scale_kn
    activation_nodes: tuple[fx.Node, ...]
    weight_nodes: tuple[fx.Node, ...]
    weight_scale_kn: bool = False  # the scales are stored as _scaled_mm reads them: the op takes their transpose


def block_fp8_operands(x_dq: fx.Node, w_dq: fx.Node, dtype: torch.dtype, block: int) -> BlockFp8Operands | str | None:
    """The block-fp8 quantization behind the GEMM's ``x_dq`` [M, K] and ``w_dq`` [N, K] (both in ``dtype``),
    a string saying what differs when both are dequantized from fp8 in another way, or None when they are not.

    Taken only as written by hand: ``x_dq = (q.float() * s).reshape(M, K).to(dtype)`` where ``(q, s)`` is a
    per-group quantization of ``x.reshape(M, K/B, B)`` (any form :func:`activation_quant` takes), and
    ``w_dq = (wq.float().reshape(N/B, B, K/B, B) * ws.reshape(N/B, 1, K/B, 1)).reshape(N, K).to(dtype)``.
    """
    if not (_dequantizes_fp8(x_dq) and _dequantizes_fp8(w_dq)):
        return None
    try:
        x, program, activation_nodes = _block_fp8_activation(x_dq, dtype, block)
        weight, weight_scale, weight_nodes = _block_fp8_weight(w_dq, dtype, block)
    except _NotTheFormat as e:
        return str(e)
    return BlockFp8Operands(x, program, weight, weight_scale, activation_nodes, weight_nodes)


def _dequantizes_fp8(node: fx.Node) -> bool:
    """Whether ``node`` is computed (within a few ops) from an fp8 tensor converted to a float dtype."""
    seen, todo = set(), [node]
    while todo and len(seen) <= 8:  # breadth first: the convert is a few ops up, the scale's chain longer
        node = todo.pop(0)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is prims.convert_element_type.default:
            source = val(node.args[0])
            if source is not None and source.dtype == torch.float8_e4m3fn:
                return True
        todo.extend(node.all_input_nodes)
    return False


def _cast_to(node: fx.Node, dtype: torch.dtype, what: str) -> fx.Node:
    """``node``'s fp32 source when ``node`` converts it to ``dtype``; ``node`` itself in an fp32 model."""
    if dtype == torch.float32 and val(node).dtype == torch.float32:
        return node
    _expect(node.target is prims.convert_element_type.default and node.args[1] == dtype,
            f"{what} is not converted to the GEMM's dtype")
    _expect(val(node.args[0]) is not None and val(node.args[0]).dtype == torch.float32, f"{what} is not fp32")
    return node.args[0]


def _product(node: fx.Node, what: str) -> tuple[fx.Node, fx.Node]:
    _expect(node.target is aten.mul.Tensor and not node.kwargs and len(node.all_input_nodes) == 2,
            f"{what} is not a product of values and scales")
    return node.args[0], node.args[1]


def _block_fp8_activation(x_dq: fx.Node, dtype: torch.dtype, block: int) -> tuple[fx.Node, QuantProgram, tuple]:
    m, k = val(x_dq).shape
    _expect(isinstance(k, int) and k % block == 0, f"K={k} is not a multiple of the block {block}")
    flat = _cast_to(x_dq, dtype, "the dequantized activation")
    product = _reshape_source(flat, (m, k), "the activation")
    values, scale = _product(product, "the dequantized activation")
    if val(values) is not None and val(values).shape[-1] == 1:  # s * q: the same product
        values, scale = scale, values
    _expect(values.target is prims.convert_element_type.default and values.args[1] == torch.float32,
            "the quantized activation is not converted to fp32 before its scale")
    x, program, nodes = _grouped_quantization(values.args[0], scale, m, k, block)
    _expect(val(x).dtype == dtype, "the quantized activation is not the GEMM's [M, K] activation in its dtype")
    return x, program, (*nodes, values, product, *dict.fromkeys([flat, x_dq]))


def _grouped_quantization(quantized: fx.Node, scale: fx.Node, m: int | torch.SymInt, k: int,
                          block: int) -> tuple[fx.Node, QuantProgram, tuple[fx.Node, ...]]:
    """The float [M, K] activation that ``quantized`` (fp8 [M, K/B, B]) and ``scale`` (fp32 [M, K/B, 1]) are
    the quantization per 1 x B group of, the program, and its nodes (the grouped view of x first)."""
    scale_val = val(scale)
    _expect(scale_val is not None and scale_val.dtype == torch.float32
            and same_shape(scale_val.shape, (m, k // block, 1)), f"the activation scale is not fp32 [M, K/{block}, 1]")
    q = val(quantized)
    _expect(q is not None and q.dtype == torch.float8_e4m3fn and same_shape(q.shape, (m, k // block, block)),
            f"the activation is not quantized to fp8 in groups of {block} along K")
    found = activation_quant(quantized, scale, rank=3)
    if found is None:
        raise _NotTheFormat(f"the quantization is not a per-group ({block}) one of the activation alone "
                            f"({activation_quant_problem(quantized, scale)})")
    x = _reshape_source(found.x, (m, k // block, block), "the grouped activation")
    x_val = val(x)
    _expect(x_val is not None and x_val.dtype in SUPPORTED_DTYPES.values() and same_shape(x_val.shape, (m, k)),
            "the quantized activation is not a float [M, K] tensor")
    return x, found.program, (found.x, *found.nodes)


def _block_fp8_weight(w_dq: fx.Node, dtype: torch.dtype, block: int) -> tuple[fx.Node, fx.Node, tuple]:
    n, k = val(w_dq).shape
    _expect(isinstance(n, int) and n % block == 0, f"N={n} is not a multiple of the block {block}")
    blocks = (n // block, block, k // block, block)
    flat = _cast_to(w_dq, dtype, "the dequantized weight")
    product = _reshape_source(flat, (n, k), "the weight")
    values, scale_view = _product(product, "the dequantized weight")
    if val(values) is not None and val(values).shape[-1] == 1:
        values, scale_view = scale_view, values
    converted = _reshape_source(values, blocks, "the weight blocks")
    scale = _reshape_source(scale_view, (n // block, 1, k // block, 1), "the weight block scales")
    _expect(converted.target is prims.convert_element_type.default and converted.args[1] == torch.float32,
            "the fp8 weight is not converted to fp32 before its scale")
    weight, weight_val, scale_val = converted.args[0], val(converted.args[0]), val(scale)
    _expect(weight_val is not None and weight_val.dtype == torch.float8_e4m3fn and same_shape(weight_val.shape, (n, k)),
            "the weight is not an fp8 [N, K] tensor")
    _expect(scale_val is not None and scale_val.dtype == torch.float32
            and same_shape(scale_val.shape, (n // block, k // block)),
            f"the weight scales are not an fp32 [N/{block}, K/{block}] tensor")
    return weight, scale, (converted, values, scale_view, product, *dict.fromkeys([flat, w_dq]))


# --------------------------------------------------------------------------------------------------
# Block fp8 through torch._scaled_mm (torch >= 2.9, SM90): the same quantization, with the activation's
# [M, K/B] group scales and the weight's [K/B, N/B] block scales handed to cuBLAS.


def block_scaled_mm_operands(xq: fx.Node, scale_a: fx.Node, scale_b: fx.Node, weight: fx.Node,
                             weight_layout: str, block: int) -> BlockFp8Operands | str | None:
    """The block-fp8 operands of ``_scaled_mm(xq, mat2, scale_a, scale_b)`` (``mat2`` is ``weight`` seen in
    ``weight_layout``): None when the scales' shapes are not 1 x B activation and B x B weight ones, a
    string saying what differs when they are but the call is not the block fp8 the kernel computes.

    ``_scaled_mm`` picks its scaling from the scales' shapes alone (scale_a [M, K/B], scale_b [K/B, N/B]),
    so they decide here too. Then only this form is taken (:class:`~helion_backend.layers.quantize.BlockFp8Linear`
    writes it): K and N multiples of B, ``xq`` and ``scale_a`` the quantization per group of one float
    [M, K] activation (as :func:`block_fp8_operands` takes it), reshaped, the scales seen through the
    clones, transposes and padding that only change their layout, and ``mat2`` an fp8 [N, K] tensor
    transposed.
    """
    x_val, a, b, w = val(xq), val(scale_a), val(scale_b), val(weight)
    if any(t is None or t.dim() != 2 for t in (x_val, a, b, w)):
        return None
    (m, k), n = x_val.shape, w.shape[0 if weight_layout == "nk" else 1]
    groups = -(-k // block)
    if not (same_shape(a.shape, (m, groups)) and same_shape(b.shape, (groups, -(-n // block)))):
        return None
    try:
        _expect(k % block == 0 and n % block == 0, f"K={k} and N={n} must be multiples of the block {block}")
        _expect(a.dtype == b.dtype == torch.float32, f"the scales are {a.dtype} and {b.dtype}, not fp32")
        _expect(weight_layout == "nk" and w.dtype == torch.float8_e4m3fn,
                "mat2 is not an fp8 [N, K] weight transposed (nn.Linear's layout)")
        group_scales = _value_source(scale_a)
        _expect(not group_scales.transposed, "scale_a is not the activation's [M, K/B] group scales as computed")
        quantized = _reshape_source(xq, (m, k), "the quantized activation")
        scale = _reshape_source(group_scales.node, (m, groups), "scale_a")
        x, program, nodes = _grouped_quantization(quantized, scale, m, k, block)
    except _NotTheFormat as e:
        return str(e)
    block_scales = _value_source(scale_b)  # [K/B, N/B]; transposed, it is stored [N/B, K/B]
    return BlockFp8Operands(x, program, weight, block_scales.node, (*nodes, xq, group_scales.node, *group_scales.views),
                            block_scales.views or (scale_b,), weight_scale_kn=not block_scales.transposed)


@dataclass(frozen=True)
class _ValueSource:
    """A 2-D tensor holding a value's elements at the same indices (swapped when ``transposed``)."""

    node: fx.Node
    transposed: bool
    views: tuple[fx.Node, ...]  # the ops seen through, in graph order (the value last)


def _value_source(node: fx.Node) -> _ValueSource:
    """The deepest tensor ``node`` (2-D) only re-lays out: seen through clones, transposes, padding at the end
    and slices from the start, as long as every index of ``node`` stays inside each tensor on the way (so
    no padded element is ever read). This is how a library hands scales to ``_scaled_mm`` in the layout it
    wants (``s.t().contiguous().t()``, ``F.pad(s, (0, p)).t()[:k]``): the kernel reads ``s`` as stored."""
    shape = val(node).shape
    found = _ValueSource(node, False, ())
    current, transposed, views = node, False, []
    while (inner := _relaid_input(current)) is not None:
        flipped = transposed != _is_transpose(current)
        inner_shape = val(inner).shape[::-1] if flipped else val(inner).shape
        if not all(statically_known_true(have >= need) for have, need in zip(inner_shape, shape)):
            break
        views.append(current)
        current, transposed = inner, flipped
        if same_shape(inner_shape, shape):
            found = _ValueSource(current, transposed, tuple(reversed(views)))
    return found


def _relaid_input(node: fx.Node) -> fx.Node | None:
    """The 2-D input of ``node`` when ``node`` keeps each of its elements at the same index (or swaps the
    two indices): a clone, a transpose, a slice from the start or padding at the end; else None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    source, out = node.args[0], val(node)
    if val(source) is None or out is None or val(source).dim() != 2 or out.dim() != 2:
        return None
    if node.target is aten.clone.default or _is_transpose(node):
        return source
    if node.target is aten.slice.Tensor:
        given = list(node.args[2:5])
        start, _end, step = given + [None, None, 1][len(given):]  # aten.slice's defaults for what is left out
        return source if start in (None, 0) and step == 1 else None
    if node.target is aten.constant_pad_nd.default:
        pad = node.args[1]
        return source if all(before == 0 for before in pad[0::2]) else None
    return None


def _is_transpose(node: fx.Node) -> bool:
    return node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0])
