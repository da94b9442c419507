"""RMSNorm prologue semantics, written once and shared by the reference path and the Helion kernel.

The norm the ``rmsnorm`` prologue step fuses is::

    h = x.float()
    rstd = rsqrt(mean(h * h, -1, keepdim=True) + eps)      # in float32
    y = h * rstd
    y = y.to(x.dtype).float()                             # only where the graph rounds before the weight
    out = (y * weight.float()).to(x.dtype)

Hugging Face's ``LlamaRMSNorm``/``Qwen3RMSNorm`` round to the input dtype before multiplying by the
weight (``round_before_weight``); ``F.rms_norm``/``nn.RMSNorm`` multiply in float32 and round once. In
float32 both are the same. The fused op carries an :class:`RmsNormSpec` as a string (its ``norm_spec``
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


def round_dtype(spec: RmsNormSpec, x_dtype: torch.dtype) -> torch.dtype:
    """What the normalized rows round through before the weight multiply (float32: no rounding)."""
    return x_dtype if spec.round_before_weight else torch.float32


def normalize(x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, rounding: torch.dtype) -> torch.Tensor:
    """Rows of ``x`` (a whole [M, K] tensor or a kernel tile) times their ``rstd`` ([M, 1]), rounded
    through ``rounding``, times the weight (its [K] slice), in x's dtype. Branch-free elementwise ops,
    so Helion device code calls it as is (a flag would be a symbolic value there)."""
    y = (x.to(torch.float32) * rstd).to(rounding).to(torch.float32)
    return (y * weight.to(torch.float32)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, spec: RmsNormSpec) -> torch.Tensor:
    """The unfused norm as eager computes it (the reference path; Inductor runs the same ops)."""
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + spec.eps)
    return normalize(x, rstd, weight, round_dtype(spec, x.dtype))
