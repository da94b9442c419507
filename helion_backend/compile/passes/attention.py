"""Decode attention: find the graph's ``scaled_dot_product_attention`` nodes and decide where each runs.

A node with at most ``decode_attention_max_rows`` query rows per head (a decode step) runs the Helion
decode kernel (:mod:`helion_backend.kernels.attention`) on CUDA; longer queries (prefill), training
graphs (which read the log-sum-exp), dropout, ``is_causal`` and dynamic shapes keep the kernel PyTorch
chose, with the reason in the report. A boolean mask that the graph turned into an additive bias
(``where(mask, 0, fill)``: ``-inf``, or cuDNN's finite -65504 rounded to the bias dtype) is read as the
boolean and its fill, so that the bias is never materialized, and
keys and values repeated for every query head of their group (``repeat_kv``: unsqueeze, expand, clone,
reshape) are read before the repeat: the kernel takes a key/value head's query heads as its rows.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from helion_backend import environment
from helion_backend.compile.context import AttentionSite, PassContext
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.recognize.patterns import val
from helion_backend.vocabulary import ATTENTION_DTYPES, ATTENTION_MAX_HEAD_DIM, SDPA_OPS, dtype_name

aten = torch.ops.aten


class AttentionPass(GraphPass):
    name = "attention"

    def run(self, ctx: PassContext) -> None:
        for node in ctx.graph.nodes:
            if node.op == "call_function" and node.target in SDPA_OPS:
                arguments = _arguments(node)
                site = _site(node, arguments)
                if site is not None:
                    site.runs_on, site.reason = _place(site, arguments, ctx)
                    ctx.attention.append(site)


def _site(node: fx.Node, arguments: dict[str, Any]) -> AttentionSite | None:
    """The node as a site; None when no value reads its output 0 (nothing to replace)."""
    outputs = [user for user in node.users if user.target is operator.getitem and user.args[1] == 0]
    q, k, v = (val(node.args[i]) for i in range(3))
    if len(outputs) != 1 or q is None or k is None or v is None:
        return None
    key, value = node.args[1], node.args[2]
    unrepeated = _unrepeated(key), _unrepeated(value)
    if None not in unrepeated and val(unrepeated[0]).shape == val(unrepeated[1]).shape:
        key, value = unrepeated
        k = val(key)
    mask, kind, masked_bias = _mask(arguments.get(SDPA_OPS[node.target]), q.dtype)
    scale, head_dim = arguments.get("scale"), q.shape[-1]
    if scale is None:  # SDPA's default; a symbolic head dimension is refused by _unsupported
        scale = 1.0 / math.sqrt(head_dim) if isinstance(head_dim, int) else math.nan
    return AttentionSite(
        node=node, output=outputs[0], query=node.args[0], key=key, value=value, mask=mask,
        mask_kind=kind, masked_bias=masked_bias, scale=float(scale),
        shape=(*q.shape[:2], k.shape[1], q.shape[2], k.shape[2], q.shape[3]) if q.ndim == 4 and k.ndim == 4
        else tuple(q.shape),
        dtype=q.dtype,
    )


def _arguments(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    values: dict[str, Any] = {}
    for i, argument in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            values[argument.name] = node.args[i]
        elif argument.name in node.kwargs:
            values[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            values[argument.name] = argument.default_value
    return values


def _unrepeated(kv: fx.Node) -> fx.Node | None:
    """The [B, H_kv, L, D] tensor that ``kv`` repeats for each query head of its group, as ``repeat_kv``
    writes it (``x[:, :, None].expand(B, H_kv, G, L, D).reshape(B, H_kv * G, L, D)``), else None."""
    if not (isinstance(kv, fx.Node) and kv.target in (aten.reshape.default, aten.view.default,
                                                       aten._unsafe_view.default)):
        return None
    node = kv.args[0]
    if isinstance(node, fx.Node) and node.target is aten.clone.default:
        node = node.args[0]
    unsqueeze = node.args[0] if isinstance(node, fx.Node) and node.target is aten.expand.default else None
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target is aten.unsqueeze.default and unsqueeze.args[1] == 2):
        return None
    source = unsqueeze.args[0]
    if val(source) is None or val(source).ndim != 4:
        return None
    b, h_kv, length, d = val(source).shape
    groups = node.args[1][2]
    if list(node.args[1]) != [b, h_kv, groups, length, d] or list(kv.args[1]) != [b, h_kv * groups, length, d]:
        return None
    return source


def _mask(mask: object, dtype: torch.dtype) -> tuple[fx.Node | None, str, float]:
    """The mask to pass the kernel, its kind, and the bias a masked position gets: a boolean mask that the
    graph turned into a bias (``where(keep, 0, fill)`` or ``where(~keep, fill, 0)``, seen through an
    expand) as the boolean ``keep`` and ``fill``, any other tensor as an additive bias."""
    if not isinstance(mask, fx.Node):
        return None, "none", -math.inf
    found = _boolean_source(mask.args[0] if mask.target is aten.expand.default else mask, dtype)
    return (found[0], "bool", found[1]) if found is not None else (mask, "bias", -math.inf)


def _boolean_source(bias: fx.Node, dtype: torch.dtype) -> tuple[fx.Node, float] | None:
    """``(keep, fill)`` where ``bias`` is 0 at ``keep`` and the constant ``fill`` elsewhere, else None. A finite
    fill (cuDNN's -65504, rounded to the bias dtype) is kept exactly, as the bias value the kernel adds; only
    a bias in the query's dtype is read so, since the kernel adds the fill in that dtype's rounding."""
    if bias.target is not aten.where.self or val(bias) is None:
        return None
    condition, if_true, if_false = bias.args
    if _constant(if_true) == 0.0 and (fill := _constant(if_false)) is not None:
        keep = condition
    elif (_constant(if_false) == 0.0 and (fill := _constant(if_true)) is not None and isinstance(condition, fx.Node)
          and condition.target in (aten.logical_not.default, aten.bitwise_not.default)):
        keep = condition.args[0]
    else:
        return None
    if not (isinstance(keep, fx.Node) and val(keep) is not None and val(keep).dtype == torch.bool):
        return None
    rounded = torch.tensor(fill, dtype=torch.float64).to(val(bias).dtype).item()
    if math.isinf(rounded) and rounded < 0:
        return keep, -math.inf
    return (keep, rounded) if val(bias).dtype == dtype and math.isfinite(rounded) else None


def _constant(node: object) -> float | None:
    """The value everywhere, as the graph spells where's constants: ``full(shape, value)`` (a scalar, or the
    zeros a ``masked_fill`` starts from: the mask's checked shape covers theirs), ``scalar_tensor(value)`` or
    the number itself, rounded to the constant's own dtype; else None."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node)
    if not isinstance(node, fx.Node) or node.target not in (aten.full.default, aten.scalar_tensor.default):
        return None
    value = node.args[1] if node.target is aten.full.default else node.args[0]
    if not isinstance(value, (int, float)) or val(node) is None:
        return None
    return torch.tensor(value, dtype=torch.float64).to(val(node).dtype).item()


def _place(site: AttentionSite, arguments: dict[str, Any], ctx: PassContext) -> tuple[str, str | None]:
    """``(runs_on, why)``: the decode kernel on CUDA where it computes the node exactly, the reference on a
    CPU graph with ``rewrite_on_cpu``, else the kernel PyTorch chose."""
    problem = _unsupported(site, arguments, ctx.options.decode_attention_max_rows)
    if problem:
        return "inductor", problem
    device = val(site.query).device
    if device.type == "cuda":
        unavailable = environment.helion_unavailable_reason()
        return ("reference", unavailable) if unavailable else ("helion", None)
    if ctx.options.rewrite_on_cpu:
        return "reference", f"no Helion kernel on {device.type}: rewrite_on_cpu runs the reference"
    return "inductor", f"{device.type} graph: left to Inductor (option rewrite_on_cpu rewrites it to the reference)"


def _unsupported(site: AttentionSite, arguments: dict[str, Any], max_rows: int) -> str | None:
    """Why the decode kernel should not run this node, if it should not."""
    q, k, v = val(site.query), val(site.key), val(site.value)
    users = site.node.users
    readers = sorted({user.args[1] for user in users if user.target is operator.getitem} - {0})
    if readers or any(user.target is not operator.getitem for user in users):
        return f"outputs {readers} (the log-sum-exp, a training graph's) are read: the decode kernel has none"
    if arguments.get("dropout_p", 0.0) != 0.0:
        return "dropout"
    if arguments.get("is_causal", False):
        return "is_causal=True (the decode kernel reads an explicit mask)"
    if not (q.ndim == k.ndim == v.ndim == 4):
        return f"{q.ndim}-D query (the decode kernel takes [B, H, rows, D])"
    if not all(isinstance(d, int) for t in (q, k, v) for d in t.shape):
        return "dynamic shapes (the decode kernel is compiled for static ones)"
    batch, heads, rows, head_dim = q.shape
    if k.shape[0] != batch or heads % k.shape[1] or k.shape[3] != head_dim or v.shape != k.shape:
        return (f"key {tuple(k.shape)} and value {tuple(v.shape)} do not match query {tuple(q.shape)} (equal "
                "shapes, with key/value heads dividing the query heads)")
    if q.dtype not in ATTENTION_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {dtype_name(q.dtype)}, {dtype_name(k.dtype)}, {dtype_name(v.dtype)}"
    if head_dim > ATTENTION_MAX_HEAD_DIM:
        return f"head dimension {head_dim} > {ATTENTION_MAX_HEAD_DIM}"
    if site.mask is not None and not _broadcasts(val(site.mask), (batch, heads, rows, k.shape[2])):
        return f"mask {tuple(val(site.mask).shape)} does not broadcast to {(batch, heads, rows, k.shape[2])}"
    if rows > max_rows:
        return f"rows={rows} > decode_attention_max_rows={max_rows}: a prefill, PyTorch's kernel is tiled for it"
    if k.shape[2] == 1:
        return "L=1: one key per head, nothing to split (and Helion's tiling of a one-position cache is wrong)"
    return None


def _broadcasts(mask: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    if mask is None or mask.ndim > len(shape):
        return False
    return all(m in (1, s) for m, s in zip(reversed(mask.shape), reversed(shape)))
