"""Siblings: a gated MLP's gate and up projections, ``act(x @ w_gate) * (x @ w_up)``, become one site.

A site whose epilogue starts with an activation and then multiplies by another plain GEMM of the same
activation (same K, N and dtype, whose result nothing else reads) tries the rules again with that
multiply as ``up_mul``. If a rule of a gated family takes it, the up projection's site is absorbed: one
kernel computes both accumulators, reading x once, and stores only the product. Otherwise both sites
stay as match left them. The weights are read where they are: nothing is concatenated, so the fusion
stays correct when the parameters change.

An RMSNorm fused into the gate's site stays its prologue where the gated rule takes one: the pairing
compares the nodes the two GEMMs read (the norm's result, not the prologue's input), so the up
projection reads the same normalized activation and the kernel normalizes x once for both.

Quantized gate and up projections (fp8 ``_scaled_mm``, int8 ``_int_mm`` on rows quantized before them,
the default) pair the same way, each first rescaled by its own steps: the gate's epilogue starts with its
token and channel scales (and casts), and the up projection's scales become the site's ``up_steps``,
applied to the second accumulator before the product (families ``gemm_glu_fp8``, ``gemm_glu_int8``).
They pair only on the same quantized rows under the same token scale (each linear quantizes its input
itself: equal quantizations of one activation count as the same rows, see
:func:`~helion_backend.quant_patterns.quantized_rows`); where a pair is refused for a reason worth
knowing (another token scale, another reader of the up projection, other dtypes), the gate's site
notes it.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..patterns import RESHAPES, activation_identity, collective_between
from ..quant_patterns import quantized_rows, rows_without_scale
from ..vocabulary import ACTIVATIONS, GLU_FAMILIES, QUANT_DTYPES, RMSNORM, SUPPORTED_DTYPES, dtype_name
from .context import GemmSite, PassContext, Step, token_scale, with_token_scale
from .match import choose_rule, collective_note, follow_chain

aten = torch.ops.aten
# A quantized projection's own steps before what the rest of the graph reads of it: its rescaling and casts.
_OWN_STEPS = frozenset({"cast", "token_scale", "channel_scale", "tensor_scale"})
_QUANTIZED_ANCHORS = (aten._scaled_mm.default, aten._int_mm.default)

# A GEMM's result as the rest of the graph reads it -> (the site, its own steps up to that node).
Results = dict[fx.Node, tuple[GemmSite, list[Step]]]


def run(ctx: PassContext) -> None:
    if not any(r.kernel in GLU_FAMILIES for r in ctx.rules):
        return
    plain: Results = {}
    for site in ctx.sites:
        if _is_plain(site):
            plain.update((node, (site, own)) for node, own in _results(site).items())
    for site in list(ctx.sites):
        if site in ctx.sites and site.rule is not None and _pairable(site):
            _try_gated(site, plain, ctx)


def _try_gated(site: GemmSite, plain: Results, ctx: PassContext) -> None:
    matched = _snapshot(site)
    # The whole chain, not the prefix the chosen rule kept, and the norm if match dropped it.
    follow_chain(site, ctx.options.fuse_activation_quant)
    site.notes = list(matched["notes"])  # follow_chain's notes repeat match's
    steps = [(i, s) for i, s in enumerate(site.chain) if not s.transparent]
    found = _up_projection(site, steps, plain)
    if isinstance(found, tuple):
        i, up, own = found
        mul = site.chain[i]
        site.chain = [*site.chain[:i], Step("up_mul", mul.nodes), *site.chain[i + 1:]]
        site.up_weight, site.up_layout, site.up_steps = up.weight, up.weight_layout, own
        site.up_anchor = up.anchor
        choose_rule(site, ctx.rules)  # drops the norm, with a note, where the gated rule takes no prologue
        if site.rule is not None and site.rule.kernel in GLU_FAMILIES:
            ctx.sites.remove(up)
            site.notes.append(f"the up projection {up.anchor.name} runs in the same kernel (x read once)")
            return
    vars(site).update(matched)
    if isinstance(found, str):
        site.notes.append(f"gate and up projections not fused: {found}")


def _snapshot(site: GemmSite) -> dict[str, object]:
    """The site's fields, to put back when the attempt fails; lists are copied (passes append to them)."""
    return {name: list(value) if isinstance(value, list) else value for name, value in vars(site).items()}


def _up_projection(site: GemmSite, steps: list[tuple[int, Step]],
                   plain: Results) -> tuple[int, GemmSite, list[Step]] | str | None:
    """``(chain index of the multiply, the up site, its own steps)`` when the site's epilogue multiplies its
    activated value by a gated MLP's up projection: a plain GEMM of the very activation the site's GEMM
    reads (with an RMSNorm, the norm's result). A string says why a plain GEMM it multiplies by is refused;
    None: the epilogue is no gated product."""
    i = _gated_mul(site, [s for _, s in steps])
    if i is None:
        return None
    index, mul = steps[i]
    if mul.operand not in plain:
        return None
    up, own = plain[mul.operand]
    if up is site:
        return None
    if len(mul.operand.users) != 1:
        readers = ", ".join(u.name for u in mul.operand.users if u is not mul.out)
        return f"the up projection {up.anchor.name}'s result is also read by {readers}"
    if (up.k, up.n, up.device) != (site.k, site.n, site.device):
        return None
    if up.dtype != site.dtype:
        return f"the up projection {up.anchor.name} multiplies {dtype_name(up.dtype)}, the gate {dtype_name(site.dtype)}"
    collective = collective_between(up.anchor, mul.out)
    if collective is not None:
        return f"{collective_note(collective)} and the up projection {up.anchor.name}"
    if _quantized(site):
        return _same_quantized_rows(site, index, up, own)
    if not activation_identity(_gemm_input(up)) == activation_identity(_gemm_input(site)):
        return None
    return index, up, own


def _same_quantized_rows(site: GemmSite, index: int, up: GemmSite,
                         own: list[Step]) -> tuple[int, GemmSite, list[Step]] | str | None:
    """The pairing of quantized projections that multiply the same rows under the same token scale
    (:func:`~helion_backend.quant_patterns.quantized_rows`), the up projection then rescaled by the gate's
    token scale (the kernel reads the gate's rows, and the up's quantization is left dead)."""
    gate_scale, up_scale = token_scale(site.steps), token_scale(own)
    if gate_scale is None or up_scale is None:
        return "a projection without a token scale"
    gate_rows, up_rows = quantized_rows(site.x, gate_scale), quantized_rows(up.x, up_scale)
    if gate_rows != up_rows:
        if rows_without_scale(gate_rows) is not None and rows_without_scale(gate_rows) == rows_without_scale(up_rows):
            return (f"the up projection {up.anchor.name} rescales the same rows by another token scale "
                    f"({up_scale.name}, the gate {gate_scale.name})")
        return None
    return index, up, with_token_scale(own, gate_scale)


def _gated_mul(site: GemmSite, steps: list[Step]) -> int | None:
    """The index in ``steps`` of the multiply of a gated product, ``own* activation mul`` (a quantized site's
    own steps are its rescaling and casts, and casts may come between the activation and the multiply)."""
    own = _OWN_STEPS if _quantized(site) else frozenset()
    i = 0
    while i < len(steps) and steps[i].name in own:
        i += 1
    if i >= len(steps) or steps[i].name not in ACTIVATIONS:
        return None
    i += 1
    while i < len(steps) and own and steps[i].name == "cast":
        i += 1
    return i if i < len(steps) and steps[i].name == "mul" else None


def _quantized(site: GemmSite) -> bool:
    """An fp8/int8 GEMM on rows quantized before it (no prologue: the default ``fuse_activation_quant=False``)."""
    return site.dtype in QUANT_DTYPES.values() and site.anchor.target in _QUANTIZED_ANCHORS and not site.prologue


def _pairable(site: GemmSite) -> bool:
    """A float GEMM whose prologue, if any, is an RMSNorm (which the gated kernel runs too), or a quantized one
    on rows quantized before it."""
    return _quantized(site) or (site.dtype in SUPPORTED_DTYPES.values()
                                and all(step.name == RMSNORM for step in site.prologue))


def _gemm_input(site: GemmSite) -> fx.Node:
    """The activation the GEMM multiplies (with a fused prologue, ``site.x`` is the prologue's input), before
    any zero padding (Inductor's pad_mm)."""
    return site.gemm_input


def _is_plain(site: GemmSite) -> bool:
    """A GEMM with nothing of its own around it but, on quantized rows, its rescaling: no bias, no prologue
    but an RMSNorm (float), one reader."""
    if _quantized(site):
        return all(s.transparent or s.name in _OWN_STEPS for s in site.leading_steps)
    return (_pairable(site) and all(s.transparent for s in site.leading_steps)
            and site.anchor.target is aten.mm.default and len(site.anchor.users) == 1)


def _results(site: GemmSite) -> dict[fx.Node, list[Step]]:
    """What the rest of the graph may read of a plain GEMM, with the site's own steps up to it: the mm (or the
    slice that drops its padded rows), or its 3-D view for a 3-D linear; for quantized rows, also each node
    of its rescaling and casts (each but the last read only by the next)."""
    if not _quantized(site):
        node = site.leading_steps[-1].out if site.leading_steps else site.anchor
        users = list(node.users)
        return {users[0] if len(users) == 1 and users[0].target in RESHAPES else node: []}
    results: dict[fx.Node, list[Step]] = {site.anchor: []}
    own: list[Step] = []
    previous = site.anchor
    for step in site.chain:
        if not step.transparent and step.name not in _OWN_STEPS:
            break
        if step.out is not previous and len(previous.users) != 1:
            break
        if not step.transparent:
            own.append(step)
        results[step.out], previous = list(own), step.out
    return results
