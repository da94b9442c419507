"""Normalize: find every GEMM and describe it in one canonical form.

``mm(x, w)``, ``mm(x, permute(w, [1, 0]))`` (nn.Linear's weight), ``addmm(b, x, ...)``,
``_scaled_mm(xq, wq, scale_a, scale_b, bias)`` and ``_int_mm(xq, wq)``, and the 2-D view that
``F.linear`` puts in front of a 3-D activation, all become a :class:`GemmSite` with the activation, the
weight as stored plus its layout, and what the anchor itself applies after the multiply (addmm's
bias; _scaled_mm's scales and bias) as leading epilogue steps. An int8 weight converted to the
activation's dtype on its way in is a ``dequant_int8`` prologue, a packed int4 weight unpacked and
scaled per group a ``dequant_int4`` one (``dequant_int4_zp`` with zero points); a float GEMM of two
block-fp8 dequantizations (DeepSeek-V3, written by hand) takes both, as ``quant_fp8_per_group`` and
``dequant_fp8_block``, and so does a ``_scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales.
The graph is not changed: a site that is not fused keeps its original form, which Inductor knows best.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from helion_backend.compile.context import GemmSite, PassContext
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.recognize.patterns import operand_kind, same_shape, val
from helion_backend.compile.recognize.quant_patterns import (
    BlockFp8Operands,
    Int4WeightDequant,
    block_fp8_operands,
    block_scaled_mm_operands,
    int4_weight_dequant,
)
from helion_backend.compile.recognize.step import Step
from helion_backend.vocabulary import (
    ANCHOR_OPS,
    BIAS,
    CHANNEL_SCALE,
    DEQUANT_FP8_BLOCK,
    DEQUANT_INT4,
    DEQUANT_INT4_ZP,
    DEQUANT_INT8,
    FP8_BLOCK,
    QUANT_FP8_PER_GROUP,
    RESIDUAL,
    SUPPORTED_DTYPES,
    TENSOR_SCALE,
    TOKEN_SCALE,
    UNPAD,
    Anchor,
    Operand,
)

aten = torch.ops.aten
prims = torch.ops.prims

_TRANSPOSES = {aten.permute.default, aten.t.default}
# GEMMs that exist in graphs but that no rule can anchor on yet: reported with why, never rewritten. Ops that
# only newer torch versions have are looked up by name.
_NO_ANCHOR = "{op} has no rule anchor in this version"
_GROUPED = ("{op}: a grouped GEMM (one [groups, K, N] weight, rows split by offsets; mixture-of-experts layers "
            "run their experts so under torch.compile), and no kernel family multiplies groups")
_OTHER_GEMMS = {
    "bmm": _NO_ANCHOR,
    "baddbmm": _NO_ANCHOR,
    "_scaled_mm_v2": _NO_ANCHOR,  # torch.nn.functional.scaled_mm: scaling recipes as arguments
    "_grouped_mm": _GROUPED,
    "_scaled_grouped_mm": _GROUPED,
}
_OTHER_GEMM_REASONS = {getattr(aten, name).default: reason.format(op=f"aten.{name}.default")
                       for name, reason in _OTHER_GEMMS.items() if hasattr(aten, name)}
# GEMMs on a weight packed for one library kernel (torchao's int4 weight-only layers call them): reported with
# why they stay as they are, never rewritten.
_PACKED_WEIGHT_GEMMS = {
    "_weight_int4pack_mm": "tinygemm's int4 GEMM (CUDA) on a weight in its tile-packed layout (torchao's "
                           "Int4WeightOnlyConfig(int4_packing_format='tile_packed_to_4d'))",
    "_weight_int4pack_mm_for_cpu": "the CPU int4 GEMM on a weight in its opaque packed layout (torchao's "
                                   "Int4OpaqueTensor)",
    "_weight_int4pack_mm_with_scales_and_zeros": "the XPU int4 GEMM on a weight in its packed layout (torchao's "
                                                 "Int4PlainInt32Tensor)",
}
_PACKED_WEIGHT_REASON = ("{what}: one opaque op whose weight only that kernel can read, and no kernel family reads "
                         "that layout; the gemm_int4 family reads plain packed bytes dequantized in the graph "
                         "(helion_backend.quantize.Int4WeightOnlyLinear's form)")
_PACKED_WEIGHT_OPS = {getattr(aten, name).default: _PACKED_WEIGHT_REASON.format(what=what)
                      for name, what in _PACKED_WEIGHT_GEMMS.items() if hasattr(aten, name)}
# Every GEMM op that is reported unfused whatever the rules say, with its reason.
_UNANCHORED_GEMMS = {**_OTHER_GEMM_REASONS, **_PACKED_WEIGHT_OPS}
_OP_NAMES = {op: name for name, op in ANCHOR_OPS.items()}
# What each anchor multiplies, by input dtype.
_INPUT_DTYPES = {
    Anchor.MM: tuple(SUPPORTED_DTYPES.values()),
    Anchor.ADDMM: tuple(SUPPORTED_DTYPES.values()),
    Anchor.SCALED_MM: (torch.float8_e4m3fn,),
    Anchor.INT_MM: (torch.int8,),
}


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
        elif node.target in _UNANCHORED_GEMMS:
            ctx.unanchored.append((node, _UNANCHORED_GEMMS[node.target]))


def _describe(node: fx.Node) -> GemmSite | str:
    anchor = Anchor(_OP_NAMES[node.target])
    x, rhs = node.args[1:3] if anchor is Anchor.ADDMM else node.args[:2]
    addmm_input = node.args[0] if anchor is Anchor.ADDMM else None
    unpadded = _seen_through_padding(node, x, rhs, addmm_input) if anchor is not Anchor.SCALED_MM else None
    if unpadded is not None:
        x, rhs, addmm_input = unpadded.x, unpadded.rhs, unpadded.addmm_input
    x_val, rhs_val, out_val = val(x), val(rhs), val(node)
    if x_val is None or rhs_val is None or out_val is None:
        return "operands carry no shape metadata"
    weight, layout = _see_through_transpose(rhs)
    m, k = x_val.shape
    n = rhs_val.shape[1]
    if not isinstance(k, int) or not isinstance(n, int):
        return f"K={k} or N={n} is dynamic; the kernels need static weight shapes"
    if x_val.dtype != rhs_val.dtype or x_val.dtype not in _INPUT_DTYPES[anchor]:
        return f"input dtypes {x_val.dtype}/{rhs_val.dtype} are not one of {_INPUT_DTYPES[anchor]}"
    forms = {anchor.value}
    if layout == "nk" and anchor in (Anchor.MM, Anchor.ADDMM):
        forms.add(Anchor.LINEAR.value)
    site = GemmSite(
        anchor=node, forms=frozenset(forms), x=x, weight=weight, weight_layout=layout,
        m=m, k=k, n=n, dtype=x_val.dtype, device=x_val.device, gemm_input=x,
    )
    slices = unpadded.slices if unpadded is not None else []
    leading = _leading_steps(site, val(slices[-1]) if slices else out_val, addmm_input)
    if isinstance(leading, str):
        return leading
    site.leading_steps = leading + ([Step(UNPAD, slices, transparent=True)] if slices else [])
    _fuse_weight_dequant(site)
    _fuse_int4_dequant(site)
    _fuse_block_fp8(site)
    return site


def _leading_steps(site: GemmSite, out_val: torch.Tensor, addmm_input: fx.Node | None) -> list[Step] | str:
    if Anchor.ADDMM.value in site.forms:
        step = _addmm_input_step(site.anchor, addmm_input, out_val, site.n)
        return step if isinstance(step, str) else [step]
    if Anchor.SCALED_MM.value in site.forms:
        return _scaled_mm_steps(site, out_val)
    return []


@dataclass(frozen=True)
class _Unpadded:
    """A GEMM's operands before their zero padding, and the slices that cut its product back."""

    x: fx.Node
    rhs: fx.Node
    addmm_input: fx.Node | None
    slices: list[fx.Node]  # in graph order, the last one the unpadded [M, N] product (none: only K was padded)


def _seen_through_padding(node: fx.Node, x: fx.Node, rhs: fx.Node, addmm_input: fx.Node | None) -> _Unpadded | None:
    """The GEMM on unpadded operands, when ``node`` multiplies zero-padded ones and slices the product back.

    On CUDA, Inductor's ``pad_mm`` pads an unaligned M, K or N (``constant_pad_nd`` of both operands, the
    addmm input padded by ``cat`` with zeros) and slices the rows and columns it added off the product;
    ``_int_mm`` callers pad M past 16 for cuBLAS. Zero rows and columns add nothing to the real outputs, so the
    site multiplies the unpadded operands: M, K and N are the model's, and a Helion kernel copies nothing.
    """
    x_source, (pad_m, pad_k) = _without_zero_padding(x)
    rhs_source, (rhs_pad_k, pad_n) = _without_zero_padding(rhs)
    if pad_k != rhs_pad_k or not (pad_m or pad_k or pad_n) or val(x_source).ndim != 2 or val(rhs_source).ndim != 2:
        return None
    kept = ({0: val(x_source).shape[0]} if pad_m else {}) | ({1: val(rhs_source).shape[1]} if pad_n else {})
    slices = _slices_back(node, kept)
    if slices is None:
        return None
    if addmm_input is not None:
        input_source, input_pads = _without_zero_padding(addmm_input)
        if input_pads != _padding_of_addmm_input(val(addmm_input), pad_m, pad_n):
            return None
        addmm_input = input_source
    return _Unpadded(x_source, rhs_source, addmm_input, slices)


def _without_zero_padding(node: fx.Node) -> tuple[fx.Node, tuple[int, ...]]:
    """The tensor that ``node`` appends zeros to (through ``constant_pad_nd`` with zero left pads and
    ``cat([t, zeros], dim)``, any number of them), and how many entries each dim gained."""
    node_val = val(node)
    if node_val is None:
        return node, ()
    pads = [0] * node_val.ndim
    source = node
    while (step := _zero_padding_step(source, node_val.ndim)) is not None:
        source, added = step
        pads = [p + a for p, a in zip(pads, added)]
    return source, tuple(pads)


def _zero_padding_step(node: fx.Node, ndim: int) -> tuple[fx.Node, list[int]] | None:
    """``(source, entries added per dim)`` when ``node`` appends zeros to ``source`` once, else None."""
    target = getattr(node, "target", None)
    if target is aten.constant_pad_nd.default:
        pad, value = list(node.args[1]), node.args[2] if len(node.args) > 2 else 0
        if value != 0 or len(pad) > 2 * ndim or any(p != 0 for p in pad[0::2]) or any(p < 0 for p in pad[1::2]):
            return None
        added = [0] * ndim
        for i, right in enumerate(pad[1::2]):  # constant_pad_nd lists the last dim first
            added[ndim - 1 - i] = right
        return node.args[0], added
    if target is aten.cat.default:
        parts, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        zeros = parts[1] if len(parts) == 2 else None
        zeros_val = val(zeros) if isinstance(zeros, fx.Node) else None
        if zeros_val is None or zeros.target is not aten.full.default or zeros.args[1] != 0:
            return None
        added = [0] * ndim
        added[dim % ndim] = zeros_val.shape[dim % ndim]
        return parts[0], added
    return None


def _padding_of_addmm_input(input_val: torch.Tensor | None, pad_m: int, pad_n: int) -> tuple[int, ...] | None:
    """How pad_mm pads an addmm input for a product padded by ``pad_m`` rows and ``pad_n`` columns: a [N]
    bias along N, an [M, N] input along both, never a broadcast dim of size 1."""
    if input_val is None or input_val.ndim not in (1, 2):
        return None
    wanted = (pad_n,) if input_val.ndim == 1 else (pad_m, pad_n)
    return tuple(0 if size == 1 else pad for size, pad in zip(input_val.shape, wanted))


def _slices_back(node: fx.Node, kept: dict[int, int]) -> list[fx.Node] | None:
    """The chain of single-reader slices after ``node`` that keeps the first ``kept[dim]`` entries of each dim
    (``t[:-pad]`` as pad_mm writes it, ``t[:size]``, or an end clamped to the size), or None."""
    slices, current, wanted = [], node, dict(kept)
    while wanted:
        if len(current.users) != 1:
            return None
        (user,) = current.users
        dim = _kept_prefix_dim(user, wanted)
        if dim is None:
            return None
        del wanted[dim]
        slices.append(user)
        current = user
    return slices


def _kept_prefix_dim(slice_node: fx.Node, kept: dict[int, int]) -> int | None:
    """The dim of ``kept`` whose first ``kept[dim]`` entries ``slice_node`` keeps, if it is such a slice."""
    if slice_node.target is not aten.slice.Tensor:
        return None
    given = list(slice_node.args[1:])
    dim, start, end, step = given + [0, 0, None, 1][len(given):]  # aten.slice's defaults for what is left out
    padded = val(slice_node.args[0])
    if padded is None or padded.ndim != 2 or start != 0 or step != 1 or not isinstance(end, int):
        return None
    dim %= 2
    size = padded.shape[dim]
    if dim not in kept or not isinstance(size, int):
        return None
    return dim if min(end + size if end < 0 else end, size) == kept[dim] else None


def _scaled_mm_steps(site: GemmSite, out_val: torch.Tensor) -> list[Step] | str:
    """``_scaled_mm``'s own epilogue as steps: scale_a, scale_b, then the bias, all on the fp32 product.
    Block scales are no steps: they make the call block fp8, whose prologue applies them."""
    node = site.anchor
    scale_a, scale_b, bias, scale_result = (list(node.args[2:6]) + [None] * 4)[:4]
    bias = node.kwargs.get("bias", bias)
    if node.kwargs.get("scale_result", scale_result) is not None:
        return "_scaled_mm with scale_result (fp8 output) is not fused"
    steps = _scale_steps(node, scale_a, scale_b, out_val)
    if isinstance(steps, str):  # blockwise, then?
        found = block_scaled_mm_operands(site.x, scale_a, scale_b, site.weight, site.weight_layout, FP8_BLOCK)
        if found is None:
            return steps
        if isinstance(found, str):
            return f"_scaled_mm with {FP8_BLOCK} x {FP8_BLOCK} block scales is not fused: {found}"
        _fuse_block_scaled_mm(site, found)
        steps = []
    if bias is not None:
        if operand_kind(bias, out_val, site.n) is not Operand.ROW:
            return "_scaled_mm bias is not an [N] vector"
        steps.append(Step(BIAS, [node], operand=bias))
    return steps


def _scale_steps(node: fx.Node, scale_a: fx.Node, scale_b: fx.Node, out_val: torch.Tensor) -> list[Step] | str:
    steps = []
    for scale, what, per_row in ((scale_a, "scale_a", True), (scale_b, "scale_b", False)):
        name = _scale_step(scale, out_val, per_row)
        if name is None:
            shape = tuple(val(scale).shape) if val(scale) is not None else "?"
            return (f"_scaled_mm {what} of shape {shape} is not per-token, per-channel, per-tensor or "
                    f"1 x {FP8_BLOCK} / {FP8_BLOCK} x {FP8_BLOCK} blockwise")
        steps.append(Step(name, [node], operand=scale))
    return steps


def _fuse_block_scaled_mm(site: GemmSite, found: BlockFp8Operands) -> None:
    """A ``_scaled_mm`` with 1 x 128 activation and 128 x 128 weight scales (DeepSeek-V3 on torch >= 2.9) is
    the same block fp8 site as the hand-written form. Only its prologue applies the block scales, so
    the site may never run as a bare ``_scaled_mm``: without the prologue it stays unfused."""
    site.prologue_required = (f"_scaled_mm with {FP8_BLOCK} x {FP8_BLOCK} block scales fuses only with its "
                              "block fp8 prologue")
    _fuse_block_fp8_prologue(site, found)


def _scale_step(scale: fx.Node, out_val: torch.Tensor, per_row: bool) -> str | None:
    """Which step a _scaled_mm scale is, by its role (not by its shape alone: at M = 1 a [1, N] scale_b
    has the output's shape, and a [1, 1] scale_a is the per-token one)."""
    t = val(scale)
    if t is None or t.dtype != torch.float32:
        return None
    m, n = out_val.shape
    if per_row and t.dim() == 2 and same_shape(t.shape, (m, 1)):
        return TOKEN_SCALE
    if not per_row and t.dim() in (1, 2) and same_shape(t.shape[-1:], (n,)) and t.numel() == n:
        return CHANNEL_SCALE
    if all(statically_known_true(d == 1) for d in t.shape):
        return TENSOR_SCALE
    return None


def _fuse_weight_dequant(site: GemmSite) -> None:
    """An int8 weight converted to the activation's dtype: read the int8 tensor, convert in the kernel."""
    convert = site.weight
    if convert.target is not prims.convert_element_type.default:
        return
    source, inner_layout = _see_through_transpose(convert.args[0])  # convert(permute(w)) or convert(w)
    if inner_layout == "nk" and site.weight_layout == "nk":
        return  # transposed twice: not a form libraries write
    source_val = val(source)
    if source_val is None or source_val.dtype != torch.int8 or source_val.dim() != 2:
        return
    layout = "nk" if "nk" in (inner_layout, site.weight_layout) else "kn"
    site.fuse_prologue(Step(DEQUANT_INT8, [convert]), weight=source, weight_layout=layout)


def _fuse_int4_dequant(site: GemmSite) -> None:
    """An nn.Linear weight dequantized from packed int4 bytes and group scales (and zero points): the kernel
    reads those.

    A weight unpacked from bytes in any other way stays as the graph computes it, with a note saying
    what differs from the one format the kernel knows.
    """
    if site.prologue or site.weight_layout != "nk":
        return
    found = int4_weight_dequant(site.weight, site.dtype)
    if isinstance(found, Int4WeightDequant):
        step = DEQUANT_INT4_ZP if found.zero_points else DEQUANT_INT4
        site.fuse_prologue(Step(step, list(found.nodes)), weight=found.packed, weight_scale=found.scales)
    elif found is not None:
        site.notes.append(f"the weight is unpacked from uint8 bytes but not as packed int4 with group scales "
                          f"({DEQUANT_INT4} or {DEQUANT_INT4_ZP}): {found}; the GEMM reads the weight as the "
                          "graph computes it")


def _fuse_block_fp8(site: GemmSite) -> None:
    """A float GEMM of an activation and a weight both dequantized from block fp8 (the hand-written
    DeepSeek-V3 form): the kernel reads the float activation and the fp8 weight with its block scales,
    quantizes each 1 x 128 group itself and multiplies in fp8. Both prologues or neither."""
    if site.prologue or site.weight_layout != "nk":
        return
    found = block_fp8_operands(site.x, site.weight, site.dtype, FP8_BLOCK)
    if isinstance(found, BlockFp8Operands):
        _fuse_block_fp8_prologue(site, found)
    elif found is not None:
        site.notes.append(f"the operands are dequantized from fp8 but not as block fp8 ({FP8_BLOCK} x {FP8_BLOCK} "
                          f"weight blocks, 1 x {FP8_BLOCK} activation groups): {found}; the GEMM reads them as the "
                          "graph computes them")


def _fuse_block_fp8_prologue(site: GemmSite, found: BlockFp8Operands) -> None:
    """The kernel reads the float activation (the site's dtype from now on), and the fp8 weight with its scales."""
    site.fuse_prologue(Step(QUANT_FP8_PER_GROUP, list(found.activation_nodes)), x=found.x,
                       quant_program=found.program, dtype=val(found.x).dtype)
    site.fuse_prologue(Step(DEQUANT_FP8_BLOCK, list(found.weight_nodes)), weight=found.weight,
                       weight_scale=found.weight_scale, weight_scale_kn=found.weight_scale_kn)


def _see_through_transpose(rhs: fx.Node) -> tuple[fx.Node, str]:
    """An [N, K] weight transposed by a view: pass the stored tensor and say so (no copy is made)."""
    if rhs.op == "call_function" and rhs.target in _TRANSPOSES:
        source = rhs.args[0]
        dims = rhs.args[1] if rhs.target is aten.permute.default else [1, 0]
        source_val = val(source)
        if source_val is not None and source_val.dim() == 2 and list(dims) == [1, 0]:
            return source, "nk"
    return rhs, "kn"


def _addmm_input_step(node: fx.Node, bias: fx.Node, out_val: torch.Tensor, n: int) -> Step | str:
    """The step ``addmm``'s own input makes (``bias``: that input, before any row padding)."""
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return "addmm with beta or alpha other than 1"
    kind = operand_kind(bias, out_val, n)
    if kind is Operand.ROW:
        return Step(BIAS, [node], operand=bias)
    if kind is Operand.FULL:
        return Step(RESIDUAL, [node], operand=bias)
    return f"addmm input of shape {tuple(val(bias).shape) if val(bias) is not None else '?'} is neither [N] nor [M, N]"


class NormalizePass(GraphPass):
    """The pipeline's normalize stage: :func:`run`."""

    name = "normalize"

    def run(self, ctx: PassContext) -> None:
        run(ctx)
