"""The option ``verify`` on the GPU: real Helion kernels checked in cudagraph trees' warm-up run, never in a
capture; a kernel made wrong is caught there and the recorded graph runs the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import helion_backend
from helion_backend.runtime import dispatch, verify

pytestmark = pytest.mark.gpu

K, N = 512, 768
CALLS = 4  # warm-up (eager), record (capture), then replays


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.fixture(autouse=True)
def fresh_verify_state(monkeypatch):
    monkeypatch.setattr(dispatch, "_FAILED", {})
    verify.reset()
    yield
    verify.reset()


@pytest.fixture
def capture_states(monkeypatch):
    """Whether a CUDA graph was being captured at each check (it never may be)."""
    states: list[bool] = []
    compare = verify.compare

    def recording(*args, **kwargs):
        states.append(torch.cuda.is_current_stream_capturing())
        return compare(*args, **kwargs)

    monkeypatch.setattr(verify, "compare", recording)
    return states


def weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(N, K, device="cuda", dtype=dtype, generator=g) / K**0.5,
            torch.randn(N, device="cuda", dtype=dtype, generator=g))


def run_compiled(fn, dtype: torch.dtype, m: int = 8, **options) -> list[float]:
    """Compile ``fn(x)`` (CUDA graphs on, the default) with verify on, call it :data:`CALLS` times on fresh
    inputs and return each output's relative error against float64."""
    compiled = torch.compile(fn, backend="helion_inductor", options={"verify": True, **options})
    errors = []
    for _ in range(CALLS):
        x = torch.randn(m, K, device="cuda", dtype=dtype)
        errors.append(rel_err(compiled(x), fn(x.double())))
    return errors


@pytest.mark.parametrize("epilogue", ["bias_gelu_tanh", "bias_residual"])
def test_correct_kernels_are_checked_once_in_the_warm_up_and_keep_running(epilogue, capture_states):
    w, b = weights(torch.bfloat16)
    r = torch.randn(8, N, device="cuda", dtype=torch.bfloat16)
    fns = {"bias_gelu_tanh": lambda x: F.gelu(F.linear(x, w.to(x.dtype), b.to(x.dtype)), approximate="tanh"),
           "bias_residual": lambda x: F.linear(x, w.to(x.dtype), b.to(x.dtype)) + r.to(x.dtype)}
    errors = run_compiled(fns[epilogue], torch.bfloat16)
    assert max(errors) <= 1e-2, errors
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert site.runs_on == "helion" and site.fallbacks == [], site
    assert len(site.verified) == 1 and site.verified[0].startswith("M=8: ok"), site.verified
    assert capture_states == [False]


@pytest.mark.expects_fallback
def test_a_wrong_kernel_is_caught_in_the_warm_up_and_the_captured_graph_runs_the_reference(monkeypatch,
                                                                                        capture_states):
    launches = []
    real = dispatch._helion_gemm

    def wrong(*args, **kwargs):
        launches.append(torch.cuda.is_current_stream_capturing())
        return real(*args, **kwargs) * 1.1  # past bf16's tolerance (2e-2)

    monkeypatch.setattr(dispatch, "_helion_gemm", wrong)
    w, b = weights(torch.bfloat16)
    errors = run_compiled(lambda x: F.relu(F.linear(x, w.to(x.dtype), b.to(x.dtype))), torch.bfloat16)
    assert max(errors) <= 1e-2, errors  # every call, the checked one too, gave the reference's result
    assert launches == [False]  # the warm-up ran the kernel; the capture recorded the reference
    assert capture_states == [False]
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert site.verified[0].startswith("M=8: diverged"), site.verified
    assert len(site.fallbacks) == 1 and "diverged from the reference" in site.fallbacks[0], site.fallbacks


@pytest.mark.expects_fallback  # if the float32 kernel multiplies in TF32, verify sends the site to cuBLAS
def test_a_float32_site_gives_float32_accuracy_with_verify_on(capture_states):
    """Full-precision fp32 is what PyTorch computes (TF32 off by default): with verify on, whatever the Helion
    kernel's dots are, the output is at fp32 accuracy; the report says whether the kernel was."""
    assert torch.get_float32_matmul_precision() == "highest"
    w, b = weights(torch.float32)
    errors = run_compiled(lambda x: F.relu(F.linear(x, w.to(x.dtype), b.to(x.dtype))), torch.float32)
    assert max(errors) <= 2e-5, errors
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert site.runs_on == "helion" and len(site.verified) == 1, site
    assert capture_states == [False]
    print("float32 site:", site.verified[0])


def test_the_decode_attention_kernel_is_checked():
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    compiled = torch.compile(fn, backend="helion_inductor", options={"verify": True})
    for _ in range(CALLS):
        assert rel_err(compiled(q, k, v), fn(q.double(), k.double(), v.double())) <= 1e-2
    (attention,) = [a for rep in helion_backend.get_reports() for a in rep.attention]
    assert attention.runs_on == "helion" and attention.fallbacks == [], attention
    assert len(attention.verified) == 1 and attention.verified[0].startswith("M=1: ok"), attention.verified
