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
from helion_backend.vocabulary import MULTI_GEMM_FAMILY, OP_NAMESPACE


@torch.library.custom_op(f"{OP_NAMESPACE}::gemm_epilogue", mutates_args=())
def gemm_epilogue(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_layout: str,
    weight_scale: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_layout: str,
    prologue: str,
    quant_program: str,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: str,
    out_dtype: torch.dtype,
    kernel: str,
    max_helion_m: int,
    config_dir: str,
    site: str,
    norm_weight: torch.Tensor | None = None,
    norm_spec: str = "",
    up_epilogue: str = "",
) -> torch.Tensor:
    """``epilogue(prologue(x) @ prologue(weight))`` stored once in ``out_dtype``; x is [M, K], the result [M, N].

    ``weight_layout`` is "kn" for a [K, N] weight and "nk" for an nn.Linear [N, K] weight.
    ``weight_scale`` is what a weight dequantization reads besides the weight (``dequant_int4``: the
    [N, K/G] group scales, with ``weight`` the packed uint8 [N, K/2] bytes; ``dequant_fp8_block``: the
    fp32 [N/128, K/128] block scales of the fp8 [N, K] ``weight``); None elsewhere.
    ``up_weight`` (layout ``up_layout``) is a gated MLP's up projection of the same x, which the
    epilogue's ``up_mul`` step multiplies in, after its own steps ``up_epilogue`` (comma-joined, reading
    ``operands`` and ``scalars`` after the epilogue's: an fp8/int8 up projection's token and channel
    scales; "" for none); None elsewhere.
    ``prologue`` is a comma-joined list of prologue steps (see :mod:`.vocabulary`); an activation
    quantization carries its ops as ``quant_program`` (JSON, see :mod:`.quant_program`), else "".
    ``epilogue`` is a comma-joined step list (see :mod:`.epilogue`) reading ``operands`` and
    ``scalars`` in order. ``kernel`` names the kernel family; rows up to ``max_helion_m`` run it,
    with configs from ``config_dir`` (user-tuned; "" for none) before the shipped ones. ``site`` names
    the site in the report (``graph:anchor``), for the warning if its kernel fails.
    With an ``rmsnorm`` prologue, x is the norm's input, ``norm_weight`` its [K] weight and ``norm_spec``
    its eps and rounding (JSON, see :mod:`.norm`); the GEMM multiplies the normalized rows.
    """
    return dispatch.run_gemm_epilogue(
        x, weight, weight_layout, weight_scale, up_weight, up_layout, prologue, quant_program, operands, scalars,
        epilogue, out_dtype, kernel, max_helion_m, config_dir, site, norm_weight, norm_spec, up_epilogue,
    )


@gemm_epilogue.register_fake
def _(x, weight, weight_layout, weight_scale, up_weight, up_layout, prologue, quant_program, operands, scalars,
      epilogue, out_dtype, kernel, max_helion_m, config_dir, site, norm_weight=None, norm_spec="", up_epilogue=""):
    n = weight.shape[0] if weight_layout == "nk" else weight.shape[1]
    return x.new_empty((x.shape[0], n), dtype=out_dtype)


@torch.library.custom_op(f"{OP_NAMESPACE}::multi_gemm_epilogue", mutates_args=())
def multi_gemm_epilogue(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    weight_layouts: str,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogues: str,
    out_dtype: torch.dtype,
    max_helion_m: int,
    config_dir: str,
    site: str,
    norm_weight: torch.Tensor | None = None,
    norm_spec: str = "",
    kernel: str = MULTI_GEMM_FAMILY,
) -> list[torch.Tensor]:
    """``[epilogue_i(x @ weights[i])]``: GEMMs of one activation (a decoder's q, k and v), one launch.

    ``weight_layouts`` holds each weight's layout ("kn" or "nk"), comma-joined; ``epilogues`` each
    output's epilogue steps, joined by :data:`~helion_backend.semantics.epilogue.OUTPUT_SEPARATOR`; ``operands``
    and ``scalars`` every output's in turn. With ``norm_weight`` and ``norm_spec`` (as in
    :func:`gemm_epilogue`) x is an RMSNorm's input and every GEMM multiplies the normalized rows.
    ``kernel`` is the shared launch's family (``gemm_multi``; ``gemm_multi_fp8`` and ``gemm_multi_int8``
    multiply quantized rows, each output rescaled by its epilogue). The other arguments are
    :func:`gemm_epilogue`'s.
    """
    return dispatch.run_multi_gemm_epilogue(
        x, weights, weight_layouts, operands, scalars, epilogues, out_dtype, max_helion_m, config_dir, site,
        norm_weight, norm_spec, kernel,
    )


@multi_gemm_epilogue.register_fake
def _(x, weights, weight_layouts, operands, scalars, epilogues, out_dtype, max_helion_m, config_dir, site,
      norm_weight=None, norm_spec="", kernel=MULTI_GEMM_FAMILY):
    widths = [w.shape[0] if layout == "nk" else w.shape[1] for w, layout in zip(weights, weight_layouts.split(","))]
    return [x.new_empty((x.shape[0], n), dtype=out_dtype) for n in widths]


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
