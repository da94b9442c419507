"""A gated MLP's gate and up projections as one site (``rules/gated_mlp.toml``), on the CPU
through the reference path: what fuses, what does not, and that the output is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import CPU_REWRITE, WITHOUT_GATED, compile_run, sites

from helion_backend.compile.rules import RuleError, load_rule_file


class GatedMLP(nn.Module):
    def __init__(self, hidden: int = 64, intermediate: int = 96) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("lead", [(5,), (2, 3)], ids=["2d", "3d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_and_up_become_one_site(dtype, lead):
    torch.manual_seed(0)
    model = GatedMLP().to(dtype).eval()
    x = torch.randn(*lead, 64, dtype=dtype)
    with torch.no_grad():
        out, reports = compile_run(model, x, options=CPU_REWRITE)
        expected = model(x)
    found = sites(reports)
    assert [s.rule for s in found] == ["gated_mlp", "gemm_residual"], [r.summary() for r in reports]
    assert found[0].epilogue == ["silu", "up_mul"] and "runs in the same kernel" in found[0].notes[0]
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


def test_gate_and_up_on_rows_padded_by_inductor_become_one_site():
    """On CUDA, Inductor's pad_mm pads an unaligned M of each projection and slices it back (M = 33
    became 40 and left gate and up as two sites): the padding is seen through and they fuse."""
    torch.manual_seed(2)
    w_gate, w_up = torch.randn(64, 96), torch.randn(64, 96)

    def fn(x):
        gate = (torch.constant_pad_nd(x, [0, 0, 0, 7]) @ w_gate)[:33]
        up = (torch.constant_pad_nd(x, [0, 0, 0, 7]) @ w_up)[:33]
        return F.silu(gate) * up

    x = torch.randn(33, 64)
    out, reports = compile_run(fn, x, options={**CPU_REWRITE, "max_helion_size": 64})
    (site,) = sites(reports)
    assert (site.rule, site.m, site.epilogue) == ("gated_mlp", 33, ["silu", "up_mul"]), site
    torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)


def test_without_the_gated_rules_gate_and_up_stay_two_sites():
    torch.manual_seed(1)
    model = GatedMLP().eval()
    x = torch.randn(4, 64)
    with torch.no_grad():
        out, reports = compile_run(model, x, options=WITHOUT_GATED)
        expected = model(x)
    assert [s.epilogue for s in sites(reports)] == [["silu", "mul"], [], ["residual"]]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_an_up_projection_read_elsewhere_is_not_absorbed():
    torch.manual_seed(2)
    model = GatedMLP().eval()

    def fn(x):
        up = model.up(x)
        return model.down(F.silu(model.gate(x)) * up), up.sum()

    x = torch.randn(4, 64)
    with torch.no_grad():
        (out, total), reports = compile_run(fn, x, options=CPU_REWRITE)
        expected_out, expected_total = fn(x)
    assert "gated_mlp" not in [s.rule for s in sites(reports)]
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, expected_total, rtol=1e-5, atol=1e-4)


def test_a_product_of_projections_of_different_inputs_is_not_gated():
    torch.manual_seed(3)
    model = GatedMLP().eval()

    def fn(x, y):
        return F.silu(model.gate(x)) * model.up(y)

    x, y = torch.randn(4, 64), torch.randn(4, 64)
    with torch.no_grad():
        out, reports = compile_run(fn, x, y, options=CPU_REWRITE)
    assert "gated_mlp" not in [s.rule for s in sites(reports)]
    torch.testing.assert_close(out, fn(x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("body, message", [
    ('anchor = ["mm"]\nepilogue = ["silu", "up_mul"]', "step 'up_mul' needs a kernel of gemm_glu, gemm_glu_fp8, gemm_glu_int8"),
    ('anchor = ["mm"]\nkernel = "gemm_glu"\nepilogue = ["silu", "up_mul?"]',
     "kernel family 'gemm_glu' needs a required 'up_mul' step in the epilogue"),
])
def test_rule_files_keep_up_mul_with_its_kernel(tmp_path, body, message):
    path = tmp_path / "rules.toml"
    path.write_text(f'[[rule]]\nname = "r"\n{body}\n')
    with pytest.raises(RuleError, match=message):
        load_rule_file(path)
