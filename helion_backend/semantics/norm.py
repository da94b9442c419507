"""RMSNorm prologue semantics: the unfused norm (the reference path) and the pieces the Helion kernels use.

The norm the ``rmsnorm`` prologue step fuses is::

    h = x.float()
    rstd = rsqrt(mean(h * h, -1, keepdim=True) + eps)      # in float32
    y = h * rstd
    y = y.to(x.dtype).float()                             # only where the graph rounds before the weight
    out = (y * weight.float()).to(x.dtype)

Hugging Face's ``LlamaRMSNorm``/``Qwen3RMSNorm`` round to the input dtype before multiplying by the
weight (``round_before_weight``); ``F.rms_norm``/``nn.RMSNorm`` multiply in float32 and round once. In
float32 both are the same.

The kernels compute the same norm differently. ``rstd`` is one number per row, so it commutes with
the GEMM: ``norm(x) @ W == rstd * ((x * weight) @ W)``. Each K step multiplies the x tile by the norm's
weight (:func:`weighted_rows`) and feeds that to the dot; the accumulator is scaled by each row's rstd
once, at the end (:func:`scale_rows`). The rows' sums of squares come from a first pass over x in every
output tile, or, for at most :data:`ONE_PASS_MAX_M` rows, from the GEMM's own K loop (elementwise
:func:`squares`, reduced after it): at M = 1 a first pass over all of K delays each tile's first weight
load by a few microseconds, while for more rows a second use of the x tile inside the K loop slows the
weight stream more than the first pass costs. The rounding differs from the unfused graph's (x * weight is rounded once,
instead of x * rstd and then the product), within the dtype's precision; in float16 x * weight can
overflow where the normalized rows do not, so float16 rows keep the norm unfused (:data:`FUSED_DTYPES`).
The fused op carries an :class:`RmsNormSpec` as a string (its ``norm_spec``
argument); the weight [K] is a tensor argument of its own.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class RmsNormSpec:
    eps: float  # exactly the constant the graph adds to the mean square (repr round-trips a float)
    round_before_weight: bool  # the normalized rows are rounded to x's dtype before the weight multiply

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@functools.cache
def parse_spec(text: str) -> RmsNormSpec:
    """The spec the fused op carries; refuses anything but the two fields, with their types."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"norm_spec is not JSON: {e}") from None
    if (not isinstance(fields, dict) or set(fields) != {"eps", "round_before_weight"}
            or not isinstance(fields["eps"], (int, float)) or not isinstance(fields["round_before_weight"], bool)):
        raise ValueError(f"norm_spec must be {{'eps': float, 'round_before_weight': bool}}, got {text!r}")
    return RmsNormSpec(float(fields["eps"]), fields["round_before_weight"])


def rstd_from_sum_of_squares(sum_of_squares: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """``rsqrt(mean + eps)`` from a float32 row sum of squares over ``k`` elements."""
    return torch.rsqrt(sum_of_squares / k + eps)


# Row dtypes the kernels fuse the norm for: x * weight, taken before the rows are scaled, stays in range.
FUSED_DTYPES = (torch.bfloat16, torch.float32)


def weighted_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The GEMM operand of the fused norm: x times the norm's weight (its [K] slice), in x's dtype."""
    return (x.to(torch.float32) * weight.to(torch.float32)).to(x.dtype)


# The most rows whose sums of squares the kernels take from the GEMM's K loop (see the module docstring).
ONE_PASS_MAX_M = 1


def squares(x: torch.Tensor) -> torch.Tensor:
    """The float32 squares of an x tile, added up elementwise over the K loop and reduced after it: a
    reduction in every K step would stall the weight stream."""
    rows = x.to(torch.float32)
    return rows * rows


def scale_rows(acc: torch.Tensor, sum_of_squares: torch.Tensor, k: int, eps: float) -> torch.Tensor:
    """The accumulator of ``weighted_rows @ W`` times each row's ``rstd`` (from the [M, 1] sums of squares
    over all of K): the normalized rows' product."""
    return acc * rstd_from_sum_of_squares(sum_of_squares, k, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, spec: RmsNormSpec) -> torch.Tensor:
    """The unfused norm as eager computes it (the reference path; Inductor runs the same ops)."""
    h = x.to(torch.float32)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.eps)
    if spec.round_before_weight:
        y = y.to(x.dtype).to(torch.float32)
    return (y * weight.to(torch.float32)).to(x.dtype)
