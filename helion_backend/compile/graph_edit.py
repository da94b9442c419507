"""Graph edits the rewriting passes share: a call of one of the backend's custom ops, inserted with its fake
value and the trace of the node whose work it takes over.

The ops are named through their namespace, never imported: the run time registers them
(:mod:`helion_backend.runtime.ops`, imported by the backend before any compile).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves

from helion_backend.compile.provenance import keep_origin
from helion_backend.vocabulary import OP_NAMESPACE


def fused_op(name: str) -> torch._ops.OpOverload:
    """The backend's custom op ``name`` (its default overload)."""
    return getattr(getattr(torch.ops, OP_NAMESPACE), name).default


def insert_call(graph: fx.Graph, target, args: tuple, *, origin: fx.Node | None = None) -> fx.Node:
    """A call of ``target`` at the graph's insertion point, with its fake value in ``meta["val"]`` and, given
    the node whose work it takes over (``origin``), that node's trace of the model."""
    node = graph.call_function(target, args)
    if origin is not None:
        keep_origin(node, origin)
    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    with detect_fake_mode(tree_leaves(vals)):
        node.meta["val"] = target(*vals)
    return node
