"""The fused GEMM + epilogue custom ops that the rewrite inserts.

One functional op for every site, and one for sites that share a launch: Inductor treats each as an
extern call, so whatever runs inside (a Helion kernel on CUDA, the reference composite elsewhere) is
chosen by :mod:`.dispatch`. The
rewrite runs on the post-grad graph, after AOTAutograd has split forward and backward, so the op
never needs a derivative formula (an eager call under autograd is refused by PyTorch, as for any
custom op without one).
"""

from __future__ import annotations

import torch

from helion_backend.runtime import dispatch
from helion_backend.semantics.gemm_spec import GemmSpec
from helion_backend.vocabulary import OP_NAMESPACE


@torch.library.custom_op(f"{OP_NAMESPACE}::gemm_epilogue", mutates_args=())
def gemm_epilogue(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    operands: list[torch.Tensor],
    norm_weight: torch.Tensor | None,
    spec: str,
) -> torch.Tensor:
    """``epilogue(prologue(x) @ prologue(weight))`` stored once in the spec's ``out_dtype``; x is [M, K], the
    result [M, N]. ``spec`` is a :class:`~helion_backend.semantics.gemm_spec.GemmSpec` key: the weight's layout, the prologue and
    epilogue steps, the scalars, the kernel family and the rows it runs, the site's name.

    ``weight_scale`` is what a weight dequantization reads besides the weight (``dequant_int4``: the
    [N, K/G] group scales, with ``weight`` the packed uint8 [N, K/2] bytes; ``dequant_fp8_block``: the
    fp32 [N/128, K/128] block scales of the fp8 [N, K] ``weight``); None elsewhere. ``up_weight`` is a
    gated MLP's up projection of the same x, which the epilogue's ``up_mul`` step multiplies in; None
    elsewhere. ``operands`` are the epilogue's tensor operands in order, then the up projection's own.
    With an ``rmsnorm`` prologue, x is the norm's input and ``norm_weight`` its [K] weight.
    """
    return dispatch.run_gemm_epilogue(GemmSpec.from_key(spec), x, weight, weight_scale, up_weight, operands,
                                      norm_weight)


@gemm_epilogue.register_fake
def _(x, weight, weight_scale, up_weight, operands, norm_weight, spec):
    parsed = GemmSpec.from_key(spec)
    return x.new_empty((x.shape[0], output_width(weight, parsed.weight_layouts[0])), dtype=parsed.out_dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::multi_gemm_epilogue", mutates_args=())
def multi_gemm_epilogue(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    operands: list[torch.Tensor],
    norm_weight: torch.Tensor | None,
    spec: str,
) -> list[torch.Tensor]:
    """``[epilogue_i(x @ weights[i])]``: GEMMs of one activation (a decoder's q, k and v), one launch.

    ``spec`` (a :class:`~helion_backend.semantics.gemm_spec.GemmSpec` key) holds each weight's layout and each output's epilogue;
    ``operands`` are every output's in turn. With ``norm_weight`` x is an RMSNorm's input and every GEMM
    multiplies the normalized rows. The spec's kernel is the shared launch's family (``gemm_multi``;
    ``gemm_multi_fp8`` and ``gemm_multi_int8`` multiply quantized rows, each output rescaled by its epilogue).
    """
    return dispatch.run_multi_gemm_epilogue(GemmSpec.from_key(spec), x, weights, operands, norm_weight)


@multi_gemm_epilogue.register_fake
def _(x, weights, operands, norm_weight, spec):
    parsed = GemmSpec.from_key(spec)
    return [x.new_empty((x.shape[0], output_width(w, layout)), dtype=parsed.out_dtype)
            for w, layout in zip(weights, parsed.weight_layouts)]


def output_width(weight: torch.Tensor, layout: str) -> int:
    """N of a weight stored in ``layout`` ("nk": an nn.Linear [N, K] weight; "kn": [K, N])."""
    return weight.shape[0] if layout == "nk" else weight.shape[1]


@torch.library.custom_op(f"{OP_NAMESPACE}::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    masked_bias: float,
    out_stride: list[int],
    site: str,
) -> torch.Tensor:
    """``scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)`` for a
    few query rows per head ([B, H, R, D] over a [B, H_kv, L, D] cache, H_kv dividing H): the Helion decode
    kernel on CUDA, SDPA elsewhere.
    ``mask`` is None, boolean (True attends; the other positions add ``masked_bias`` to their logits, -inf
    in SDPA's own conversion, cuDNN's finite -65504 where the graph had it) or an additive float bias
    broadcasting to [B, H, R, L]. The result has the strides ``out_stride`` of the node it replaces (the
    graph's views of it were traced with them). ``site`` names the node in the report, for the warning if
    the kernel fails."""
    return dispatch.run_decode_attention(query, key, value, mask, scale, masked_bias, out_stride, site)


@decode_attention.register_fake
def _(query, key, value, mask, scale, masked_bias, out_stride, site):
    return query.new_empty_strided(query.shape, out_stride)
