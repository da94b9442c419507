"""Legality: shrink each matched site to a prefix that can be fused without changing the program.

A site may swallow a node only if nothing outside the site reads it: an intermediate with another
user ends the site there (that node becomes the fused op's output, and its other users read it). An
operand computed from the site's own GEMM would make the fused op depend on itself; the
reachability check on the graph (networkx) stops the site before such a step. After shrinking, the
rules are consulted again, since a shorter epilogue may fit another rule, or none.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
import torch.fx as fx

from helion_backend.compile.context import GemmSite, PassContext
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.recognize.patterns import val
from helion_backend.compile.recognize.step import Step
from helion_backend.compile.selection import choose_rule
from helion_backend.vocabulary import SUPPORTED_DTYPES


class LegalityPass(GraphPass):
    name = "legality"

    def run(self, ctx: PassContext) -> None:
        matched = [s for s in ctx.sites if s.rule is not None]
        if not matched:
            return
        dataflow = _dataflow_graph(ctx.graph)
        claimed: set[fx.Node] = set()  # nodes an earlier site swallows (a + b of two GEMMs, say)
        claimed_outputs: set[fx.Node] = set()  # of those, the ones the fused op will produce
        kept: list[GemmSite] = []  # the sites so far that stay matched, in order
        for site in matched:
            if site.prologue and site.x in claimed and site.x not in claimed_outputs:
                if _end_earlier_site_at_prologue_input(site, kept, ctx):
                    claimed, claimed_outputs = _claims(kept)
                else:
                    _drop_prologue_inside_earlier_site(site, ctx)
                if site.rule is None:
                    continue
            legal, why = _legal_prefix(site, nx.descendants(dataflow, site.anchor), claimed)
            if len(legal) < len(site.chain):
                site.notes.append(why)
                site.chain = legal
                choose_rule(site, ctx.rules)
            if site.rule is not None:
                _check_types(site)
            if site.rule is not None:
                kept.append(site)
                claimed.update(node for step in site.chain for node in step.nodes)
                claimed_outputs.add(site.output)


def _claims(sites: list[GemmSite]) -> tuple[set[fx.Node], set[fx.Node]]:
    """The nodes ``sites`` swallow, and of those the ones their fused ops produce."""
    return ({node for site in sites for step in site.chain for node in step.nodes}, {site.output for site in sites})


def _end_earlier_site_at_prologue_input(site: GemmSite, kept: list[GemmSite], ctx: PassContext) -> bool:
    """The prologue reads a value inside an earlier site's epilogue whose remaining steps only feed that
    prologue (the last layer's residual sum, which the earlier site took on into the final norm's float
    cast): end the earlier site at the value, so its fused op produces it and the prologue (cast
    included) reads it. Nothing is computed twice and nothing leaves the fused kernels. False where the
    steps after the value compute something else, or no rule takes the shorter epilogue whole: the caller
    then drops the prologue."""
    owner = next((s for s in kept if any(site.x is step.out for step in s.chain)), None)
    if owner is None:
        return False
    cut = next(i for i, step in enumerate(owner.chain) if step.out is site.x) + 1
    prologue_nodes = {node for step in site.prologue for node in step.nodes}
    rest = owner.chain[cut:]
    if not all(set(step.nodes) <= prologue_nodes for step in rest):
        return False
    shorter = dataclasses.replace(owner, chain=owner.chain[:cut], notes=list(owner.notes))
    choose_rule(shorter, ctx.rules)
    if shorter.rule is None or shorter.output is not site.x or shorter.prologue != owner.prologue:
        return False  # no rule takes the whole shorter epilogue: the earlier site stays as it was
    names = ", ".join(step.name for step in rest)
    shorter.notes.append(f"epilogue stops at {site.x.name}: the {', '.join(s.name for s in site.prologue)} "
                         f"prologue of the next site reads it and takes {names} itself")
    for field in ("chain", "rule", "reason", "objections", "notes"):
        setattr(owner, field, getattr(shorter, field))
    return True


def _drop_prologue_inside_earlier_site(site: GemmSite, ctx: PassContext) -> None:
    """The prologue reads a value inside an earlier site's epilogue (a residual sum whose float cast the
    site before took as its last step, say): the fused op would keep that value, and the GEMM under
    it, alive. The site reads the prologue's result instead."""
    names = ", ".join(step.name for step in site.prologue)
    site.notes.append(f"prologue {names} not fused: its input {site.x.name} is inside an earlier site's epilogue")
    site.drop_prologue()
    choose_rule(site, ctx.rules)


def _dataflow_graph(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        g.add_edges_from((node, user) for user in node.users)
    return g


def _legal_prefix(
    site: GemmSite, downstream: set[fx.Node], claimed: set[fx.Node]
) -> tuple[list[Step], str]:
    legal: list[Step] = []
    previous = site.anchor
    for step in site.chain:
        inside = set(step.nodes)
        if inside & claimed:
            return legal, f"epilogue stops before {step.out.name}: an earlier GEMM's site fuses it"
        if step.operand is not None and step.operand in downstream:
            return legal, (
                f"epilogue stops before {step.out.name}: its operand {step.operand.name} is computed "
                "from the GEMM itself (fusing would create a cycle)"
            )
        if step.out is not previous:  # addmm's own bias step spans the anchor itself
            outside = [u.name for u in previous.users if u not in inside]
            if outside:
                return legal, f"epilogue stops at {previous.name}: it is also read by {', '.join(outside)}"
        legal.append(step)
        previous = step.out
    return legal, ""


def _check_types(site: GemmSite) -> None:
    out = val(site.output)
    if out is None or out.dtype not in SUPPORTED_DTYPES.values():
        site.rule = None
        site.reason = f"output dtype {getattr(out, 'dtype', None)} is not a supported float dtype"
