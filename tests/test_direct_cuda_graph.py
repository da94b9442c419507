"""The direct CUDA-graph runner (option ``cudagraph_runner="direct"``, ``runtime/direct_cuda_graph.py``).

On the CPU a recording of the call stands in for the CUDA graph: replaying it runs the call again on the inputs
the recording was made with and writes the results into the recording's outputs, as a graph's kernels write into
its own memory. So these tests check what the runner decides and copies; the GPU tests at the end check it with
real CUDA graphs.
"""

import pytest
import torch

import helion_backend
from helion_backend.options import BackendOptions
from helion_backend.runtime.direct_cuda_graph import MAX_GRAPHS, MAX_RECAPTURES, DirectCudaGraph


class RecordedCall:
    def __init__(self, call):
        self.call = call
        self.outputs = call()
        self.replays = 0

    def replay(self):
        self.replays += 1
        for dst, src in zip(self.outputs, self.call()):
            dst.copy_(src)


class Recorder:
    def __init__(self):
        self.recordings = []

    def __call__(self, call):
        recording = RecordedCall(call)
        self.recordings.append(recording)
        return recording, recording.outputs


class Linear:
    """A compiled graph's calling convention: the flat inputs (the weight a parameter, as Dynamo passes it),
    a list of outputs."""

    def __init__(self):
        self.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
        self.calls = 0

    def __call__(self, weight, x):
        self.calls += 1
        return [x @ weight + 1.0]


def runner_of(fn):
    events, recorder = [], Recorder()
    return DirectCudaGraph(fn, events.append, recorder, requires_cuda=False), events, recorder


def test_a_call_then_a_capture_then_replays_that_follow_each_new_input():
    linear = Linear()
    runner, events, recorder = runner_of(linear)
    kept = []
    for _ in range(5):
        x = torch.randn(3, 8)
        out = runner(linear.weight, x)
        torch.testing.assert_close(out[0], x @ linear.weight + 1.0, rtol=0, atol=0)
        kept.append((out[0], out[0].clone()))
    assert len(recorder.recordings) == 1 and recorder.recordings[0].replays == 4  # captured at the second call
    assert linear.calls == 1 + 1 + 4  # the first call, the recording, its replays
    assert events == ["captured at input shapes [[3, 8]]"]
    # Each output is a copy: later replays leave an output kept from an earlier call as it was.
    for out, value in kept:
        assert torch.equal(out, value)
    # The graph reads the parameter where it is, and its own copy of x, which holds the last call's x.
    (entry,) = runner.entries.values()
    assert entry.inputs[0] is linear.weight
    assert entry.inputs[1] is not x and torch.equal(entry.inputs[1], x)


def test_a_moved_static_input_is_captured_again_then_left_without_a_graph():
    linear = Linear()
    runner, events, recorder = runner_of(linear)
    x = torch.randn(2, 8)
    runner(linear.weight, x)
    runner(linear.weight, x)
    for _ in range(MAX_RECAPTURES + 1):
        linear.weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)  # new memory
        out = runner(linear.weight, x)
        torch.testing.assert_close(out[0], x @ linear.weight + 1.0, rtol=0, atol=0)
    assert len(recorder.recordings) == 1 + MAX_RECAPTURES
    assert events[1:MAX_RECAPTURES + 1] == ["captured again at input shapes [[2, 8]]: a static input moved"] * MAX_RECAPTURES
    assert events[-1] == f"not replayed at input shapes [[2, 8]]: its static inputs moved {MAX_RECAPTURES} times"


@pytest.mark.parametrize("case", ["writes_its_input", "random", "returns_a_view", "shared_outputs", "requires_grad",
                                  "overlapping"])
def test_a_graph_a_replay_could_get_wrong_runs_as_compiled(case):
    """Each case computes the same as without the runner, at every call, and the event says why no graph."""
    def fn(weight, x):
        if case == "writes_its_input":
            x.add_(1.0)
            return [x @ weight]
        if case == "random":
            return [x @ weight + torch.rand(1)]
        if case == "returns_a_view":
            return [x @ weight, x.view(-1)]
        if case == "shared_outputs":
            out = x @ weight
            return [out, out.t()]
        if case == "requires_grad":
            return [(x @ weight).requires_grad_()]
        return [x.sum(0) @ weight]

    weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    runner, events, recorder = runner_of(fn)
    for _ in range(3):
        x = torch.randn(1, 8).expand(3, 8) if case == "overlapping" else torch.randn(3, 8)
        x_before = x.clone()
        torch.manual_seed(0)
        out = runner(weight, x)
        torch.manual_seed(0)
        expected = fn(weight, x_before.clone() if case != "overlapping" else x_before)
        torch.testing.assert_close(out[0], expected[0], rtol=0, atol=0)
    assert not recorder.recordings
    reason = {"writes_its_input": "it writes to input 1 (shape [3, 8]), which is not a static input",
              "random": "it draws random numbers", "returns_a_view": "output 1 is a view of an input",
              "shared_outputs": "outputs 0 and 1 share memory",
              "requires_grad": "output 0 requires grad", "overlapping": "input 1 (shape [3, 8], strides [0, 1])"}
    assert len(events) == 1 and events[0].startswith("not replayed: ") and reason[case] in events[0], events


def test_a_failed_capture_leaves_that_signature_without_a_graph():
    linear = Linear()

    def failing(call):
        raise RuntimeError("operation not permitted when stream is capturing")

    events = []
    runner = DirectCudaGraph(linear, events.append, failing, requires_cuda=False)
    for _ in range(3):
        x = torch.randn(2, 8)
        torch.testing.assert_close(runner(linear.weight, x)[0], x @ linear.weight + 1.0, rtol=0, atol=0)
    assert events == ["not replayed: its capture failed (RuntimeError: operation not permitted when stream is "
                      "capturing)"]


def test_each_input_shape_has_its_own_graph_up_to_the_limit():
    linear = Linear()
    runner, events, recorder = runner_of(linear)
    for rows in range(1, MAX_GRAPHS + 2):
        for _ in range(3):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(runner(linear.weight, x)[0], x @ linear.weight + 1.0, rtol=0, atol=0)
    assert len(recorder.recordings) == MAX_GRAPHS
    assert events[-1] == f"not replayed at input shapes [[{MAX_GRAPHS + 1}, 8]]: {MAX_GRAPHS} signatures already " \
                         "have a graph"


def test_cpu_inputs_keep_the_backends_graph_off_cuda_graphs_and_say_so():
    """Through the backend: with CUDA graphs forced on for a CPU graph and the direct runner, the runner finds the
    inputs off the GPU, runs the graph as compiled, and the graph's report says so."""
    helion_backend.clear_reports()
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(approximate="tanh"))
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend="helion_inductor",
                             options={"rewrite_on_cpu": True, "cudagraphs": True, "cudagraph_runner": "direct"})
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    (report,) = helion_backend.get_reports()
    assert report.direct_cuda_graph == ["not replayed: its inputs are on cpu, not one GPU"], report.summary()
    assert "direct CUDA graph: not replayed: its inputs are on cpu, not one GPU" in report.summary()


def test_the_backends_decoder_step_replayed_on_the_cpu(monkeypatch):
    """The whole path through the backend on the decode benchmark's decoder, with the recording for a CUDA
    graph: Dynamo's inputs are told apart (weights, rotary tables and the caches, marked static, are read where
    they are; only the tokens and the position are copied in), the caches the step writes are static, so the step
    is captured, and every replayed step matches eager at its position, caches included."""
    import dataclasses
    import functools
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import decode

    recorder = Recorder()
    monkeypatch.setattr("helion_backend.backend.DirectCudaGraph",
                        functools.partial(DirectCudaGraph, recorder=recorder, requires_cuda=False))
    helion_backend.clear_reports()
    config = dataclasses.replace(decode.SMOKE_CONFIG, hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16,
                                 layers=2, vocab=80, context=4, max_len=12)
    eager, model = (decode.build_model(config, torch.float32, torch.device("cpu"), seed=0) for _ in range(2))
    for m in (eager, model):
        m.allocate_cache(batch=2, context=config.context, seed=1)
    compiled = torch.compile(model, backend="helion_inductor", dynamic=False,
                             options={"rewrite_on_cpu": True, "cudagraphs": True, "cudagraph_runner": "direct"})
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for position in range(config.context, config.context + 5):
            tokens = torch.randint(0, config.vocab, (2,), generator=generator)
            pos = torch.tensor([position])
            torch.testing.assert_close(compiled(tokens, pos), eager(tokens, pos), rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(model.layers, eager.layers):
        torch.testing.assert_close(ours.attn.k_cache, theirs.attn.k_cache, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.attn.v_cache, theirs.attn.v_cache, rtol=1e-4, atol=1e-4)
    assert len(recorder.recordings) == 1 and recorder.recordings[0].replays == 4
    (report,) = helion_backend.get_reports()
    assert report.direct_cuda_graph in (["captured at input shapes [[2], [1]]"],
                                        ["captured at input shapes [[1], [2]]"]), report.summary()


def test_a_training_graph_is_not_given_to_the_runner():
    """With gradients on, the compile is a training graph, which the runner does not replay (Inductor's trees
    keep it where CUDA graphs are on): no event in the report, and the gradients are eager's."""
    helion_backend.clear_reports()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(approximate="tanh"))
    reference = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(approximate="tanh"))
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend="helion_inductor",
                             options={"rewrite_on_cpu": True, "cudagraphs": True, "cudagraph_runner": "direct"})
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    reports = helion_backend.get_reports()
    assert reports and all(not r.direct_cuda_graph for r in reports), [r.summary() for r in reports]
    assert {r.kind for r in reports} >= {"forward"}


def test_the_runner_option_is_checked():
    assert BackendOptions.from_user({"cudagraph_runner": "direct"}).cudagraph_runner == "direct"
    with pytest.raises(ValueError, match="option 'cudagraph_runner' must be one of \\['trees', 'direct'\\]"):
        BackendOptions.from_user({"cudagraph_runner": "graphs"})


@pytest.mark.gpu
def test_the_backends_graph_replayed_directly_matches_eager_at_each_call():
    """On the GPU: the second call captures the compiled MLP, later calls replay it on their own inputs; every
    output matches eager and stays as it was after later calls; the report says where it was captured."""
    helion_backend.clear_reports()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(512, 256)).cuda().to(torch.bfloat16)
    compiled = torch.compile(model, backend="helion_inductor", options={"cudagraph_runner": "direct"})
    kept = []
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
            out = compiled(x)
            torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
            kept.append((out, out.clone()))
    for out, value in kept:
        assert torch.equal(out, value)
    (report,) = helion_backend.get_reports()
    assert report.direct_cuda_graph == ["captured at input shapes [[4, 256]]"], report.summary()
    assert report.runs_on_counts().get("helion", 0) >= 1, report.summary()
