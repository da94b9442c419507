"""Each shipped rule fuses what it promises, in the forms the post-grad graph has, and nothing else."""

import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_ACTIVATIONS, compile_run, randn, rel_err, sites

M, K, N = 6, 32, 48
ACTIVATIONS = TORCH_ACTIVATIONS


def check(fn, *args, rule, epilogue, op_calls, tol=1e-5):
    out, reports = compile_run(fn, *args)
    found = sites(reports)
    assert [(s.rule, s.epilogue) for s in found] == [(rule, epilogue)], [r.summary() for r in reports]
    assert found[0].runs_on == "reference"
    assert op_calls.count == 1 and op_calls.epilogues[0] == ",".join(epilogue)
    assert rel_err(out, fn(*(a.double() for a in args))) < tol
    return found[0]


# gemm_activation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [True, False])
def test_gemm_activation_matches_every_activation(act, with_bias, op_calls):
    x, w, b = randn(M, K), randn(N, K), randn(N)
    fn = (lambda x, w, b: ACTIVATIONS[act](F.linear(x, w, b))) if with_bias else (
        lambda x, w, b: ACTIVATIONS[act](F.linear(x, w)))
    epilogue = ["bias", act] if with_bias else [act]
    check(fn, x, w, b, rule="gemm_activation", epilogue=epilogue, op_calls=op_calls)


def test_gemm_activation_full_chain(op_calls):
    x, w, b, g, r = randn(M, K), randn(N, K), randn(N), randn(M, N), randn(M, N)
    fn = lambda x, w, b, g, r: (F.silu(F.linear(x, w, b)) * 0.5 * g + r)  # noqa: E731
    check(fn, x, w, b, g, r, rule="gemm_activation",
          epilogue=["bias", "silu", "scale", "mul", "residual"], op_calls=op_calls)


def test_gemm_activation_near_miss_tanh_is_not_an_activation(op_calls):
    x, w, b = randn(M, K), randn(N, K), randn(N)
    fn = lambda x, w, b: torch.tanh(F.linear(x, w, b))  # noqa: E731
    site = check(fn, x, w, b, rule="gemm_bias", epilogue=["bias"], op_calls=op_calls)
    assert "tanh" not in site.epilogue


def test_gemm_activation_near_miss_leaky_relu(op_calls):
    x, w = randn(M, K), randn(N, K)
    fn = lambda x, w: F.leaky_relu(x @ w.t(), 0.1)  # noqa: E731
    check(fn, x, w, rule="gemm", epilogue=[], op_calls=op_calls)


# gemm_residual ------------------------------------------------------------------------------------

def test_gemm_residual_matches(op_calls):
    x, w, r = randn(M, K), randn(N, K), randn(M, N)
    check(lambda x, w, r: F.linear(x, w) + r, x, w, r, rule="gemm_residual",
          epilogue=["residual"], op_calls=op_calls)


def test_gemm_residual_with_bias_and_scale(op_calls):
    x, w, b, r = randn(M, K), randn(N, K), randn(N), randn(M, N)
    check(lambda x, w, b, r: F.linear(x, w, b) * 2.0 + r, x, w, b, r, rule="gemm_residual",
          epilogue=["bias", "scale", "residual"], op_calls=op_calls)


def test_gemm_residual_near_miss_row_broadcast(op_calls):
    # [M, 1] is neither a bias nor a residual: the add stays with Inductor.
    x, w, r = randn(M, K), randn(N, K), randn(M, 1)
    check(lambda x, w, r: F.linear(x, w) + r, x, w, r, rule="gemm", epilogue=[], op_calls=op_calls)


# gemm_bias ----------------------------------------------------------------------------------------

def test_gemm_bias_matches_mm_plus_add(op_calls):
    x, w, b = randn(M, K), randn(K, N), randn(N)
    check(lambda x, w, b: x @ w + b, x, w, b, rule="gemm_bias", epilogue=["bias"], op_calls=op_calls)


def test_gemm_bias_near_miss_subtraction(op_calls):
    x, w, b = randn(M, K), randn(K, N), randn(N)
    check(lambda x, w, b: x @ w - b, x, w, b, rule="gemm", epilogue=[], op_calls=op_calls)


# gemm ---------------------------------------------------------------------------------------------

def test_gemm_matches_plain_mm(op_calls):
    x, w = randn(M, K), randn(K, N)
    check(lambda x, w: x @ w, x, w, rule="gemm", epilogue=[], op_calls=op_calls)


def test_gemm_near_miss_float64_is_reported_unfused(op_calls):
    x, w = randn(M, K).double(), randn(K, N).double()
    out, reports = compile_run(lambda x, w: x @ w, x, w)
    assert sites(reports) == [] and op_calls.count == 0
    (unfused,) = [u for r in reports for u in r.unfused_gemms]
    assert unfused.op == "aten.mm.default" and "float64" in unfused.reason
    torch.testing.assert_close(out, x @ w)


def test_bmm_is_reported_unfused(op_calls):
    x, w = randn(2, M, K), randn(2, K, N)
    out, reports = compile_run(torch.bmm, x, w)
    assert op_calls.count == 0
    assert [u.op for r in reports for u in r.unfused_gemms] == ["aten.bmm.default"]
    torch.testing.assert_close(out, torch.bmm(x, w))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm in this torch")
def test_grouped_mm_is_reported_unfused_with_its_reason(op_calls):
    """Mixture-of-experts layers run their experts as one grouped GEMM: the report lists it and says why."""
    x, w = randn(M, K, dtype=torch.bfloat16), randn(2, K, N, dtype=torch.bfloat16)  # the op takes bf16 only
    split = M // 4
    offsets = torch.tensor([split, M], dtype=torch.int32)  # rows [0, split) to group 0, the rest to group 1

    def experts(x, w, offsets):
        return torch._grouped_mm(x, w, offs=offsets)

    out, reports = compile_run(experts, x, w, offsets)
    assert op_calls.count == 0
    (unfused,) = [u for r in reports for u in r.unfused_gemms]
    assert unfused.op == "aten._grouped_mm.default", unfused
    assert "grouped GEMM" in unfused.reason and "no kernel family multiplies groups" in unfused.reason, unfused
    expected = torch.cat([x[:split].double() @ w[0].double(), x[split:].double() @ w[1].double()])
    assert rel_err(out, expected) < 1e-2  # one bf16 rounding of the output
