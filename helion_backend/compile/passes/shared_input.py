"""Shared input: GEMM sites that read the same activation (a decoder's q, k and v) share one launch.

At decode sizes each of these GEMMs streams its weight in a few microseconds, and the small ones (k and
v) cannot fill the GPU alone; one launch over all their output tiles reads x once per tile and pays one
ramp-up. Sites of one kernel family that read the same activation group in graph order, up to
:data:`~helion_backend.vocabulary.MULTI_GEMM_SLOTS` per launch; each keeps its own epilogue:

- float sites of the default family: the same node, the same shape of view of one node, or the same
  fused RMSNorm of one input (family ``gemm_multi``);
- fp8 and int8 sites on rows quantized before the GEMM (Inductor's per-token quantization, the default):
  the same quantized rows under the same token scale, each output with its own weight and channel scale
  (``gemm_multi_fp8``, ``gemm_multi_int8``). Each quantized linear quantizes its input itself, so rows
  count as the same when the same ops quantize the same activation
  (:func:`~helion_backend.compile.recognize.quant_patterns.quantized_rows`); the launch then reads the first site's rows and
  token scale, and the others' quantizations are left dead. Rows that are one node under different
  token scales stay apart, with a note.

A group is placed as a whole, with its family's limit at the sum of its widths: if that sends it to
Inductor, its sites keep their own placements. A group whose operands are computed after one of its
sites' results is not formed (the one op could not be placed before every reader).
"""

from __future__ import annotations

import torch.fx as fx

from helion_backend.compile import placing
from helion_backend.compile.context import GemmSite, PassContext, SiteGroup, token_scale, with_token_scale
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.recognize.patterns import activation_identity, collective_between, val
from helion_backend.compile.recognize.quant_patterns import quantized_rows, rows_without_scale
from helion_backend.compile.selection import collective_note
from helion_backend.options import BackendOptions
from helion_backend.vocabulary import MULTI_GEMM_FAMILIES, MULTI_GEMM_SLOTS, QUANT_DTYPES, RMSNORM


class SharedInputPass(GraphPass):
    name = "shared_input"

    def enabled(self, options: BackendOptions) -> bool:
        return options.merge_siblings

    def run(self, ctx: PassContext) -> None:
        by_activation: dict[tuple, list[GemmSite]] = {}
        for site in ctx.sites:
            if _eligible(site):
                by_activation.setdefault(_activation_key(site), []).append(site)
        if not any(len(sites) > 1 for sites in by_activation.values()):
            return
        _note_other_token_scales(by_activation)
        position = {node: i for i, node in enumerate(ctx.graph.nodes)}
        for sites in by_activation.values():
            sites.sort(key=lambda s: position[s.anchor])
            for start in range(0, len(sites) - 1, MULTI_GEMM_SLOTS):
                chunk = sites[start:start + MULTI_GEMM_SLOTS]
                if len(chunk) > 1:
                    _group(chunk, ctx, position)


def _eligible(site: GemmSite) -> bool:
    """A site of a family with a shared launch: a float one whose prologue, if any, is an RMSNorm, or an fp8/int8
    one without a prologue (it reads quantized rows and rescales them by a token scale of its epilogue)."""
    if site.rule is None or site.rule.kernel not in MULTI_GEMM_FAMILIES:
        return False
    if site.dtype in QUANT_DTYPES.values():
        return not site.prologue and token_scale(site.steps) is not None
    return all(step.name == RMSNORM for step in site.prologue)


def _activation_key(site: GemmSite) -> tuple:
    """What the GEMM multiplies, identified so that sites of one activation (and output dtype) share it; for
    quantized rows, also the family and the token scale that undoes their quantization."""
    out_dtype = val(site.output).dtype
    norm = site.rms_norm
    if norm is not None:
        view = None if norm.view is None else activation_identity(norm.view)
        return (RMSNORM, norm.x, norm.weight, norm.spec, view, out_dtype)
    if site.dtype in QUANT_DTYPES.values():
        return (out_dtype, site.rule.kernel, *quantized_rows(site.x, token_scale(site.steps)))
    return (*activation_identity(site.x), out_dtype)


def _note_other_token_scales(by_activation: dict[tuple, list[GemmSite]]) -> None:
    """Quantized rows that groups of sites multiply under different token scales: a note on each such site."""
    by_rows: dict[tuple, list[tuple]] = {}
    for key, sites in by_activation.items():
        rows = rows_without_scale(key[2:]) if sites[0].dtype in QUANT_DTYPES.values() else None
        if rows is not None:  # keys are (out dtype, family, *rows)
            by_rows.setdefault((*key[:2], *rows), []).append(key)
    for keys in by_rows.values():
        if len(keys) < 2:
            continue
        for key in keys:
            others = [s.anchor.name for other in keys if other != key for s in by_activation[other]]
            for site in by_activation[key]:
                site.notes.append(f"not in one launch with {', '.join(others)}: the same quantized rows under "
                                  f"another token scale ({token_scale(site.steps).name} here)")


def _group(sites: list[GemmSite], ctx: PassContext, position: dict[fx.Node, int]) -> None:
    leader = sites[0]
    family = MULTI_GEMM_FAMILIES[leader.rule.kernel]
    chains = [site.chain for site in sites]
    if leader.dtype in QUANT_DTYPES.values():
        _read_the_leaders_rows(sites)
    late = _operand_after_a_result(sites, position)
    if late is None:
        late = _collective_among(sites)
    placed = placing.place(leader, ctx, family, sum(s.n for s in sites)) if late is None else None
    if placed is None or placed.runs_on == "inductor":
        why = late if placed is None else placed.why
        for site, chain in zip(sites, chains):
            site.chain = chain
            site.notes.append(f"not in one launch with {_names(sites, site)}: {why}")
        if placed is not None and placed.untuned:
            ctx.untuned_groups.append(SiteGroup(sites, family))
        return
    group = SiteGroup(sites, family)
    what = "the same quantized rows and token scale" if leader.dtype in QUANT_DTYPES.values() else "the same activation"
    for site in sites:
        site.group, site.runs_on, site.reason, site.max_helion_m = group, placed.runs_on, placed.why, placed.max_helion_m
        site.evidence, site.untuned = placed.evidence, placed.untuned
        site.notes.append(f"one launch ({family}) with {_names(sites, site)}: {what}")


def _read_the_leaders_rows(sites: list[GemmSite]) -> None:
    """Every output rescaled by the first site's token scale (the op reads its rows): the keys proved the
    rows and scales equal, and the other sites' quantizations then have no reader left."""
    scale = token_scale(sites[0].steps)
    for site in sites[1:]:
        site.chain = with_token_scale(site.chain, scale)


def _operand_after_a_result(sites: list[GemmSite], position: dict[fx.Node, int]) -> str | None:
    """Why the group's op cannot come before the first of its sites' results (it replaces them all, so it must
    come before each) where the graph computes one of its inputs after that result, else None."""
    first_result = min(position[s.output] for s in sites)
    inputs = [sites[0].x] + [s.weight for s in sites]  # the op reads the first site's x (the others' are views of it)
    inputs += [step.operand for s in sites for step in s.steps if step.operand is not None]
    inputs += [s.rms_norm.weight for s in sites if s.rms_norm is not None]
    late = [node for node in inputs if position[node] >= first_result]
    return f"{late[0].name} is computed after one of their results" if late else None


def _collective_among(sites: list[GemmSite]) -> str | None:
    """Why the sites cannot share one op where a collective runs among their GEMMs, epilogues and prologues
    (the op would move some of them past it), else None."""
    nodes = [node for s in sites for node in (s.anchor, s.output, *(n for step in s.prologue for n in step.nodes))]
    collective = collective_between(*nodes)
    return f"{collective_note(collective)} and some of them" if collective is not None else None


def _names(sites: list[GemmSite], site: GemmSite) -> str:
    return ", ".join(s.anchor.name for s in sites if s is not site)
