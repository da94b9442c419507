"""Measurement helpers shared by the benchmarks: hardware ceilings, plus the package's timing, accuracy and
metadata helpers (:mod:`helion_backend.tuning.timing`, which the tuner uses too), re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import torch

from helion_backend.quantize import QUANT_FORMATS
from helion_backend.tables import gpu_key
from helion_backend.tuning.timing import (  # noqa: F401  (re-exported for the benchmark scripts)
    CapturedCalls,
    Step,
    TimingConfig,
    capture_calls,
    copies_to_defeat_l2,
    median_replay_ms,
    median_replays_ms,
    package_version,
    relative_error,
    rotated,
    run_metadata,
    time_callable_us,
    time_wallclock_us,
)

# The quantized formats the benchmarks measure, by name: each helion_backend.quantize format as it comes, and
# int4 with a zero point per group. Name -> (format, options of ``quantize``).
QUANT_RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    **{fmt: (fmt, {}) for fmt in QUANT_FORMATS},
    "int4_weight_only_zp": ("int4_weight_only", {"zero_points": True}),
}


def quantized_layer(recipe: str, linear: torch.nn.Linear) -> torch.nn.Module:
    """``linear`` quantized as the benchmark format ``recipe`` says (:data:`QUANT_RECIPES`)."""
    fmt, options = QUANT_RECIPES[recipe]
    return QUANT_FORMATS[fmt].from_linear(linear, **options)


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


def device_tag(device: torch.device) -> str:
    """File-name tag of the device, the config tables' GPU key (``"nvidia_h200"``); ``"cpu"`` on a CPU."""
    return gpu_key(device) if device.type == "cuda" else device.type


def write_result_files(stem: Path, metadata: dict, rows: Sequence[dict], markdown: str) -> Path:
    """``<stem>.json`` (metadata and rows) and ``<stem>.md`` (the table); returns the JSON path."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = stem.with_suffix(".json")
    json_path.write_text(json.dumps({"metadata": metadata, "rows": list(rows)}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    return json_path


def read_result_files(paths: Sequence[Path]) -> list[dict]:
    """The ``{"metadata", "rows"}`` contents of result files, in the order given (the later wins a merge)."""
    return [json.loads(path.read_text()) for path in paths]


MERGED_COMMAND = "none: merged from the runs below (a later run's rows replace an earlier one's)"


def merged_metadata(shards: Sequence[dict], ran: set[str]) -> dict[str, Any]:
    """What every merge of result files shares: the last file's metadata but its command (no one command
    produced the merged rows), the runs the files came from (a merged file lists the ones it came from, a
    run its own command), the labels still skipped (a label that ``ran`` in some file is not) and whether
    none is."""
    skipped = [label for data in shards for label in data["metadata"]["skipped"] if label not in ran]
    return {
        **shards[-1]["metadata"],
        "command": MERGED_COMMAND,
        "merged_from": [command for data in shards
                        for command in data["metadata"].get("merged_from", [data["metadata"]["command"]])],
        "skipped": list(dict.fromkeys(skipped)),
        "complete": not skipped,
    }


def metadata_union(shards: Sequence[dict], key: str) -> list:
    """The items of list ``key`` of every file's metadata, each once, in the order they first appear."""
    return list(dict.fromkeys(item for data in shards for item in data["metadata"].get(key, [])))
