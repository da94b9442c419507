"""Shared input: GEMM sites that read the same activation (a decoder's q, k and v) share one launch.

At decode sizes each of these GEMMs streams its weight in a few microseconds, and the small ones (k and
v) cannot fill the GPU alone; one launch over all their output tiles reads x once per tile and pays one
ramp-up. Sites of the default kernel family that read the same activation (the same node, the same
shape of view of one node, or the same fused RMSNorm of one input) group in graph order, up to
:data:`~helion_backend.vocabulary.MULTI_GEMM_SLOTS` per launch; each keeps its own epilogue. A group is
placed as a whole, with the ``gemm_multi`` family's limit at the sum of its widths: if that sends it to
Inductor, its sites keep their own placements. A group whose operands are computed after one of its
sites' results is not formed (the one op could not be placed before every reader).
"""

from __future__ import annotations

import torch.fx as fx

from ..patterns import activation_identity, val
from ..vocabulary import DEFAULT_KERNEL_FAMILY, MULTI_GEMM_FAMILY, MULTI_GEMM_SLOTS, RMSNORM
from .context import GemmSite, PassContext, SiteGroup
from .placement import place


def run(ctx: PassContext) -> None:
    if not ctx.options.merge_siblings:
        return
    by_activation: dict[tuple, list[GemmSite]] = {}
    for site in ctx.sites:
        if _eligible(site):
            by_activation.setdefault(_activation_key(site), []).append(site)
    if not any(len(sites) > 1 for sites in by_activation.values()):
        return
    position = {node: i for i, node in enumerate(ctx.graph.nodes)}
    for sites in by_activation.values():
        sites.sort(key=lambda s: position[s.anchor])
        for start in range(0, len(sites) - 1, MULTI_GEMM_SLOTS):
            chunk = sites[start:start + MULTI_GEMM_SLOTS]
            if len(chunk) > 1:
                _group(chunk, ctx, position)


def _eligible(site: GemmSite) -> bool:
    """A float site of the default family whose prologue, if any, is an RMSNorm."""
    return (site.rule is not None and site.rule.kernel == DEFAULT_KERNEL_FAMILY
            and all(step.name == RMSNORM for step in site.prologue))


def _activation_key(site: GemmSite) -> tuple:
    """What the GEMM multiplies, identified so that sites of one activation (and output dtype) share it."""
    out_dtype = val(site.output).dtype
    norm = site.rms_norm
    if norm is not None:
        view = None if norm.view is None else activation_identity(norm.view)
        return (RMSNORM, norm.x, norm.weight, norm.spec, view, out_dtype)
    return (*activation_identity(site.x), out_dtype)


def _group(sites: list[GemmSite], ctx: PassContext, position: dict[fx.Node, int]) -> None:
    leader = sites[0]
    late = _operand_after_a_result(sites, position)
    if late is not None:
        for site in sites:
            site.notes.append(f"not in one launch with {_names(sites, site)}: {late} is computed after one "
                              "of their results")
        return
    runs_on, reason, limit = place(leader, ctx, MULTI_GEMM_FAMILY, sum(s.n for s in sites))
    if runs_on == "inductor":
        for site in sites:
            site.notes.append(f"not in one launch with {_names(sites, site)}: {reason}")
        return
    group = SiteGroup(sites)
    for site in sites:
        site.group, site.runs_on, site.reason, site.helion_limit = group, runs_on, reason, limit
        site.notes.append(f"one launch ({MULTI_GEMM_FAMILY}) with {_names(sites, site)}: the same activation")


def _operand_after_a_result(sites: list[GemmSite], position: dict[fx.Node, int]) -> str | None:
    """The name of an input of the group's op that the graph computes after the first of its sites'
    results (the op replaces them all, so it must come before each), else None."""
    first_result = min(position[s.output] for s in sites)
    inputs = [sites[0].x] + [s.weight for s in sites]  # the op reads the first site's x (the others' are views of it)
    inputs += [step.operand for s in sites for step in s.steps if step.operand is not None]
    inputs += [s.rms_norm.weight for s in sites if s.rms_norm is not None]
    late = [node for node in inputs if position[node] >= first_result]
    return late[0].name if late else None


def _names(sites: list[GemmSite], site: GemmSite) -> str:
    return ", ".join(s.anchor.name for s in sites if s is not site)
