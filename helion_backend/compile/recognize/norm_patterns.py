"""Recognizer for an RMSNorm right before a float GEMM (the ``rmsnorm`` prologue step).

It walks back from the GEMM's activation through the norm's post-grad form, in the spellings models
write: Hugging Face's ``LlamaRMSNorm``/``Qwen3RMSNorm`` (fp32 norm, cast back, then ``weight *``) and
``F.rms_norm``/``nn.RMSNorm`` (fp32 norm times the weight, then cast back), with or without the 2-D view
that a 3-D activation gets before ``mm``. The result is either a :class:`RmsNormMatch` or, for a
value that is a norm the kernel does not compute the same way, the reason (the site's note). Anything
that is not a norm at all gives None.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from helion_backend.compile.recognize.patterns import RESHAPES, val
from helion_backend.semantics.norm import RmsNormSpec
from helion_backend.vocabulary import ANCHOR_OPS, dtype_name

aten = torch.ops.aten
prims = torch.ops.prims

_ADDS = {aten.add.Tensor, aten.add.Scalar, aten.add_.Scalar, aten.add_.Tensor}


@dataclass(frozen=True)
class RmsNormMatch:
    x: fx.Node  # the un-normalized activation the norm reads (3-D when ``view`` is set)
    weight: fx.Node  # the norm's weight [K]
    spec: RmsNormSpec
    nodes: tuple[fx.Node, ...]  # the norm's nodes, its output last
    view: fx.Node | None  # the [M, K] view between the norm and the GEMM, if any


def find_rmsnorm(gemm_x: fx.Node, k: int, dtype: torch.dtype) -> RmsNormMatch | str | None:
    """The RMSNorm computing ``gemm_x`` (the GEMM's [M, K] input of ``dtype``), a near miss's reason, or None."""
    view = gemm_x if gemm_x.target in RESHAPES else None
    out = gemm_x.args[0] if view is not None else gemm_x
    scaled = _weight_multiply(out, k, dtype)
    if scaled is None:
        return None
    weight, normalized, round_before_weight, outer = scaled
    found = _normalized_rows(normalized)
    if found is None:
        return None
    if isinstance(found, str):
        return "an RMSNorm-like value feeds the GEMM, but " + found
    x, eps, inner = found
    x_val = val(x)
    if x_val is None or x_val.shape[-1] != k or x_val.dtype != dtype:
        what = f"{tuple(x_val.shape)} {dtype_name(x_val.dtype)}" if x_val is not None else "?"
        return f"the norm's input is {what}, not rows of K={k} in the GEMM's {dtype_name(dtype)}"
    if view is not None and not _viewable(x_val):
        return "the norm's input is not contiguous, so it cannot be read as the GEMM's [M, K] activation"
    readers = _other_readers(out, view)
    if readers:
        return (f"the normalized value is also read by {', '.join(readers)} (not a GEMM): the norm stays "
                "computed for them and the GEMM reads it")
    nodes = (*inner, *outer)
    return RmsNormMatch(x, weight, RmsNormSpec(float(eps), round_before_weight), nodes, view)


def _weight_multiply(out: fx.Node, k: int, dtype: torch.dtype) -> tuple[fx.Node, fx.Node, bool, list[fx.Node]] | None:
    """``(weight, normalized rows, round_before_weight, nodes)`` of the norm's last multiply, or None.

    ``F.rms_norm``: ``convert(mul(y, w), dtype)``; Hugging Face: ``mul(w, convert(y, dtype))``; in
    float32 there are no converts and the two are the same.
    """
    nodes = [out]
    if _is_convert(out, dtype) and dtype != torch.float32:
        product, round_before_weight = out.args[0], False
        nodes.insert(0, product)
    else:
        product, round_before_weight = out, True
    if product.target is not aten.mul.Tensor:
        return None
    split = _split_weight(product, k)
    if split is None:
        return None
    weight, rows = split
    if round_before_weight and _is_convert(rows, dtype):
        nodes.insert(0, rows)
        rows = rows.args[0]
    else:  # nothing rounds between the norm and the weight (float32, or a norm computed in x's dtype)
        round_before_weight = False
    return weight, rows, round_before_weight, nodes


def _split_weight(product: fx.Node, k: int) -> tuple[fx.Node, fx.Node] | None:
    """The [K] weight and the rows of a ``mul``, in either order."""
    a, b = product.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    for weight, rows in ((a, b), (b, a)):
        w_val, r_val = val(weight), val(rows)
        if (w_val is not None and r_val is not None and w_val.dim() == 1 and w_val.shape[0] == k
                and w_val.dtype.is_floating_point and r_val.dim() >= 2):
            return weight, rows
    return None


def _normalized_rows(y: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | str | None:
    """``(x, eps, nodes)`` for ``y = h * rsqrt(mean(h^2, -1, keepdim) + eps)`` with ``h = x.float()``; a
    reason when ``y`` multiplies by an rsqrt the kernel does not compute; None when it does not."""
    if y.target is not aten.mul.Tensor:
        return None
    a, b = y.args[:2]
    h, rstd = (a, b) if getattr(b, "target", None) is aten.rsqrt.default else (b, a)
    if getattr(rstd, "target", None) is not aten.rsqrt.default or not isinstance(h, fx.Node):
        return None
    shifted = rstd.args[0]
    eps = _added_constant(shifted)
    if eps is None and shifted.target in _ADDS and any(_is_input_scalar(a) for a in shifted.args[:2]):
        return ("its eps is a graph input, not a constant (torch.compile(dynamic=True) lifts float attributes "
                "to inputs; mark the token dimension dynamic with torch._dynamo.mark_dynamic instead)")
    if eps is None:
        return "its rsqrt does not read mean(x^2) + a constant eps"
    mean = shifted.args[0] if isinstance(shifted.args[0], fx.Node) else shifted.args[1]
    if mean.target is not aten.mean.dim:
        return f"its rsqrt reads {mean.target} + eps, not mean(x^2) + eps"
    square, dims = mean.args[0], list(mean.args[1])
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    h_val = val(h)
    if h_val is None:
        return None
    if dims not in ([-1], [h_val.dim() - 1]):
        return f"it reduces over dim {dims}, not the last one (K)"
    if not keepdim:
        return "its mean drops the reduced dim (keepdim=False)"
    if not _is_square_of(square, h):
        return "its mean is not over the square of the rows it scales"
    if h_val.dtype != torch.float32:
        return f"it computes in {dtype_name(h_val.dtype)}, not float32"
    x = h.args[0] if _is_convert(h, torch.float32) else h
    return x, eps, [*([h] if x is not h else []), square, mean, shifted, rstd, y]


def _added_constant(node: fx.Node) -> float | None:
    """The Python number ``c`` of ``add(v, c)`` (either order), or None."""
    if node.target not in _ADDS or len(node.args) < 2 or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = node.args[:2]
    if isinstance(b, numbers.Real) and isinstance(a, fx.Node):
        return float(b)
    if isinstance(a, numbers.Real) and isinstance(b, fx.Node):
        return float(a)
    return None


def _is_input_scalar(node: object) -> bool:
    """A one-element graph input (maybe converted): how Dynamo passes a float it did not specialize."""
    if _is_convert(node, torch.float32):
        node = node.args[0]
    value = val(node) if isinstance(node, fx.Node) else None
    return node is not None and getattr(node, "op", None) == "placeholder" and value is not None and value.numel() == 1


def _is_square_of(square: fx.Node, h: fx.Node) -> bool:
    if square.target is aten.pow.Tensor_Scalar:
        return square.args[0] is h and square.args[1] == 2
    return square.target is aten.mul.Tensor and square.args[0] is h and square.args[1] is h


def _is_convert(node: fx.Node, dtype: torch.dtype) -> bool:
    return (isinstance(node, fx.Node) and node.target is prims.convert_element_type.default
            and node.args[1] == dtype)


def _viewable(t: torch.Tensor) -> bool:
    """Contiguous for certain (the rewrite views it as [M, K] as the graph viewed the normalized value)."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _other_readers(out: fx.Node, view: fx.Node | None) -> list[str]:
    """Live readers of the normalized value that are not GEMMs reading it as their activation."""
    readers = []
    for user in _live(out.users):
        if user.target in RESHAPES and all(_reads_as_activation(u, user) for u in _live(user.users)):
            continue
        if not _reads_as_activation(user, out):
            readers.append(user.name)
    return readers


def _live(users) -> list[fx.Node]:
    """Users that something reads (the tracer leaves dead converts behind; compiled graphs have none)."""
    return [u for u in users if u.op != "call_function" or u.users or u.target in ANCHOR_OPS.values()]


def _reads_as_activation(user: fx.Node, value: fx.Node) -> bool:
    if user.target is aten.mm.default:
        return user.args[0] is value
    if user.target is aten.addmm.default:
        return user.args[1] is value
    return False
