"""Rewrite: decide where each matched site runs and replace the fused ones by one op call."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_leaves

from .. import dispatch
from ..epilogue import format_steps
from ..ops import OP_NAMESPACE
from ..patterns import val
from ..report import site_id
from .context import GemmSite, PassContext

aten = torch.ops.aten
FUSED_OP = getattr(torch.ops, OP_NAMESPACE).gemm_epilogue.default


def run(ctx: PassContext) -> None:
    # A site may read what an earlier site's rewrite replaced: the down projection's x is the gate site's
    # product, its residual the attention block's residual sum. ``replace_all_uses_with`` moves the
    # graph's users, not the nodes a matched site holds, so each site's inputs go through this map.
    replaced: dict[fx.Node, fx.Node] = {}
    for site in ctx.sites:
        if site.rule is None:
            continue
        site.runs_on, site.reason = placement(site, ctx)
        if site.runs_on == "inductor":
            continue
        try:
            _replace(ctx.graph, site, ctx.options.config_dir, site_id(ctx.report.graph, site.anchor.name), replaced)
        except Exception as e:  # leave the site to Inductor: nodes inserted before the failure are dead
            site.runs_on, site.reason = "inductor", f"rewrite failed ({type(e).__name__}: {e})"
            site.fused = None


def placement(site: GemmSite, ctx: PassContext) -> tuple[str, str | None]:
    """``(runs_on, why)``: helion on CUDA for small M, the reference where asked, else Inductor.

    Sets ``site.helion_limit``, the largest M that runs Helion at this shape.
    """
    site.helion_limit, lowered_by = dispatch.helion_size_limit(
        site.k, site.n, site.dtype, site.device, ctx.options.max_helion_size, ctx.options.config_dir,
        site.rule.kernel,
    )
    bound = lowered_by or f"max_helion_size={site.helion_limit}"
    if site.device.type == "cuda":
        if site.static_m is not None and site.static_m > site.helion_limit:
            return "inductor", f"M={site.static_m} > {bound}: cuBLAS + Inductor's epilogue"
        problem = dispatch.helion_unavailable_reason()
        if problem:
            return "reference", problem
        if site.static_m is None:
            return "helion", f"M is dynamic: Helion when M <= {site.helion_limit} at run time, cuBLAS above"
        return "helion", None
    if ctx.options.rewrite_on_cpu:
        return "reference", f"no Helion kernel on {site.device.type}: rewrite_on_cpu runs the reference"
    return "inductor", (
        f"{site.device.type} graph: left to Inductor (option rewrite_on_cpu rewrites it to the reference)"
    )


def _replace(graph: fx.Graph, site: GemmSite, config_dir: str, name: str, replaced: dict[fx.Node, fx.Node]) -> None:
    steps = site.steps
    out_val = val(site.output)
    norm = site.rms_norm
    if norm is not None and norm.view is not None:  # the norm's 3-D input, seen as the GEMM saw its output
        with graph.inserting_before(site.output):
            x = _call(graph, aten.view.default, (replaced.get(norm.x, norm.x), norm.view.args[1]))
    else:
        x = site.x
    args = fx.node.map_arg((
        x,
        site.weight,
        site.weight_layout,
        site.weight_scale,
        site.up_weight,
        site.up_layout,
        format_steps([s.name for s in site.prologue]),
        site.quant_program.to_json() if site.quant_program is not None else "",
        [s.operand for s in steps if s.operand is not None],
        [s.scalar for s in steps if s.scalar is not None],
        format_steps([s.name for s in steps]),
        out_val.dtype,
        site.rule.kernel,
        site.helion_limit,
        config_dir,
        name,
        norm.weight if norm is not None else None,
        norm.spec.to_json() if norm is not None else "",
    ), lambda node: replaced.get(node, node))
    with graph.inserting_before(site.output):
        fused = _call(graph, FUSED_OP, args)
        result = fused
        reshapes = [s for s in site.chain if s.name == "reshape"]
        if reshapes:  # a 3-D F.linear: view the [M, N] result back to the shape users expect
            result = _call(graph, aten.view.default, (fused, reshapes[-1].out.args[1]))
    site.output.replace_all_uses_with(result)
    replaced[site.output] = result
    site.fused = fused


def _call(graph: fx.Graph, target, args: tuple) -> fx.Node:
    node = graph.call_function(target, args)
    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    with detect_fake_mode(tree_leaves(vals)):
        node.meta["val"] = target(*vals)
    return node
