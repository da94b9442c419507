"""Measuring kernels: timing, accuracy and the metadata that makes a measurement reproducible.

Shared by the tuner (``python -m helion_backend tune``) and the benchmarks, so that a tuned table and a
benchmark result are measured the same way. Timing: on a GPU, the GPU time of a CUDA-graph replay
(median over replays), so that host overhead (Dynamo guards, Python, launch latency) does not hide kernel
differences of a few microseconds; on a CPU, a wall-clock median, which is only good enough to check a
script end to end.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import torch

# A step runs call number ``i`` of a sequence (so that callers can rotate weights or inputs with ``i``)
# and returns whatever the call returns.
Step = Callable[[int], object]


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    """How many calls to warm up, to capture in one graph, and to time."""

    warmup_calls: int = 3
    calls_per_graph: int = 20
    warmup_replays: int = 5
    replays: int = 30


@dataclasses.dataclass
class CapturedCalls:
    """A CUDA graph of ``calls_per_graph`` steps, what each captured step returned, and the step itself.

    The returned tensors live in the graph's memory pool: every replay overwrites them, which lets
    a caller check the numbers of the very launches that were timed. The graph also reads memory
    allocated outside it (weights and inputs the step's closure prepared); holding ``step`` keeps that
    memory alive as long as the graph, since the next capture's ``empty_cache`` would unmap it.
    """

    graph: torch.cuda.CUDAGraph
    outputs: list[object]
    step: Step


def capture_calls(step: Step, config: TimingConfig) -> CapturedCalls:
    """Warm ``step`` up on a side stream, then capture ``config.calls_per_graph`` calls into one graph.

    The warm-up runs first, at least once at every call the graph will hold, so that compilation,
    autotuning, cuBLAS handle and workspace creation, and whatever a call prepares for its own operands (a
    weight tiled for tinygemm), happen outside the capture. A recompilation during capture would launch
    autotuning work into the graph, so Dynamo is told to raise instead.
    """
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        for i in range(max(config.warmup_calls, config.calls_per_graph)):
            step(i)
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.cuda.graph(graph, stream=side_stream):
        outputs = [step(i) for i in range(config.calls_per_graph)]
    torch.cuda.synchronize()
    return CapturedCalls(graph, outputs, step)


def median_replay_ms(graph: torch.cuda.CUDAGraph, config: TimingConfig) -> float:
    """Median GPU time of one replay of ``graph`` in milliseconds, each replay timed by CUDA events."""
    return median_replays_ms({"graph": graph}, config)["graph"]


def rotated(names: Sequence[str], turn: int) -> list[str]:
    """``names`` starting at the ``turn``-th (cyclically): the order of one round of variants taking turns, so
    that over the rounds each goes first equally often."""
    start = turn % len(names)
    return [*names[start:], *names[:start]]


def median_replays_ms(graphs: Mapping[str, torch.cuda.CUDAGraph], config: TimingConfig) -> dict[str, float]:
    """Median GPU time of one replay of each of ``graphs`` in milliseconds, each replay timed by CUDA events.

    The graphs take turns, one replay each per round in an order rotated every round, so that what drifts
    over a measurement (the GPU's clocks and temperature under a long compute-bound run) weighs on each
    alike: the way to compare variants of one case.
    """
    names = list(graphs)
    for _ in range(config.warmup_replays):
        for name in names:
            graphs[name].replay()
    torch.cuda.synchronize()
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {name: [] for name in names}
    for turn in range(config.replays):
        for name in rotated(names, turn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(start.elapsed_time(end) for start, end in pairs)
            for name, pairs in events.items()}


def time_wallclock_us(step: Step, config: TimingConfig) -> float:
    """Median wall time of one call in microseconds (CPU fallback: CUDA graphs need a GPU)."""
    for i in range(config.warmup_calls):
        step(i)
    samples = []
    for _ in range(config.replays):
        start = time.perf_counter()
        for i in range(config.calls_per_graph):
            step(i)
        samples.append((time.perf_counter() - start) / config.calls_per_graph)
    return statistics.median(samples) * 1e6


def time_callable_us(step: Step, config: TimingConfig, device: torch.device) -> float:
    """Median time of one call in microseconds: CUDA-graph replay on a GPU, wall clock on a CPU."""
    if device.type != "cuda":
        return time_wallclock_us(step, config)
    captured = capture_calls(step, config)
    return median_replay_ms(captured.graph, config) * 1e3 / config.calls_per_graph


def copies_to_defeat_l2(nbytes: int, device: torch.device) -> int:
    """How many copies of an ``nbytes`` operand to rotate through so that none is still in the L2 when
    it is read again: a decode GEMM streams its weight from HBM in a model, and must be timed so."""
    if device.type != "cuda":
        return 1
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, math.ceil(2 * l2_bytes / nbytes))


def relative_error(out: torch.Tensor | Sequence[torch.Tensor], ref: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||, computed in float64 (NaN stays NaN); of several
    outputs (one launch's), over all of them."""
    outs, refs = (out, ref) if isinstance(out, (list, tuple)) else ([out], [ref])
    error = sum(torch.linalg.vector_norm(o.double() - r.double()) ** 2 for o, r in zip(outs, refs, strict=True))
    return (error.sqrt() / sum(torch.linalg.vector_norm(r.double()) ** 2 for r in refs).sqrt()).item()


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata(device: torch.device) -> dict[str, object]:
    """What a reader needs to reproduce or compare a result file."""
    return {
        "command": shlex.join(sys.orig_argv),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": package_version("triton"),
        "helion": package_version("helion"),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
