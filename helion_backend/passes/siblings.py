"""Siblings: a gated MLP's gate and up projections, ``act(x @ w_gate) * (x @ w_up)``, become one site.

A site whose epilogue starts with an activation and then multiplies by another plain GEMM of the same
activation (same K, N and dtype, whose result nothing else reads) tries the rules again with that
multiply as ``up_mul``. If a rule of the ``gemm_glu`` family takes it, the up projection's site is
absorbed: one kernel computes both accumulators, reading x once, and stores only the product.
Otherwise both sites stay as match left them. The weights are read where they are: nothing is
concatenated, so the fusion stays correct when the parameters change.

An RMSNorm fused into the gate's site stays its prologue where the gated rule takes one: the pairing
compares the nodes the two GEMMs read (the norm's result, not the prologue's input), so the up
projection reads the same normalized activation and the kernel normalizes x once for both.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..patterns import RESHAPES, activation_identity
from ..vocabulary import ACTIVATIONS, GLU_FAMILY, RMSNORM, SUPPORTED_DTYPES
from .context import GemmSite, PassContext, Step
from .match import choose_rule, follow_chain

aten = torch.ops.aten


def run(ctx: PassContext) -> None:
    if not any(r.kernel == GLU_FAMILY for r in ctx.rules):
        return
    plain = {_result(site): site for site in ctx.sites if _is_plain(site)}
    for site in list(ctx.sites):
        if site in ctx.sites and site.rule is not None and _is_float(site):
            _try_gated(site, plain, ctx)


def _try_gated(site: GemmSite, plain: dict[fx.Node, GemmSite], ctx: PassContext) -> None:
    matched = _snapshot(site)
    # The whole chain, not the prefix the chosen rule kept, and the norm if match dropped it.
    follow_chain(site, ctx.options.fuse_activation_quant)
    site.notes = list(matched["notes"])  # follow_chain's notes repeat match's
    steps = [(i, s) for i, s in enumerate(site.chain) if not s.transparent]
    up = _up_projection(site, steps, plain)
    if up is not None:
        i, mul = steps[1]
        site.chain = [*site.chain[:i], Step("up_mul", mul.nodes), *site.chain[i + 1:]]
        site.up_weight, site.up_layout = up.weight, up.weight_layout
        choose_rule(site, ctx.rules)  # drops the norm, with a note, where the gated rule takes no prologue
        if site.rule is not None and site.rule.kernel == GLU_FAMILY:
            ctx.sites.remove(up)
            site.notes.append(f"the up projection {up.anchor.name} runs in the same kernel (x read once)")
            return
    vars(site).update(matched)


def _snapshot(site: GemmSite) -> dict[str, object]:
    """The site's fields, to put back when the attempt fails; lists are copied (passes append to them)."""
    return {name: list(value) if isinstance(value, list) else value for name, value in vars(site).items()}


def _up_projection(site: GemmSite, steps: list[tuple[int, Step]], plain: dict[fx.Node, GemmSite]) -> GemmSite | None:
    """The plain GEMM site that the site's second step multiplies by, when it is a gated MLP's up: it reads
    the very activation the site's GEMM reads (with an RMSNorm, the norm's result)."""
    if len(steps) < 2 or steps[0][1].name not in ACTIVATIONS or steps[1][1].name != "mul":
        return None
    mul = steps[1][1]
    up = plain.get(mul.operand)
    if up is None or up is site or len(mul.operand.users) != 1:
        return None
    same_shape = (up.k, up.n, up.dtype, up.device) == (site.k, site.n, site.dtype, site.device)
    if not same_shape or not activation_identity(_gemm_input(up)) == activation_identity(_gemm_input(site)):
        return None
    return up


def _is_float(site: GemmSite) -> bool:
    """A float GEMM whose prologue, if any, is an RMSNorm (which the gated kernel runs too)."""
    return (site.dtype in SUPPORTED_DTYPES.values()
            and all(step.name == RMSNORM for step in site.prologue))


def _gemm_input(site: GemmSite) -> fx.Node:
    """The activation the GEMM node itself reads (with a fused prologue, ``site.x`` is the prologue's input);
    for rows padded by Inductor's pad_mm, the rows before the padding."""
    x = site.anchor.args[1] if site.anchor.target is aten.addmm.default else site.anchor.args[0]
    return x.args[0] if any(step.name == "unpad" for step in site.leading_steps) else x


def _is_plain(site: GemmSite) -> bool:
    """A float GEMM with nothing of its own around it: no addmm bias (row padding aside), no prologue but an
    RMSNorm, one reader."""
    return (_is_float(site) and all(s.transparent for s in site.leading_steps)
            and site.anchor.target is aten.mm.default and len(site.anchor.users) == 1)


def _result(site: GemmSite) -> fx.Node:
    """What the rest of the graph reads of a plain GEMM: the mm (or the slice that drops its padded
    rows), or its 3-D view for a 3-D linear."""
    node = site.leading_steps[-1].out if site.leading_steps else site.anchor
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target in RESHAPES else node


