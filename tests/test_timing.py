"""helion_backend.tuning.timing: the replay timing that compares variants in turns (fakes stand in for the GPU)."""

from __future__ import annotations

import pytest
import torch

from helion_backend.tuning import timing


class FakeGraph:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


@pytest.fixture
def replay_log(monkeypatch) -> tuple[list[str], dict[str, float]]:
    """The replays in order, and each graph's replay time in ms, which fake CUDA events report: the time
    between two events is the sum of the replays logged between their records."""
    log: list[str] = []
    durations: dict[str, float] = {}

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = None

        def record(self) -> None:
            self.at = len(log)

        def elapsed_time(self, end: FakeEvent) -> float:
            return sum(durations[name] for name in log[self.at:end.at])

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    return log, durations


def test_graphs_replay_in_turns_and_each_gets_its_own_median(replay_log):
    log, durations = replay_log
    durations.update(a=1.0, b=5.0, c=2.0)
    graphs = {name: FakeGraph(name, log) for name in durations}

    medians = timing.median_replays_ms(graphs, timing.TimingConfig(warmup_replays=2, replays=4))

    assert medians == durations
    warmup, timed = log[:6], log[6:]
    assert warmup == ["a", "b", "c"] * 2
    # One replay each per round, the order rotated by one every round.
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_one_graph_is_timed_as_before(replay_log):
    log, durations = replay_log
    durations["g"] = 3.0
    assert timing.median_replay_ms(FakeGraph("g", log), timing.TimingConfig(warmup_replays=1, replays=5)) == 3.0
    assert log == ["g"] * 6


def test_a_captured_graph_keeps_alive_what_its_step_prepared(monkeypatch):
    """The graph reads the tensors the step's closure prepared outside it; once the caller drops the step,
    only the capture holds them, and the next capture's ``empty_cache`` would unmap them under the graph
    (int4 peer rows of the quant benchmark died with an illegal address in the replay)."""
    import contextlib
    import gc
    import weakref

    class FakeStream:
        def wait_stream(self, other: FakeStream) -> None:
            pass

    class FakeCUDAGraph:
        def replay(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, stream=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeCUDAGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)

    def prepared_step() -> tuple[timing.Step, weakref.ref]:
        packed = torch.randn(64)
        return (lambda i: packed * i), weakref.ref(packed)

    step, packed_ref = prepared_step()
    captured = timing.capture_calls(step, timing.TimingConfig(warmup_calls=1, calls_per_graph=2))
    del step
    gc.collect()
    assert packed_ref() is not None
    del captured
    gc.collect()
    assert packed_ref() is None
