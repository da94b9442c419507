"""Recognizers for epilogue steps in the forms the post-grad graph really has.

Simple steps (bias, residual, scale, mul, cast) are single aten nodes. Activations arrive decomposed
(GELU as an erf or tanh chain, SiLU as neg/exp/add/div or sigmoid/mul, with fp32 round trips), in
orders that change between PyTorch versions. Instead of one structural pattern per form, an
activation is found as a *closed pointwise region*: nodes that are pure functions of one value, whose
intermediates are used only inside the region. The region is run in float64 on probe points and
compared with each activation's definition. Float casts inside a region are treated as identity: the
fused kernel computes the epilogue in fp32 on the accumulator anyway.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from helion_backend.compile.recognize.step import Step
from helion_backend.semantics.epilogue import ACTIVATION_FORMULAS
from helion_backend.vocabulary import (
    BIAS,
    CAST,
    CHANNEL_SCALE,
    COLLECTIVE_NAMESPACES,
    MUL,
    RESHAPE,
    RESIDUAL,
    SCALE,
    SUPPORTED_DTYPES,
    TENSOR_SCALE,
    TOKEN_SCALE,
    Operand,
)

aten = torch.ops.aten
prims = torch.ops.prims

_REGION_OPS = frozenset({
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.neg.default,
    aten.exp.default, aten.tanh.default, aten.erf.default, aten.sigmoid.default, aten.relu.default,
    aten.pow.Tensor_Scalar, aten.reciprocal.default, aten.clamp_min.default, aten.abs.default,
    aten.sqrt.default, aten.rsqrt.default, prims.convert_element_type.default,
})
_CASTS = frozenset({prims.convert_element_type.default})
# The ops that reshape without moving data, as they appear post-grad (F.linear's [B*S, K] views among them).
RESHAPES = frozenset({aten.reshape.default, aten.view.default, aten._unsafe_view.default})
# The collectives that Inductor's micro-pipeline TP pass fuses with the GEMM reading or producing their tensor
# (none in a torch built without torch.distributed).
_c10d = torch.ops._c10d_functional if torch.distributed.is_available() else None
_WAIT_TENSOR = _c10d.wait_tensor.default if _c10d else None
_ALL_GATHERS = (_c10d.all_gather_into_tensor.default,) if _c10d else ()
_REDUCE_SCATTERS = (_c10d.reduce_scatter_tensor.default,) if _c10d else ()
_MAX_REGION_NODES = 24
_PROBES = torch.cat([torch.linspace(-8.0, 8.0, 161, dtype=torch.float64),
                     torch.tensor([-30.0, -1e-3, 1e-3, 30.0], dtype=torch.float64)])
_PROBE_REFERENCE = {name: fn(_PROBES) for name, fn in ACTIVATION_FORMULAS.items()}


def val(node: fx.Node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def activation_identity(node: fx.Node) -> tuple:
    """What a GEMM multiplies, the same for every view of one tensor to one shape (each F.linear makes its
    own view of a 3-D activation): the node, or a reshape's input and shape. Hashable also when a size
    is symbolic (the same symbol prints the same)."""
    if node.target in RESHAPES and val(node) is not None:
        return (node.args[0], tuple(map(str, val(node).shape)))
    return (node,)


def same_shape(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def is_collective(node: fx.Node) -> bool:
    """A torch.distributed collective or its wait (:data:`~helion_backend.vocabulary.COLLECTIVE_NAMESPACES`)."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace in COLLECTIVE_NAMESPACES)


def collective_between(*nodes: fx.Node) -> fx.Node | None:
    """The first collective after the earliest of ``nodes`` and up to the latest, in graph order, if any.

    A fused op runs where the graph placed one node of its site (the rewrite inserts it before the site's
    result), so the work of every other node it replaces moves there. Functional collectives are pure, so
    such a move keeps the values, but not the order in which the program issues communication and compute,
    which Inductor's comm/compute overlap and micro-pipeline TP passes schedule from: a site whose nodes lie on
    both sides of a collective is not formed.
    """
    first, last = min(nodes, key=_order), max(nodes, key=_order)
    node = first
    while node is not last:
        node = node.next
        if is_collective(node):
            return node
    return None


def gathered_input(gemm: fx.Node) -> fx.Node | None:
    """The all-gather whose result (waited for, seen through reshapes) is the GEMM's activation, if any."""
    x = gemm.args[1] if gemm.target is aten.addmm.default else gemm.args[0]
    while isinstance(x, fx.Node) and (x.target in RESHAPES or (_WAIT_TENSOR is not None and x.target is _WAIT_TENSOR)):
        x = x.args[0]
    return x if isinstance(x, fx.Node) and x.target in _ALL_GATHERS else None


def reduce_scattered_output(gemm: fx.Node) -> fx.Node | None:
    """A reduce-scatter of the GEMM's result (seen through reshapes), if there is one."""
    todo = list(gemm.users)
    while todo:
        user = todo.pop()
        if user.target in _REDUCE_SCATTERS:
            return user
        if user.target in RESHAPES:
            todo.extend(user.users)
    return None


def is_float_cast(node: fx.Node) -> bool:
    if node.target not in _CASTS:
        return False
    out = val(node)
    return out is not None and out.dtype in SUPPORTED_DTYPES.values()


def next_step(value: fx.Node, n: int) -> Step | None:
    """The epilogue step that consumes ``value`` (the running [.., N] result), if it is one we know."""
    return activation_region(value) or _single_node_step(value, n)


# --------------------------------------------------------------------------------------------------
# Activation regions


def activation_region(value: fx.Node) -> Step | None:
    """The largest closed pointwise region fed only by ``value`` that computes a known activation."""
    if val(value) is None:
        return None
    for out in reversed(_pure_functions_of(value)):
        if out.target in _CASTS and val(out).dtype != val(value).dtype:
            continue  # a cast that changes the dtype is a step of its own, reported as such
        region = _closed_region(value, out)
        if region is None:
            continue
        name = _fingerprint(value, region)
        if name is not None:
            return Step(name, region)
    return None


def _pure_functions_of(value: fx.Node) -> list[fx.Node]:
    """Nodes after ``value`` (graph order) computed from ``value`` and constants alone."""
    pure: list[fx.Node] = []
    members = {value}
    frontier = sorted(value.users, key=_order)
    seen = set(frontier)
    while frontier and len(pure) < _MAX_REGION_NODES:
        node = frontier.pop(0)
        if not _pointwise_of(node, members):
            continue
        pure.append(node)
        members.add(node)
        for user in node.users:
            if user not in seen:
                seen.add(user)
                frontier.append(user)
        frontier.sort(key=_order)
    return sorted(pure, key=_order)


def _order(node: fx.Node) -> object:
    return node._sort_key  # the graph's topological order, kept up to date by torch.fx


def _pointwise_of(node: fx.Node, members: set[fx.Node]) -> bool:
    if node.op != "call_function" or node.target not in _REGION_OPS:
        return False
    if node.target in _CASTS and not is_float_cast(node):
        return False
    tensors = node.all_input_nodes
    constants = [a for a in (*node.args, *node.kwargs.values()) if not isinstance(a, fx.Node)]
    constants_ok = all(
        a is None or (isinstance(a, (numbers.Number, torch.dtype)) and not isinstance(a, bool))
        for a in constants
    )
    return bool(tensors) and all(t in members for t in tensors) and constants_ok


def _closed_region(value: fx.Node, out: fx.Node) -> list[fx.Node] | None:
    """``out`` and its ancestors below ``value``, if none but ``out`` is used outside the region."""
    region, todo = {out}, [out]
    while todo:
        for inp in todo.pop().all_input_nodes:
            if inp is not value and inp not in region:
                region.add(inp)
                todo.append(inp)
    if any(user not in region for node in region if node is not out for user in node.users):
        return None
    return sorted(region, key=_order)


def _fingerprint(value: fx.Node, region: list[fx.Node]) -> str | None:
    env: dict[fx.Node, torch.Tensor] = {value: _PROBES}

    def load(a):
        return env[a] if isinstance(a, fx.Node) else a

    try:
        for node in region:
            if node.target in _CASTS:
                env[node] = env[node.args[0]]
                continue
            args = [load(a) for a in node.args]
            kwargs = {k: load(v) for k, v in node.kwargs.items()}
            env[node] = node.target(*args, **kwargs)
    except Exception:  # an op that does not accept float64 probes: not an activation we know
        return None
    result = env[region[-1]]
    if result.shape != _PROBES.shape or result.dtype != torch.float64:
        return None
    for name, expected in _PROBE_REFERENCE.items():
        if torch.allclose(result, expected, rtol=1e-9, atol=1e-12):
            return name
    return None


# --------------------------------------------------------------------------------------------------
# Single-node steps


def _single_node_step(value: fx.Node, n: int) -> Step | None:
    if len(value.users) != 1:
        return None
    (user,) = value.users
    if user.op != "call_function":
        return None
    if user.target in RESHAPES:
        return _reshape_step(user, n)
    if is_float_cast(user) and user.args[0] is value:
        return Step(CAST, [user])
    if user.target is aten.add.Tensor and user.kwargs.get("alpha", 1) == 1:
        return _add_step(value, user, n)
    if user.target is aten.mul.Tensor:
        return _mul_step(value, user, n)
    return None


def _other_arg(value: fx.Node, node: fx.Node) -> object:
    a, b = node.args[:2]
    if a is value and b is not value:
        return b
    if b is value and a is not value:
        return a
    return None


def _integer_product_scale(other: object, value: fx.Node, n: int) -> object:
    """What an integer GEMM product is rescaled by: ``t`` where ``other`` is ``t.expand(M, N)`` of a column, a
    row or one element (torchao's int8 CUDA path multiplies ``_int_mm``'s result by ``scale.expand(M, N)``),
    read broadcast, the same values; else ``other``. Float products keep such an operand whole: their rules
    take a full-shape ``mul`` where they take no per-token scale."""
    if (not isinstance(other, fx.Node) or other.target is not aten.expand.default
            or getattr(val(value), "dtype", None) != torch.int32):
        return other
    source = other.args[0]
    return source if operand_kind(source, val(value), n) in (Operand.ROW, Operand.COL, Operand.ELEMENT) else other


def _add_step(value: fx.Node, node: fx.Node, n: int) -> Step | None:
    other = _other_arg(value, node)
    kind = operand_kind(other, val(value), n)
    if kind is Operand.ROW:
        return Step(BIAS, [node], operand=other)
    if kind is Operand.FULL:
        return Step(RESIDUAL, [node], operand=other)
    return None


_MUL_STEPS = {Operand.FULL: MUL, Operand.ROW: CHANNEL_SCALE, Operand.COL: TOKEN_SCALE,
              Operand.ELEMENT: TENSOR_SCALE}


def _mul_step(value: fx.Node, node: fx.Node, n: int) -> Step | None:
    other = _integer_product_scale(_other_arg(value, node), value, n)
    if isinstance(other, numbers.Real) and not isinstance(other, bool) and math.isfinite(other):
        return Step(SCALE, [node], scalar=float(other))
    kind = operand_kind(other, val(value), n)
    return Step(_MUL_STEPS[kind], [node], operand=other) if kind in _MUL_STEPS else None


def operand_kind(other: object, value: torch.Tensor | None, n: int | None) -> Operand | None:
    """How a float tensor ``other`` broadcasts against the [.., N] ``value``, in this order of preference:
    FULL (the value's exact shape), ROW (a length-N vector, any leading 1s), COL (one entry per row,
    [.., 1]), ELEMENT (a single element); None for anything else."""
    t = val(other) if isinstance(other, fx.Node) else None
    if t is None or value is None or t.dtype not in SUPPORTED_DTYPES.values():
        return None
    if same_shape(t.shape, value.shape):
        return Operand.FULL
    if n is None or t.dim() > value.dim():
        return None
    ones = all(statically_known_true(d == 1) for d in t.shape[:-1])
    if t.dim() >= 1 and statically_known_true(t.shape[-1] == n) and ones:
        return Operand.ROW
    if t.dim() == value.dim() and same_shape(t.shape[:-1], value.shape[:-1]) and statically_known_true(t.shape[-1] == 1):
        return Operand.COL
    if all(statically_known_true(d == 1) for d in t.shape):
        return Operand.ELEMENT
    return None


def _reshape_step(node: fx.Node, n: int) -> Step | None:
    out = val(node)
    if out is None or out.dim() < 2 or not statically_known_true(out.shape[-1] == n):
        return None
    return Step(RESHAPE, [node], transparent=True)

