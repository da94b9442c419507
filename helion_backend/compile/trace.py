"""The sites the backend would find in a function, without compiling it: for tests and tuning tools.

The function is traced with fake tensors and Inductor's decompositions, which gives the graph the
post-grad pass sees up to Inductor's own pattern passes; normalize and match then describe its GEMMs.
No rule is chosen and nothing is rewritten.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from helion_backend.compile import selection
from helion_backend.compile.context import GemmSite, PassContext
from helion_backend.compile.passes.normalize import NormalizePass
from helion_backend.options import BackendOptions


def trace_sites(fn: Callable[..., Any], *args: Any,
                fuse_activation_quant: bool = BackendOptions.fuse_activation_quant) -> list[GemmSite]:
    """The GEMM sites of ``fn(*args)`` with their operands, epilogue chains and prologues, as a compile with
    the option ``fuse_activation_quant`` (by default, the backend's default) finds them."""
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    _one_node_per_constant(gm.graph)
    ctx = PassContext(graph=gm.graph, options=None, rules=[], report=None)
    NormalizePass().run(ctx)
    for site in ctx.sites:
        selection.follow_chain(site, fuse_activation_quant)
    return ctx.sites


def _one_node_per_constant(graph: fx.Graph) -> None:
    """Read each tensor the traced code closes over (a module's buffers and parameters) through one node.

    make_fx gives every read of such a tensor a ``get_attr`` node of its own, where the graph the post-grad
    pass sees has one placeholder per tensor; the patterns compare nodes, so two reads of one tensor (int4's
    ``p & 15`` and ``p >> 4`` of the same packed bytes) would look like two tensors.
    """
    first: dict[str, fx.Node] = {}
    for node in list(graph.find_nodes(op="get_attr")):
        kept = first.setdefault(node.target, node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
