"""Measurement helpers shared by the benchmarks: kernel timing, hardware ceilings, accuracy, metadata.

Timing: on a GPU, the GPU time of a CUDA-graph replay (median over replays), so that host overhead
(Dynamo guards, Python, launch latency) does not hide kernel differences of a few microseconds; on a
CPU, a wall-clock median, which is only good enough to check a script end to end.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable

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
    """A CUDA graph of ``calls_per_graph`` steps and what each captured step returned.

    The returned tensors live in the graph's memory pool: every replay overwrites them, which lets
    a caller check the numbers of the very launches that were timed.
    """

    graph: torch.cuda.CUDAGraph
    outputs: list[object]


def capture_calls(step: Step, config: TimingConfig) -> CapturedCalls:
    """Warm ``step`` up on a side stream, then capture ``config.calls_per_graph`` calls into one graph.

    The warm-up runs first so that compilation, autotuning, cuBLAS handle and workspace creation
    happen outside the capture. A recompilation during capture would launch autotuning work into
    the graph, so Dynamo is told to raise instead.
    """
    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):
        for i in range(config.warmup_calls):
            step(i)
    torch.cuda.current_stream().wait_stream(side_stream)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.cuda.graph(graph, stream=side_stream):
        outputs = [step(i) for i in range(config.calls_per_graph)]
    torch.cuda.synchronize()
    return CapturedCalls(graph, outputs)


def median_replay_ms(graph: torch.cuda.CUDAGraph, config: TimingConfig) -> float:
    """Median GPU time of one replay of ``graph`` in milliseconds, each replay timed by CUDA events."""
    for _ in range(config.warmup_replays):
        graph.replay()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(config.replays)
    ]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


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


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Measured rates that turn a kernel's bytes and FLOPs into a floor time."""

    memory_bytes_per_s: float  # streaming bandwidth: the faster of a copy (read + write) and a read-only sum
    matmul_flop_per_s: float  # FLOP/s of one large square matmul in the benchmark dtype

    def hbm_floor_us(self, nbytes: int) -> float:
        return nbytes / self.memory_bytes_per_s * 1e6

    def flop_floor_us(self, flops: int) -> float:
        return flops / self.matmul_flop_per_s * 1e6


# Ceiling sizes: large enough to fill an H200 (1 GiB is 20x its L2); small for a CPU smoke run.
GPU_COPY_BYTES = 1 << 30
GPU_MATMUL_SIZE = 8192
CPU_COPY_BYTES = 1 << 26
CPU_MATMUL_SIZE = 512
CEILING_TIMING = TimingConfig(warmup_calls=2, calls_per_graph=5, warmup_replays=2, replays=10)


def measure_copy_bandwidth(device: torch.device, nbytes: int, config: TimingConfig = CEILING_TIMING) -> float:
    """Bytes read plus bytes written per second by one device-to-device copy of ``nbytes``."""
    src = torch.randn(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_callable_us(lambda _: dst.copy_(src), config, device) * 1e-6
    return 2 * nbytes / seconds


def measure_read_bandwidth(device: torch.device, nbytes: int, config: TimingConfig = CEILING_TIMING) -> float:
    """Bytes read per second by a sum over ``nbytes``: a decode GEMM mostly reads, and on the H200 a
    copy (2.8 TB/s read + write measured) understates how fast reads alone stream."""
    src = torch.randn(nbytes // 4, dtype=torch.float32, device=device)
    seconds = time_callable_us(lambda _: src.sum(), config, device) * 1e-6
    return nbytes / seconds


def measure_matmul_rate(
    device: torch.device, dtype: torch.dtype, size: int, config: TimingConfig = CEILING_TIMING
) -> float:
    """FLOP/s of a ``size``-cubed matmul on random (never zero) operands."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = time_callable_us(lambda _: a @ b, config, device) * 1e-6
    return 2 * size**3 / seconds


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Copy bandwidth and matmul rate of ``device``, at sizes that fill a GPU (small ones on a CPU)."""
    on_gpu = device.type == "cuda"
    ceilings = Ceilings(
        # The floor uses the faster of the two ways of streaming memory.
        memory_bytes_per_s=max(
            measure_copy_bandwidth(device, GPU_COPY_BYTES if on_gpu else CPU_COPY_BYTES),
            measure_read_bandwidth(device, GPU_COPY_BYTES if on_gpu else CPU_COPY_BYTES),
        ),
        matmul_flop_per_s=measure_matmul_rate(device, dtype, GPU_MATMUL_SIZE if on_gpu else CPU_MATMUL_SIZE),
    )
    if on_gpu:
        torch.cuda.empty_cache()
    return ceilings


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||, computed in float64 (NaN stays NaN)."""
    ref = ref.double()
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


def device_tag(device: torch.device) -> str:
    """Canonical file-name tag of the device: ``"NVIDIA H200"`` -> ``"nvidia_h200"``; ``"cpu"`` on a CPU."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


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
