"""helion_backend.layers.quantize: accuracy of each format against float64, and quantize()'s contract."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from helpers import sqnr_db

from helion_backend.layers.quantize import (
    QUANT_FORMATS,
    BlockFp8Linear,
    Fp8DynamicLinear,
    Int4WeightOnlyLinear,
    _int_mm_any_m,
    quantize,
)

# Lowest SQNR (dB) of the layer's output against float64 with the float weights. Measured on the CPU
# over 20 seeds, fp32 and bf16 inputs: fp8 28.4-29.1, int8_dynamic 39.7-40.5, int8_weight_only
# 42.3-43.6, int4_weight_only (group 128) 18.4-19.0. A wrong scale or nibble order lands near 0 dB.
MIN_SQNR = {
    "fp8_dynamic": 25.0,
    "int8_dynamic": 35.0,
    "fp8_block": 25.0,
    "int8_weight_only": 40.0,
    "int4_weight_only": 17.0,
}
assert set(MIN_SQNR) == set(QUANT_FORMATS)
K, N = 256, 384  # fits every format: multiples of 128 (fp8_block), 16 (_scaled_mm) and the int4 group


def make_linear(k: int = K, n: int = N, *, bias: bool = True, dtype: torch.dtype = torch.float32,
                seed: int = 0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return linear.to(dtype)


def make_input(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def float64_reference(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.double()
    return torch.nn.functional.linear(x.double(), linear.weight.double(), bias)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_format_accuracy_against_float64(fmt, dtype, bias):
    linear = make_linear(bias=bias, dtype=dtype)
    x = make_input(2, 5, K, dtype=dtype)  # leading dims are flattened and restored
    q = quantize(copy.deepcopy(linear), fmt)
    assert isinstance(q, QUANT_FORMATS[fmt])
    out = q(x)
    assert out.shape == (2, 5, N) and out.dtype == dtype
    assert sqnr_db(float64_reference(linear, x), out) >= MIN_SQNR[fmt]


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
def test_any_leading_dims(fmt):
    linear = make_linear()
    q = quantize(copy.deepcopy(linear), fmt)
    for shape in [(K,), (3, K), (2, 1, 3, K)]:
        x = make_input(*shape)
        out = q(x)
        assert out.shape == (*shape[:-1], N)
        assert sqnr_db(float64_reference(linear, x), out) >= MIN_SQNR[fmt]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_rescale_after_matches_default_form(dtype, bias):
    linear = make_linear(bias=bias, dtype=dtype)
    x = make_input(4, K, dtype=dtype)
    default = Fp8DynamicLinear.from_linear(linear)
    after = Fp8DynamicLinear.from_linear(linear, rescale_after=True)
    assert "rescale_after=True" in repr(after)
    out = after(x)
    assert out.dtype == dtype
    assert sqnr_db(default(x), out) >= 40.0
    assert sqnr_db(float64_reference(linear, x), out) >= MIN_SQNR["fp8_dynamic"]
    # The unit scales are not state: both forms load each other's state_dict.
    assert set(default.state_dict()) == set(after.state_dict())


def test_int4_nibble_order_and_group_scales():
    linear = make_linear(k=128, n=16)
    q = Int4WeightOnlyLinear.from_linear(linear, group_size=32)
    assert q.packed.shape == (16, 64) and q.packed.dtype == torch.uint8 and q.scales.shape == (16, 4)
    w = linear.weight.detach().reshape(16, 4, 32)
    s = q.scales.unsqueeze(-1)
    expected = (torch.round(w / s).clamp(-8, 7) + 8).reshape(16, 128).to(torch.uint8)
    assert torch.equal(q.packed & 15, expected[:, 0::2])
    assert torch.equal(q.packed >> 4, expected[:, 1::2])
    # Dequantized with the same scales, every weight is within half a step of the original.
    eye = torch.eye(128)
    w_dq = (q(eye) - q.bias).t()  # x = identity reads out W^T
    assert ((w_dq.reshape(16, 4, 32) - w).abs() <= s / 2 + 1e-6).all()


def test_int4_zero_points_map_each_groups_range_onto_the_nibbles():
    """``zero_points=True``: each group's [min, max] (widened to hold 0.0) spans the 16 nibble values, with an
    integer zero point in 0..15 that stands for 0.0, so groups off center keep their resolution (the fixed
    zero point spends half the values on a sign such groups do not use)."""
    linear = make_linear(k=128, n=16)
    with torch.no_grad():
        linear.weight.add_(torch.linspace(-0.1, 0.1, 16).unsqueeze(1))  # rows off center
    q = Int4WeightOnlyLinear.from_linear(linear, group_size=32, zero_points=True)
    assert q.scales_and_zeros.shape == (16, 4, 2) and not hasattr(q, "scales")
    w = linear.weight.detach().reshape(16, 4, 32)
    s, zero = q.scales_and_zeros[:, :, :1], q.scales_and_zeros[:, :, 1:]
    span = w.amax(-1).clamp(min=0) - w.amin(-1).clamp(max=0)
    assert torch.equal(s.squeeze(-1), (span / 15).clamp(min=1e-6))
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15 and len(zero.unique()) > 4
    nibbles = torch.stack([q.packed & 15, q.packed >> 4], dim=-1).reshape(16, 4, 32)
    assert torch.equal(nibbles.float(), (torch.round(w / s) + zero).clamp(0, 15))
    # Dequantized, every weight is within a step of the original (half a step of rounding, and at a group's
    # ends up to half a step more, where the rounded zero point moved the range); the symmetric form is
    # coarser here.
    eye = torch.eye(128)
    w_dq = (q(eye) - q.bias).t().reshape(16, 4, 32)
    assert ((w_dq - w).abs() <= s + 1e-6).all()
    symmetric = Int4WeightOnlyLinear.from_linear(linear, group_size=32)
    x = make_input(8, 128)
    assert sqnr_db(float64_reference(linear, x), q(x)) > sqnr_db(float64_reference(linear, x), symmetric(x)) + 2


@pytest.mark.parametrize("pad_to", [None, 17])
def test_int_mm_any_m_matches_integer_matmul(pad_to):
    g = torch.Generator().manual_seed(2)
    b = torch.randint(-128, 128, (48, 24), generator=g, dtype=torch.int8)
    for m in range(1, 21):
        a = torch.randint(-128, 128, (m, 48), generator=g, dtype=torch.int8)
        out = _int_mm_any_m(a, b, pad_to=pad_to)
        assert out.dtype == torch.int32 and out.shape == (m, 24)
        assert torch.equal(out.double(), a.double() @ b.double())
    # The weight is passed transposed in the layer; a non-contiguous b must work on the padding path too.
    a = torch.randint(-128, 128, (5, 48), generator=g, dtype=torch.int8)
    bt = b.t().contiguous().t()
    assert torch.equal(_int_mm_any_m(a, bt, pad_to=17).double(), a.double() @ b.double())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.ModuleDict({"q": nn.Linear(K, K), "o": nn.Linear(K, K, bias=False)})
        self.mlp = nn.Sequential(nn.Linear(K, 2 * K), nn.GELU(), nn.Linear(2 * K, K))
        self.norm = nn.LayerNorm(K)


def test_quantize_replaces_only_filtered_layers():
    model = Block()
    seen: list[str] = []

    def only_mlp(module: nn.Module, name: str) -> bool:
        seen.append(name)
        return name.startswith("mlp.")

    assert quantize(model, "int8_dynamic", filter_fn=only_mlp) is model
    assert seen == ["attn.q", "attn.o", "mlp.0", "mlp.2"]  # fully qualified names, linears only
    assert type(model.attn["q"]) is nn.Linear and type(model.attn["o"]) is nn.Linear
    assert isinstance(model.mlp[0], QUANT_FORMATS["int8_dynamic"])
    assert isinstance(model.mlp[2], QUANT_FORMATS["int8_dynamic"])
    assert isinstance(model.mlp[1], nn.GELU) and isinstance(model.norm, nn.LayerNorm)


def test_quantize_all_by_default_shared_and_root_linears():
    shared = nn.Linear(K, K)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    quantize(model, "fp8_dynamic")
    assert isinstance(model[0], Fp8DynamicLinear) and model[0] is model[2]
    root = quantize(make_linear(), "int4_weight_only", group_size=64)
    assert isinstance(root, Int4WeightOnlyLinear) and root.group_size == 64 and not root.zero_points
    root = quantize(make_linear(), "int4_weight_only", zero_points=True)
    assert isinstance(root, Int4WeightOnlyLinear) and root.zero_points and "zero_points=True" in repr(root)
    # MultiheadAttention reads out_proj.weight itself: its out_proj must stay a linear.
    mha = quantize(nn.MultiheadAttention(K, 4), "int8_weight_only")
    assert type(mha.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear


def test_unknown_format_lists_valid_formats():
    with pytest.raises(ValueError) as info:
        quantize(Block(), "fp4_dynamic")
    message = str(info.value)
    assert "'fp4_dynamic'" in message
    assert all(name in message for name in QUANT_FORMATS)


@pytest.mark.parametrize("fmt, k, n, options, requirement", [
    ("fp8_block", K, 130, {}, "multiples of 128"),
    ("fp8_block", 200, K, {}, "multiples of 128"),
    ("fp8_dynamic", 72, K, {}, "multiples of 16"),
    ("int8_dynamic", 60, K, {}, "multiples of 8"),
    ("int4_weight_only", 129, K, {"group_size": 1}, "even"),
    ("int4_weight_only", 192, K, {}, "multiple of group_size=128"),
])
def test_incompatible_shape_names_layer_and_requirement(fmt, k, n, options, requirement):
    model = nn.Sequential(nn.Linear(K, K), nn.Sequential(nn.ReLU(), nn.Linear(k, n)))
    with pytest.raises(ValueError) as info:
        quantize(model, fmt, **options)
    message = str(info.value)
    assert "'1.1'" in message and f"in_features={k}" in message and f"out_features={n}" in message
    assert requirement in message
    assert type(model[0]) is nn.Linear  # checked before anything was replaced

    skipped = quantize(model, fmt, skip_incompatible=True, **options)
    assert isinstance(skipped[0], QUANT_FORMATS[fmt]) and type(skipped[1][1]) is nn.Linear


@pytest.mark.parametrize("fmt, options", [*((fmt, {}) for fmt in QUANT_FORMATS),
                                          ("int4_weight_only", {"zero_points": True})])
def test_state_dict_round_trip(fmt, options):
    linear = make_linear(dtype=torch.bfloat16)
    q = quantize(copy.deepcopy(linear), fmt, **options)
    state = q.state_dict()
    assert all(not t.requires_grad for t in state.values())
    if fmt == "int4_weight_only":
        options = {**options, "group_size": q.group_size}
    fresh = QUANT_FORMATS[fmt](K, N, bias=True, dtype=torch.bfloat16, **options)
    fresh.load_state_dict(state)
    x = make_input(3, K, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), q(x))
    assert repr(fresh) == repr(q)


def test_block_fp8_scaled_mm_probe():
    linear = make_linear()
    try:
        native = BlockFp8Linear.from_linear(linear, use_scaled_mm=True)
    except RuntimeError as e:  # the CPU build has no blockwise _scaled_mm
        message = str(e)
        assert "blockwise" in message and "use_scaled_mm=False" in message and "cpu" in message
        return
    x = make_input(4, K)
    assert sqnr_db(BlockFp8Linear.from_linear(linear)(x), native(x)) >= 40.0

