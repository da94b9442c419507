"""Normalize: find every GEMM and describe it in one canonical form.

``mm(x, w)``, ``mm(x, permute(w, [1, 0]))`` (nn.Linear's weight), ``addmm(b, x, ...)`` and the 2-D view
that ``F.linear`` puts in front of a 3-D activation all become a :class:`GemmSite` with the activation,
the weight as stored plus its layout, and, for addmm, its bias as a leading epilogue step. The graph
is not changed: a site that is not fused keeps its original form, which Inductor knows best.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..patterns import operand_kind, val
from ..vocabulary import ANCHOR_OPS, SUPPORTED_DTYPES, Anchor, Operand
from .context import GemmSite, PassContext, Step

aten = torch.ops.aten

_TRANSPOSES = {aten.permute.default, aten.t.default}
# GEMMs that exist in graphs but that no rule can anchor on yet: reported, never rewritten.
_OTHER_GEMMS = {aten.bmm.default, aten.baddbmm.default, aten._scaled_mm.default, aten._int_mm.default}
_OP_NAMES = {op: name for name, op in ANCHOR_OPS.items()}


def run(ctx: PassContext) -> None:
    for node in ctx.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _OP_NAMES:
            site_or_reason = _describe(node)
            if isinstance(site_or_reason, GemmSite):
                ctx.sites.append(site_or_reason)
            else:
                ctx.unanchored.append((node, site_or_reason))
        elif node.target in _OTHER_GEMMS:
            ctx.unanchored.append((node, f"{node.target} has no rule anchor in this version"))


def _describe(node: fx.Node) -> GemmSite | str:
    is_addmm = node.target is ANCHOR_OPS[Anchor.ADDMM.value]
    x, rhs = node.args[1:3] if is_addmm else node.args[:2]
    x_val, rhs_val, out_val = val(x), val(rhs), val(node)
    if x_val is None or rhs_val is None or out_val is None:
        return "operands carry no shape metadata"
    weight, layout = _see_through_transpose(rhs)
    m, k = x_val.shape
    n = rhs_val.shape[1]
    if not isinstance(k, int) or not isinstance(n, int):
        return f"K={k} or N={n} is dynamic; the kernels need static weight shapes"
    if x_val.dtype != rhs_val.dtype or x_val.dtype not in SUPPORTED_DTYPES.values():
        return f"input dtypes {x_val.dtype}/{rhs_val.dtype} are not one supported float dtype"
    forms = {Anchor.ADDMM.value if is_addmm else Anchor.MM.value}
    if layout == "nk":
        forms.add(Anchor.LINEAR.value)
    site = GemmSite(
        anchor=node, forms=frozenset(forms), x=x, weight=weight, weight_layout=layout,
        m=m, k=k, n=n, dtype=x_val.dtype, device=x_val.device,
    )
    if is_addmm:
        leading = _addmm_input_step(node, out_val, n)
        if isinstance(leading, str):
            return leading
        site.leading_steps = [leading]
    return site


def _see_through_transpose(rhs: fx.Node) -> tuple[fx.Node, str]:
    """An [N, K] weight transposed by a view: pass the stored tensor and say so (no copy is made)."""
    if rhs.op == "call_function" and rhs.target in _TRANSPOSES:
        source = rhs.args[0]
        dims = rhs.args[1] if rhs.target is aten.permute.default else [1, 0]
        source_val = val(source)
        if source_val is not None and source_val.dim() == 2 and list(dims) == [1, 0]:
            return source, "nk"
    return rhs, "kn"


def _addmm_input_step(node: fx.Node, out_val: torch.Tensor, n: int) -> Step | str:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "addmm with beta or alpha other than 1"
    bias = node.args[0]
    kind = operand_kind(bias, out_val, n)
    if kind is Operand.ROW:
        return Step("bias", [node], operand=bias)
    if kind is Operand.FULL:
        return Step("residual", [node], operand=bias)
    return f"addmm input of shape {tuple(val(bias).shape) if val(bias) is not None else '?'} is neither [N] nor [M, N]"
