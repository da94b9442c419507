"""Quantized linear layers in plain PyTorch, written in the forms vLLM and torchao use.

A user without such a library can quantize a model here and compile it with ``helion_inductor``::

    from helion_backend.quantize import quantize
    model = quantize(model, "fp8_dynamic")
    compiled = torch.compile(model, backend="helion_inductor")

The backend recognizes these layers by the ops their ``forward`` traces to (activation quantization,
``_scaled_mm`` / ``_int_mm`` or weight dequantization, rescale), so each ``forward`` below follows
the libraries' formulas op for op: rewriting one "more neatly" can hide it from the backend.

Every layer stores its quantized weight and scales as buffers (``.to(device)`` and ``state_dict``
work), keeps the bias in the original dtype, accepts any leading dimensions and returns the input's
dtype. The input dtype is expected to be the dtype the layer was quantized from.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

# DeepSeek-V3 blocks: activation groups of 1x128 along K, weight blocks of 128x128.
from helion_backend.vocabulary import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
INT_MM_MIN_M = 17  # cuBLAS' int8 GEMM behind torch._int_mm needs more than 16 rows on CUDA
INT4_GROUP_SIZE = 128  # int4 weight-only's default group of K columns per scale (torchao's, and GPTQ's)


class _QuantizedLinear(nn.Module):
    """What all formats share: the shape, the optional bias (a buffer) and the shape checks.

    The constructors allocate uninitialized buffers, to load a ``state_dict`` into; ``from_linear``
    quantizes a float layer.
    """

    options: ClassVar[tuple[str, ...]] = ()
    """Keyword options of ``from_linear`` that :func:`quantize` passes through (e.g. ``group_size``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str | None, **options: Any) -> None:
        super().__init__()
        problem = self.shape_problem(in_features, out_features, **options)
        if problem is not None:
            raise ValueError(f"{type(self).__name__}: a linear of in_features={in_features}, "
                             f"out_features={out_features} cannot be quantized: {problem}")
        self.in_features = in_features
        self.out_features = out_features
        # A buffer, not a Parameter: these layers are for inference, and a Parameter that requires
        # grad would make torch.compile trace a training graph.
        self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def shape_problem(cls, in_features: int, out_features: int, **options: Any) -> str | None:
        """Why a linear of this shape cannot take this format (a requirement to print), or None."""
        return None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options: Any) -> _QuantizedLinear:
        raise NotImplementedError

    def _copy_bias(self, linear: nn.Linear) -> None:
        if linear.bias is not None:
            self.bias.copy_(linear.bias.detach())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _per_channel_amax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=1, keepdim=True).float()  # [N, 1]


def _quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized to fp8 with a dynamic scale per row of its last dimension (a token, or a group of a
    token's K): the fp8 values and the fp32 scales ``[..., 1]``.

    The bound is ``torch.finfo(...).max`` here, not the ``FP8_MAX`` global: ``torch.compile(dynamic=True)``
    makes a Python float that the forward reads from a global or an attribute a graph input, and a
    quantization that reads an input is no longer one of the activation alone, which is what the kernels
    fuse (they compile its constants in). Dynamo folds ``torch.finfo`` to a constant.
    """
    fp8_max = torch.finfo(FP8_DTYPE).max
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = (amax.to(torch.float32) / fp8_max).clamp(min=1e-12)
    xq = (x.to(torch.float32) / scale).clamp(-fp8_max, fp8_max).to(FP8_DTYPE)
    return xq, scale


def _multiple_problem(what: dict[str, int], multiple: int, why: str) -> str | None:
    bad = [f"{name}={value}" for name, value in what.items() if value % multiple]
    if not bad:
        return None
    return f"{' and '.join(what)} must be multiples of {multiple} ({why}); got {', '.join(bad)}"


# --------------------------------------------------------------------------------------------------
# fp8, per-token dynamic activation scales, per-channel weight scales


class Fp8DynamicLinear(_QuantizedLinear):
    """fp8 (e4m3) W8A8: activation scaled per token at run time, weight per output channel.

    Default form (vLLM's): one ``torch._scaled_mm`` with row-wise scales and the bias inside it.
    ``rescale_after=True`` is the other form libraries use: ``_scaled_mm`` with unit scales into
    fp32, then ``acc * scale * weight_scale (+ bias)`` in PyTorch. Both give the same result up to
    fp32 rounding. The bias stays inside the call: the CPU build (torch 2.13) accepts it with row-wise
    scales, in bf16 or fp32. On CUDA, row-wise ``_scaled_mm`` may accept only a bf16 output: use
    ``rescale_after=True`` (tensor-wise scales, fp32 output) for fp16/fp32 models there.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 rescale_after: bool = False) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.rescale_after = rescale_after
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.empty(1, out_features, dtype=torch.float32, device=device))
        # Unit scales of the rescale_after form; not persistent, so both forms share one state_dict.
        self.register_buffer("one", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    @classmethod
    def shape_problem(cls, in_features: int, out_features: int, **options: Any) -> str | None:
        return _multiple_problem({"in_features (K)": in_features, "out_features (N)": out_features}, 16,
                                 "torch._scaled_mm on CUDA")

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, rescale_after: bool = False) -> Fp8DynamicLinear:
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=w.dtype,
                  device=w.device, rescale_after=rescale_after)
        with torch.no_grad():
            w_scale = (_per_channel_amax(w) / FP8_MAX).clamp(min=1e-12)  # [N, 1]
            mod.qweight.copy_((w.float() / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
            mod.weight_scale.copy_(w_scale.t().contiguous())  # [1, N]: _scaled_mm's row-wise scale_b
            mod._copy_bias(linear)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xq, scale = self.quantize_activation(x2)
        return self.forward_quantized(xq, scale, x.dtype).reshape(*x.shape[:-1], self.out_features)

    @staticmethod
    def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``x`` [M, K] quantized as the forward does: fp8 [M, K] and their fp32 scales [M, 1]."""
        return _quantize_fp8(x)

    def forward_quantized(self, xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The [M, N] ``dtype`` result for rows already quantized (``xq`` [M, K], ``scale`` [M, 1]): what a
        compile's GEMM site computes when Inductor quantizes the rows (the tuner times it)."""
        if self.rescale_after:
            acc = torch._scaled_mm(xq, self.qweight.t(), scale_a=self.one, scale_b=self.one,
                                   out_dtype=torch.float32)
            out = acc * scale * self.weight_scale
            if self.bias is not None:
                out = out + self.bias
            return out.to(dtype)
        return torch._scaled_mm(xq, self.qweight.t(), scale_a=scale, scale_b=self.weight_scale,
                                bias=self.bias, out_dtype=dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rescale_after={self.rescale_after}"


# --------------------------------------------------------------------------------------------------
# int8 W8A8, symmetric per-token dynamic activation scales, per-channel weight scales


def _int_mm_any_m(a: torch.Tensor, b: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    """``torch._int_mm(a, b)`` (int8 x int8 -> int32) for any number of rows M.

    cuBLAS refuses M <= 16, so on CUDA the rows are zero-padded to 17 and the result sliced back.
    ``pad_to`` forces a row count (tests exercise the padding path on the CPU); None means 17 on
    CUDA and no padding elsewhere.
    """
    if pad_to is None:
        pad_to = INT_MM_MIN_M if a.device.type == "cuda" else 0
    m = a.shape[0]
    if m < pad_to:
        return torch._int_mm(F.pad(a, (0, 0, 0, pad_to - m)), b)[:m]
    return torch._int_mm(a, b)


def _int8_per_channel_layer(cls: type, linear: nn.Linear, scale_dtype: torch.dtype) -> Any:
    """A ``cls`` layer holding ``linear``'s weight as per-channel int8 with ``scale_dtype`` scales."""
    w = linear.weight.detach()
    mod = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        qweight, w_scale = _int8_per_channel(w, scale_dtype)
        mod.qweight.copy_(qweight)
        mod.weight_scale.copy_(w_scale)
        mod._copy_bias(linear)
    return mod


def _int8_per_channel(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 weight: (qweight [N, K], scale [N] in ``scale_dtype``).

    The weight is divided by the scale as stored, so that dequantizing with it is exact up to int8
    rounding (it matters for the bf16 scales of the weight-only format).
    """
    w_scale = (_per_channel_amax(w) / 127).clamp(min=1e-5).to(scale_dtype)
    qweight = torch.round(w.float() / w_scale.float()).clamp(-128, 127).to(torch.int8)
    return qweight, w_scale.reshape(-1)


class Int8DynamicLinear(_QuantizedLinear):
    """int8 W8A8 (torchao's int8_dynamic_activation_int8_weight): ``_int_mm`` then rescale in fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))

    @classmethod
    def shape_problem(cls, in_features: int, out_features: int, **options: Any) -> str | None:
        return _multiple_problem({"in_features (K)": in_features, "out_features (N)": out_features}, 8,
                                 "torch._int_mm on CUDA")

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8DynamicLinear:
        return _int8_per_channel_layer(cls, linear, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        xq, scale = self.quantize_activation(x2)
        return self.forward_quantized(xq, scale, x.dtype).reshape(*x.shape[:-1], self.out_features)

    @staticmethod
    def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``x`` [M, K] quantized as the forward does: int8 [M, K] and their fp32 scales [M, 1]."""
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = (amax.to(torch.float32) / 127.0).clamp(min=1e-5)
        return torch.round(x.to(torch.float32) / scale).clamp(-128, 127).to(torch.int8), scale

    def forward_quantized(self, xq: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The [M, N] ``dtype`` result for rows already quantized (``xq`` [M, K], ``scale`` [M, 1]), as
        :meth:`Fp8DynamicLinear.forward_quantized`."""
        acc = _int_mm_any_m(xq, self.qweight.t())  # int32 [M, N]
        out = acc.to(torch.float32) * scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype)


# --------------------------------------------------------------------------------------------------
# fp8 block scales (DeepSeek-V3): 1x128 activation groups, 128x128 weight blocks

_BLOCKWISE_SCALED_MM_PROBED: dict[str, str | None] = {}  # device type -> why it failed (None: works)


def _blockwise_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor,
                         weight_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with 1x128 activation scales [M, K/128] and 128x128 weight scales
    [N/128, K/128], in the layouts CUDA's blockwise kernel wants: the activation scales
    outer-dim-major, the weight scales transposed with K/128 padded to a multiple of 4."""
    kb = weight_scale.shape[1]
    scale_a = x_scale.t().contiguous().t()
    scale_b = F.pad(weight_scale, (0, -kb % 4)).t()[:kb]
    return torch._scaled_mm(xq, qweight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _probe_blockwise_scaled_mm(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run one tiny blockwise ``_scaled_mm`` on ``device`` (once per device type): None if it works."""
    key = f"{device.type}:{dtype}"
    if key not in _BLOCKWISE_SCALED_MM_PROBED:
        try:
            # Four blocks each way: scale shapes no row-wise reading fits, and K/128 a multiple of 4 as in
            # real layers (cuBLAS wants the weight scales' stride 16-byte aligned).
            size = 4 * FP8_BLOCK
            xq = torch.ones(16, size, device=device).to(FP8_DTYPE)
            qweight = torch.ones(size, size, device=device).to(FP8_DTYPE)
            _blockwise_scaled_mm(xq, torch.ones(16, 4, device=device), qweight, torch.ones(4, 4, device=device), dtype)
            _BLOCKWISE_SCALED_MM_PROBED[key] = None
        except Exception as e:  # any refusal means "not supported here"
            _BLOCKWISE_SCALED_MM_PROBED[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return _BLOCKWISE_SCALED_MM_PROBED[key]


class BlockFp8Linear(_QuantizedLinear):
    """fp8 with DeepSeek-V3 block scales: per-token groups of 128 along K, 128x128 weight blocks.

    The default forward dequantizes both operands and calls ``F.linear`` (the form that runs on every
    device). ``use_scaled_mm=True`` calls the blockwise ``torch._scaled_mm`` instead (bias added after
    it; the backend fuses both forms into one kernel); it is probed once at construction and refused
    with a clear error where the installed PyTorch lacks it (e.g. on the CPU), so build the layer on the
    device it will run on.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 use_scaled_mm: bool = False) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        if use_scaled_mm:
            probe_device = torch.device(device) if device is not None else torch.empty(0).device
            problem = _probe_blockwise_scaled_mm(probe_device, dtype)
            if problem is not None:
                raise RuntimeError(
                    f"BlockFp8Linear(use_scaled_mm=True): torch {torch.__version__} has no blockwise "
                    f"(1x128 activation, 128x128 weight scales) torch._scaled_mm on device "
                    f"{probe_device.type!r} ({problem}); use use_scaled_mm=False, the dequantize-then-linear "
                    f"form, which runs everywhere")
        self.use_scaled_mm = use_scaled_mm
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features // FP8_BLOCK, in_features // FP8_BLOCK,
                                                         dtype=torch.float32, device=device))

    @classmethod
    def shape_problem(cls, in_features: int, out_features: int, **options: Any) -> str | None:
        return _multiple_problem({"in_features (K)": in_features, "out_features (N)": out_features}, FP8_BLOCK,
                                 "1x128 activation groups along K and 128x128 weight blocks")

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, use_scaled_mm: bool = False) -> BlockFp8Linear:
        w = linear.weight.detach()
        n, k = w.shape
        mod = cls(k, n, linear.bias is not None, dtype=w.dtype, device=w.device, use_scaled_mm=use_scaled_mm)
        with torch.no_grad():
            blocks = w.float().reshape(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
            ws = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [N/128, K/128]
            q = (blocks / ws.reshape(n // FP8_BLOCK, 1, k // FP8_BLOCK, 1)).clamp(-FP8_MAX, FP8_MAX)
            mod.qweight.copy_(q.to(FP8_DTYPE).reshape(n, k))
            mod.weight_scale.copy_(ws)
            mod._copy_bias(linear)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k, block = self.out_features, self.in_features, FP8_BLOCK
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xq, scale = _quantize_fp8(x2.reshape(m, k // block, block))  # scale: [M, K/128, 1]
        if self.use_scaled_mm:
            out = _blockwise_scaled_mm(xq.reshape(m, k), scale.reshape(m, k // block), self.qweight,
                                       self.weight_scale, x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:
            x_dq = (xq.to(torch.float32) * scale).reshape(m, k).to(x.dtype)
            w_dq = (self.qweight.to(torch.float32).reshape(n // block, block, k // block, block)
                    * self.weight_scale.reshape(n // block, 1, k // block, 1)).reshape(n, k).to(x.dtype)
            out = F.linear(x_dq, w_dq, self.bias)
        return out.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block={FP8_BLOCK}, use_scaled_mm={self.use_scaled_mm}"


# --------------------------------------------------------------------------------------------------
# Weight-only formats: the activation stays in its dtype, the weight is dequantized in the forward


class Int8WeightOnlyLinear(_QuantizedLinear):
    """int8 weight, per-channel scale in the model's dtype: ``linear(x, q) * scale (+ bias)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=dtype, device=device))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        return _int8_per_channel_layer(cls, linear, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out = F.linear(x2, self.qweight.to(x.dtype)) * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4WeightOnlyLinear(_QuantizedLinear):
    """int4 weight packed two per byte, a scale per group of ``group_size`` along K, and zero point 8 or, with
    ``zero_points=True``, a zero point per group (asymmetric: each group's range mapped onto 0..15).

    Byte ``j`` of a row holds column ``2j`` in its low nibble and ``2j + 1`` in its high nibble. Without zero
    points the buffer ``scales`` is [N, K/G]; with them ``scales_and_zeros`` is [N, K/G, 2], each group's
    scale then its zero point (an integer 0..15 in the weight's dtype), the weight ``(q - zero) * scale``.
    """

    options = ("group_size", "zero_points")

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 group_size: int = INT4_GROUP_SIZE, zero_points: bool = False) -> None:
        super().__init__(in_features, out_features, bias, dtype, device, group_size=group_size)
        self.group_size = group_size
        self.zero_points = zero_points
        groups = in_features // group_size
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device))
        if zero_points:
            self.register_buffer("scales_and_zeros", torch.empty(out_features, groups, 2, dtype=dtype, device=device))
        else:
            self.register_buffer("scales", torch.empty(out_features, groups, dtype=dtype, device=device))

    @classmethod
    def shape_problem(cls, in_features: int, out_features: int, *, group_size: int = INT4_GROUP_SIZE,
                      **options: Any) -> str | None:
        if group_size <= 0:
            return f"group_size must be positive, got {group_size}"
        if in_features % 2:
            return f"in_features (K) must be even (two int4 values per byte); got in_features={in_features}"
        if in_features % group_size:
            return (f"in_features (K) must be a multiple of group_size={group_size} (one scale per group); "
                    f"got in_features={in_features}")
        return None

    @property
    def group_params(self) -> torch.Tensor:
        """What the kernels read besides the bytes: ``scales`` [N, K/G], or ``scales_and_zeros`` [N, K/G, 2]."""
        return self.scales_and_zeros if self.zero_points else self.scales

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, group_size: int = INT4_GROUP_SIZE,
                    zero_points: bool = False) -> Int4WeightOnlyLinear:
        w = linear.weight.detach()
        n, k = w.shape
        mod = cls(k, n, linear.bias is not None, dtype=w.dtype, device=w.device, group_size=group_size,
                  zero_points=zero_points)
        with torch.no_grad():
            groups = w.float().reshape(n, k // group_size, group_size)
            if zero_points:
                # The range holds 0.0 (so a zero point in 0..15 stands for it exactly), as torchao's qparams.
                low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
                s = ((high - low) / 15).clamp(min=1e-6).to(w.dtype)  # [N, K/G], as stored
                zero = torch.round((0 - low) / s.float()).clamp(0, 15)  # 0 - low: +0.0 where low is 0
                q = (torch.round(groups / s.float().unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, 15)
                mod.scales_and_zeros.copy_(torch.stack([s, zero.to(w.dtype)], dim=-1))
            else:
                s = (groups.abs().amax(dim=-1) / 7).clamp(min=1e-6).to(w.dtype)  # [N, K/G], as stored
                q = torch.round(groups / s.float().unsqueeze(-1)).clamp(-8, 7) + 8  # 0..15
                mod.scales.copy_(s)
            q = q.reshape(n, k).to(torch.uint8)
            mod.packed.copy_(q[:, 0::2] | (q[:, 1::2] << 4))
            mod._copy_bias(linear)
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        x2 = x.reshape(-1, k)
        low = self.packed & 15
        high = self.packed >> 4
        q = torch.stack([low, high], dim=-1).reshape(n, k)
        if self.zero_points:
            grouped = q.to(x.dtype).reshape(n, k // g, g) - self.scales_and_zeros[:, :, 1:]
            w_dq = (grouped * self.scales_and_zeros[:, :, :1]).reshape(n, k)
        else:
            w_dq = ((q.to(x.dtype) - 8).reshape(n, k // g, g) * self.scales.reshape(n, k // g, 1)).reshape(n, k)
        out = F.linear(x2, w_dq, self.bias)
        return out.reshape(*x.shape[:-1], n)

    def extra_repr(self) -> str:
        zero_points = ", zero_points=True" if self.zero_points else ""
        return f"{super().extra_repr()}, group_size={self.group_size}{zero_points}"


# --------------------------------------------------------------------------------------------------
# The entry point

QUANT_FORMATS: dict[str, type[_QuantizedLinear]] = {
    "fp8_dynamic": Fp8DynamicLinear,
    "int8_dynamic": Int8DynamicLinear,
    "fp8_block": BlockFp8Linear,
    "int8_weight_only": Int8WeightOnlyLinear,
    "int4_weight_only": Int4WeightOnlyLinear,
}
"""Format name -> layer class: the one place format names live."""


def _quantizable(module: nn.Module) -> bool:
    # MultiheadAttention's out_proj is read as ``.weight`` by its parent, never called: leave it.
    return isinstance(module, nn.Linear) and not isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear)


def quantize(model: nn.Module, format: str, *, filter_fn: Callable[[nn.Module, str], bool] | None = None,
             group_size: int = INT4_GROUP_SIZE, zero_points: bool = False, skip_incompatible: bool = False) -> nn.Module:
    """Replace, in place, each ``nn.Linear`` of ``model`` for which ``filter_fn(linear, qualified_name)``
    holds (default: all) with ``QUANT_FORMATS[format].from_linear(linear)``; return ``model``.

    Every layer is checked before any is replaced, so an error leaves the model as it was. A layer
    whose shape the format cannot take raises ValueError naming it and the requirement, or with
    ``skip_incompatible=True`` stays an ``nn.Linear``. ``group_size`` and ``zero_points`` are for
    ``int4_weight_only``. A linear reachable under several names is quantized once and shared. If ``model``
    itself is an ``nn.Linear``, the quantized layer is returned instead.
    """
    if format not in QUANT_FORMATS:
        raise ValueError(f"quantize: unknown format {format!r}; valid formats are {', '.join(QUANT_FORMATS)}")
    cls = QUANT_FORMATS[format]
    given = {"group_size": group_size, "zero_points": zero_points}
    options = {name: value for name, value in given.items() if name in cls.options}
    selected = filter_fn or (lambda module, name: True)

    # (parent, attribute, linear) for each place to replace; parent None is the root itself.
    plan: list[tuple[nn.Module | None, str, nn.Linear]] = []

    def visit(parent: nn.Module | None, attribute: str, module: nn.Module, name: str) -> None:
        if _quantizable(module):
            if selected(module, name):
                problem = cls.shape_problem(module.in_features, module.out_features, **options)
                if problem is None:
                    plan.append((parent, attribute, module))
                elif not skip_incompatible:
                    raise ValueError(
                        f"quantize(format={format!r}): layer {name or '<root>'!r} is nn.Linear(in_features="
                        f"{module.in_features}, out_features={module.out_features}) but {problem}; pass "
                        f"skip_incompatible=True to leave such layers unquantized, or a filter_fn that excludes it")
            return
        # _modules, not named_children(): that yields a module held under two names only once.
        for child_attribute, child in list(module._modules.items()):
            if child is not None:
                visit(module, child_attribute, child, f"{name}.{child_attribute}" if name else child_attribute)

    visit(None, "", model, "")
    made: dict[int, nn.Module] = {}
    for parent, attribute, linear in plan:
        if id(linear) not in made:
            made[id(linear)] = cls.from_linear(linear, **options)
        if parent is None:
            return made[id(linear)]
        setattr(parent, attribute, made[id(linear)])
    return model
