"""Custom ops the backend knows nothing about run outside CUDA graphs (helion_backend.cuda_graphs).

The bug this guards: transformers' fp16/fp32 MoE experts call a custom op that reads its group offsets on
the host (``offs.tolist()``). The backend captures CUDA graphs by default, and the capture failed, where
plain ``torch.compile`` runs the model.
"""

import pytest
import torch
import torch.nn.functional as F

import helion_backend
from helion_backend import backend, cuda_graphs


@torch.library.custom_op("hi_capture_test::scale_by_host_sum", mutates_args=())
def scale_by_host_sum(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Reads ``counts`` on the host, as a grouped-GEMM fallback loops over its offsets: no CUDA graph holds it."""
    return x * float(sum(counts.tolist()))


@scale_by_host_sum.register_fake
def _(x, counts):
    return torch.empty_like(x)


def model(x, w, counts):
    return F.linear(scale_by_host_sum(torch.relu(x), counts), w) + 1.0


def make_inputs(device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(4, 64, device=device, generator=g)
    w = torch.randn(32, 64, device=device, generator=g) / 8
    counts = torch.randint(1, 4, (3,), device=device, generator=g)
    return x, w, counts


def test_only_custom_ops_outside_the_capture_safe_namespaces_are_listed():
    gm = torch.fx.symbolic_trace(lambda x, c: torch.ops.hi_capture_test.scale_by_host_sum.default(
        torch.ops.aten.relu.default(x), c))
    assert cuda_graphs.ops_outside_cuda_graphs(gm.graph) == ["hi_capture_test::scale_by_host_sum.default"]
    assert cuda_graphs.ops_outside_cuda_graphs(gm.graph, ["hi_capture_test"]) == []
    assert cuda_graphs.ops_outside_cuda_graphs(gm.graph, ["hi_capture_test::scale_by_host_sum"]) == []
    assert cuda_graphs.ops_outside_cuda_graphs(gm.graph, ["hi_capture_test::other"]) != []


def test_with_cuda_graphs_on_inductor_partitions_around_the_op_and_the_report_says_so(monkeypatch):
    seen = []
    real = backend.compile_fx_inner

    def spy(*args, **kwargs):
        seen.append((torch._inductor.config.triton.cudagraphs, list(torch._inductor.config.custom_should_partition_ops)))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "compile_fx_inner", spy)
    x, w, counts = make_inputs("cpu")
    compiled = torch.compile(model, backend="helion_inductor", options={"cudagraphs": True, "rewrite_on_cpu": True})
    torch.testing.assert_close(compiled(x, w, counts), model(x, w, counts))
    op = "hi_capture_test::scale_by_host_sum.default"
    assert seen and all(op in partition_ops for _, partition_ops in seen)
    (report,) = helion_backend.get_reports()
    assert report.outside_cuda_graphs == [op]
    assert f"outside CUDA graphs: {op}" in report.summary()


def test_vouched_ops_and_graphs_without_cuda_graphs_are_left_alone(monkeypatch):
    x, w, counts = make_inputs("cpu")
    for options in ({"cudagraphs": True, "cudagraph_safe_ops": ["hi_capture_test"]}, {"cudagraphs": False}):
        helion_backend.clear_reports()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="helion_inductor", options={**options, "rewrite_on_cpu": True})
        torch.testing.assert_close(compiled(x, w, counts), model(x, w, counts))
        (report,) = helion_backend.get_reports()
        assert report.outside_cuda_graphs == [], options


@pytest.mark.parametrize("bad", [3, ["ns::op::x"], ["has space"], [None]])
def test_a_bad_cudagraph_safe_ops_value_names_the_option(bad):
    with pytest.raises(TypeError, match="cudagraph_safe_ops"):
        helion_backend.options.BackendOptions.from_user({"cudagraph_safe_ops": bad})


@pytest.mark.gpu
def test_a_host_reading_custom_op_runs_under_the_default_cuda_graphs():
    x, w, counts = make_inputs("cuda")
    compiled = torch.compile(model, backend="helion_inductor")  # CUDA graphs on by default
    for call in range(4):  # warm-up, record, replays
        x = torch.randn_like(x)
        ref = model(x.double(), w.double(), counts)
        out = compiled(x, w, counts)
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2, call
    assert all(r.outside_cuda_graphs == ["hi_capture_test::scale_by_host_sum.default"]
               for r in helion_backend.get_reports())
