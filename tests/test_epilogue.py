"""The shared epilogue: its activation formulas are PyTorch's definitions, and steps read in order."""

import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_ACTIVATIONS

from helion_backend.semantics.epilogue import (
    ACTIVATION_FORMULAS,
    apply_epilogue,
    format_steps,
    parse_epilogue,
)


@pytest.mark.parametrize("name", sorted(ACTIVATION_FORMULAS))
def test_activation_formula_is_pytorchs_definition(name):
    v = torch.randn(4096, dtype=torch.float64) * 6
    torch.testing.assert_close(ACTIVATION_FORMULAS[name](v), TORCH_ACTIVATIONS[name](v), rtol=1e-12, atol=1e-14)


def test_steps_consume_operands_and_scalars_in_order():
    acc = torch.randn(5, 7, dtype=torch.float64)
    bias, residual, gate = torch.randn(7), torch.randn(5, 7), torch.randn(5, 7)
    steps = parse_epilogue("bias,silu,scale,mul,scale,residual,cast")
    out = apply_epilogue(acc, steps, [bias, gate, residual].__getitem__, [0.5, -2.0])
    expected = F.silu(acc + bias.double()) * 0.5 * gate.double() * -2.0 + residual.double()
    torch.testing.assert_close(out, expected)
    assert format_steps(steps) == "bias,silu,scale,mul,scale,residual,cast"


def test_unknown_step_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown epilogue step\(s\) \['swish'\]; valid: \[.*'silu'"):
        parse_epilogue("bias,swish")
