"""GEMM sites of one activation share one launch (``multi_gemm_epilogue``): which sites group, which do not
and why, and that the rewritten graph (the reference path, ``rewrite_on_cpu``) computes what eager does."""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn as nn
from helpers import NORMS_FUSED, compile_run, rel_err, sites
from test_rmsnorm_prologue import HFRMSNorm

from helion_backend.runtime import dispatch
from helion_backend.semantics.gemm_spec import GemmSpec
from helion_backend.vocabulary import MULTI_GEMM_FAMILY

# The input norm fuses at every M these tests use.
CPU_REWRITE = {**helpers.CPU_REWRITE, **NORMS_FUSED}
D, KV = 64, 16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
GROUPED = f"one launch ({MULTI_GEMM_FAMILY})"


class QKV(nn.Module):
    """A decoder's attention inputs: an optional input norm, then q, k and v of the same rows, each with
    an epilogue of its own (v's ReLU stands for any pointwise tail)."""

    def __init__(self, norm: bool = True, bias: bool = False, projections: int = 3) -> None:
        super().__init__()
        self.norm = HFRMSNorm(D) if norm else nn.Identity()
        self.projections = nn.ModuleList(nn.Linear(D, D if i == 0 else KV, bias=bias) for i in range(projections))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.norm(x)
        outs = [p(h) for p in self.projections]
        return [*outs[:-1], torch.relu(outs[-1])]


def _check_against_eager(model: nn.Module, x: torch.Tensor, dtype: torch.dtype, options: dict | None = None):
    with torch.no_grad():
        got, reports = compile_run(model, x, options=options or CPU_REWRITE)
        for out, ref in zip(got, model(x)):
            assert rel_err(out, ref) <= TOLERANCE[dtype]
    return sites(reports)


@pytest.mark.parametrize("shape", [(5, D), (2, 3, D)], ids=["2d", "3d"])
@pytest.mark.parametrize("norm, bias", [(True, False), (False, True)], ids=["rmsnorm", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_run_in_one_launch_and_match_eager(shape, norm, bias, dtype, op_calls):
    torch.manual_seed(0)
    model = QKV(norm, bias).to(dtype).eval()
    found = _check_against_eager(model, torch.randn(*shape, dtype=dtype), dtype)
    assert (op_calls.launches, op_calls.count) == (1, 3)
    assert len(found) == 3 and all(s.kernel == MULTI_GEMM_FAMILY and s.runs_on == "reference" for s in found)
    assert all(any(n.startswith(GROUPED) for n in s.notes) for s in found), [s.notes for s in found]
    assert all(s.prologue == (["rmsnorm"] if norm else []) for s in found)
    assert [s.epilogue for s in found] == ([["bias"]] * 2 + [["bias", "relu"]] if bias else [[], [], ["relu"]])


def test_fresh_inputs_run_the_compiled_launch(op_calls):
    """The compiled graph, not a constant: new rows through the same compile give eager's result."""
    torch.manual_seed(0)
    model = QKV().eval()
    compiled = torch.compile(model, backend="helion_inductor", options=dict(CPU_REWRITE))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, D)
            for out, ref in zip(compiled(x), model(x)):
                assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    assert (op_calls.launches, op_calls.count) == (3, 9)


def test_more_sites_than_slots_take_several_launches(op_calls):
    torch.manual_seed(0)
    found = _check_against_eager(QKV(projections=5).eval(), torch.randn(3, D), torch.float32)
    assert (op_calls.launches, op_calls.count) == (2, 5)  # three sites, then two
    assert sorted(s.kernel for s in found) == [MULTI_GEMM_FAMILY] * 5


def test_option_off_keeps_one_launch_per_site(op_calls):
    torch.manual_seed(0)
    found = _check_against_eager(QKV().eval(), torch.randn(3, D), torch.float32,
                                 options={**CPU_REWRITE, "merge_siblings": False})
    assert (op_calls.launches, op_calls.count) == (3, 3)
    assert len(found) == 3 and all(s.kernel == "gemm" and not any(GROUPED in n for n in s.notes) for s in found)


class ReadsASiblingsResult(nn.Module):
    """k's epilogue adds a value computed from q's result: one op cannot produce both."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(D, KV, bias=False), nn.Linear(D, KV, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.q(x)
        return q, self.k(x) + torch.sin(q)


def test_an_operand_computed_from_a_siblings_result_keeps_them_apart(op_calls):
    torch.manual_seed(0)
    found = _check_against_eager(ReadsASiblingsResult().eval(), torch.randn(3, D), torch.float32)
    assert (op_calls.launches, op_calls.count) == (2, 2)
    assert len(found) == 2 and all(s.kernel == "gemm" and s.runs_on == "reference" for s in found)
    assert any("not in one launch" in n and "computed after" in n for s in found for n in s.notes), \
        [s.notes for s in found]


def test_dynamic_token_count_runs_the_shared_launch_up_to_the_limit(op_calls):
    torch.manual_seed(0)
    model = QKV().eval()
    compiled = torch.compile(model, backend="helion_inductor", options=dict(CPU_REWRITE))
    with torch.no_grad():
        for m in (3, 7, 40):
            x = torch.randn(m, D)
            torch._dynamo.mark_dynamic(x, 0)
            for out, ref in zip(compiled(x), model(x)):
                assert rel_err(out, ref) <= TOLERANCE[torch.float32], m
    assert (op_calls.launches, op_calls.count) == (2, 6)  # M = 40 is above max_helion_size: left to Inductor


def test_the_op_refuses_epilogues_that_do_not_match_its_weights():
    x, w = torch.randn(2, D), torch.randn(KV, D)

    def spec(*epilogues):
        return GemmSpec(MULTI_GEMM_FAMILY, torch.float32, ("nk",) * len(epilogues), epilogues, max_helion_m=32)

    with pytest.raises(ValueError, match="2 weights need as many layouts and epilogues"):
        dispatch.run_multi_gemm_epilogue(spec(()), x, [w, w], [], None)
    with pytest.raises(ValueError, match=r"read 1 tensor operand\(s\) and 0 scalar\(s\), got 0 and 0"):
        dispatch.run_multi_gemm_epilogue(spec(("bias",), ()), x, [w, w], [], None)
    with pytest.raises(ValueError, match="rmsnorm prologue step needs norm_weight and norm_spec"):
        dispatch.run_multi_gemm_epilogue(spec((), ()), x, [w, w], [], torch.ones(D))
