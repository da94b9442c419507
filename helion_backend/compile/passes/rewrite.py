"""Rewrite: replace each site placed on Helion or the reference by one op call (one for a shared launch)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from helion_backend.compile.context import GemmSite, PassContext, SiteGroup
from helion_backend.compile.graph_edit import fused_op, insert_call
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.site_spec import spec_of
from helion_backend.semantics.gemm_spec import GemmSpec
from helion_backend.vocabulary import RESHAPE

if TYPE_CHECKING:
    from helion_backend.compile.recognize.norm_patterns import RmsNormMatch

aten = torch.ops.aten


class RewritePass(GraphPass):
    name = "rewrite"

    def run(self, ctx: PassContext) -> None:
        # A site may read what an earlier site's rewrite replaced: the down projection's x is the gate site's
        # product, its residual the attention block's residual sum. ``replace_all_uses_with`` moves the
        # graph's users, not the nodes a matched site holds, so each site's inputs go through this map.
        replaced: dict[fx.Node, fx.Node] = {}
        for site in ctx.sites:
            if site.rule is None or site.runs_on == "inductor":
                continue
            group = site.group
            if group is not None and site is not group.sites[0]:
                continue  # rewritten with the first of its group
            sites = group.sites if group is not None else [site]
            try:
                spec = spec_of(site, ctx.report.graph, ctx.options.config_dir,
                               frozen_weights=ctx.options.frozen_weights)
                if group is not None:
                    _replace_group(ctx.graph, group, spec, replaced)
                else:
                    _replace(ctx.graph, site, spec, replaced)
            except Exception as e:  # leave the sites to Inductor: nodes inserted before the failure are dead
                for s in sites:
                    s.runs_on, s.reason, s.fused = "inductor", f"rewrite failed ({type(e).__name__}: {e})", None


def _replace(graph: fx.Graph, site: GemmSite, spec: GemmSpec, replaced: dict[fx.Node, fx.Node]) -> None:
    with graph.inserting_before(site.output):
        x = _activation(graph, site, replaced)
        args = fx.node.map_arg((
            x,
            site.weight,
            _weight_scale(graph, site, replaced),
            site.up_weight,
            # The epilogue's operands, then the up projection's own steps' (a quantized gated MLP).
            [s.operand for s in [*site.steps, *site.up_steps] if s.operand is not None],
            _norm_weight(site.rms_norm),
            spec.to_key(),
        ), lambda node: replaced.get(node, node))
        fused = insert_call(graph, fused_op("gemm_epilogue"), args, origin=site.anchor)
        _take_output(graph, site, fused, replaced)


def _replace_group(graph: fx.Graph, group: SiteGroup, spec: GemmSpec, replaced: dict[fx.Node, fx.Node]) -> None:
    """One ``multi_gemm_epilogue`` before the first of the group's results (shared_input checked that
    every input comes earlier), and each result read from it."""
    sites, leader = group.sites, group.sites[0]
    first_result = next(node for node in graph.nodes if any(node is s.output for s in sites))
    with graph.inserting_before(first_result):
        x = _activation(graph, leader, replaced)
        args = fx.node.map_arg((
            x,
            [s.weight for s in sites],
            [step.operand for s in sites for step in s.steps if step.operand is not None],
            _norm_weight(leader.rms_norm),
            spec.to_key(),
        ), lambda node: replaced.get(node, node))
        fused = insert_call(graph, fused_op("multi_gemm_epilogue"), args, origin=leader.anchor)
        for i, site in enumerate(sites):
            _take_output(graph, site, insert_call(graph, operator.getitem, (fused, i), origin=site.anchor), replaced)


def _activation(graph: fx.Graph, site: GemmSite, replaced: dict[fx.Node, fx.Node]) -> fx.Node:
    """The op's x: the site's activation, or a fused norm's 3-D input seen as the GEMM saw it."""
    norm = site.rms_norm
    if norm is not None and norm.view is not None:
        return insert_call(graph, aten.view.default, (replaced.get(norm.x, norm.x), norm.view.args[1]),
                           origin=norm.view)
    return site.x


def _weight_scale(graph: fx.Graph, site: GemmSite, replaced: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """The op's weight scales: block scales stored [K/B, N/B] (as ``_scaled_mm`` reads them) go in as their
    [N/B, K/B] transpose, a view."""
    scale = site.weight_scale
    if scale is None or not site.weight_scale_kn:
        return scale
    return insert_call(graph, aten.permute.default, (replaced.get(scale, scale), [1, 0]), origin=site.anchor)


def _norm_weight(norm: RmsNormMatch | None) -> fx.Node | None:
    """The ops' ``norm_weight``: a fused RMSNorm's [K] weight (None without one)."""
    return norm.weight if norm is not None else None


def _take_output(graph: fx.Graph, site: GemmSite, result: fx.Node, replaced: dict[fx.Node, fx.Node]) -> None:
    """Make the graph read ``result`` (the site's [M, N] value) where it read the site's output."""
    site.fused = result
    reshapes = [s for s in site.chain if s.name == RESHAPE]
    if reshapes:  # a 3-D F.linear: view the [M, N] result back to the shape users expect
        result = insert_call(graph, aten.view.default, (result, reshapes[-1].out.args[1]), origin=reshapes[-1].out)
    site.output.replace_all_uses_with(result)
    replaced[site.output] = result
