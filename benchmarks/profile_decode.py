"""Where a decode step's GPU time goes: the kernels of each variant, by GPU time per step.

    python benchmarks/profile_decode.py --format bf16 --batch 1 --variants reduce_overhead,helion_inductor

Builds the model of ``benchmarks/decode.py`` (same shapes, weights and cache), compiles each variant as
that benchmark does, warms it up (cudagraph trees record, then replay), and runs ``--steps`` steps under
``torch.profiler``. The table lists the kernels by GPU time per step, so that two variants can be put
side by side kernel by kernel; ``--timeline`` adds the kernels of one step in launch order (which GEMM
ran where); ``--host`` adds the host side of a step (time until the call returns, CUDA API calls, host
events), which the benchmark's wall time adds to the GPU time. The output goes to stdout and, with
``--out``, to a text file.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode import (  # noqa: E402
    BASE_FORMAT,
    FLOAT_FORMATS,
    FORMATS,
    QWEN3_8B,
    VARIANTS,
    DecodeInputs,
    build_model,
    compile_variant,
    configure_dynamo,
    make_format_model,
    model_step,
    release_memory,
    spin_cycles_per_us,
)


def kernel_table(variant: str, step, steps: int, top: int) -> list[str]:
    """The ``top`` kernels of ``steps`` profiled steps, as lines: µs per step, launches per step, name."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total_us = sum(e.device_time_total for e in kernels) / steps
    lines = [f"== {variant}: {total_us:.1f} us of kernels per step, {len(kernels)} distinct kernels"]
    for e in kernels[:top]:
        lines.append(f"{e.device_time_total / steps:9.1f} us {e.count / steps:5.1f}x  {e.key[:110]}")
    return lines


def host_table(variant: str, step, steps: int, top: int) -> list[str]:
    """Where a step's host time goes: the median time until ``step()`` returns (the GPU's queue kept busy
    by a spin kernel, so that no launch waits on the GPU), the CUDA API calls per step and the ``top``
    host events by self time. A cudagraph-tree replay should be one graph launch and little Python."""
    torch.cuda._sleep(int(spin_cycles_per_us(torch.device("cuda")) * 2000 * steps))
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    api = sorted((e for e in events if e.key.startswith(("cuda", "cu"))), key=lambda e: -e.count)
    lines = [f"== {variant}: host {statistics.median(samples) * 1e6:.1f} us per step until the call returns; "
             "CUDA API calls per step: "
             + (", ".join(f"{e.key} {e.count / steps:.1f}" for e in api) or "none")]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in events[:top]:
        lines.append(f"{e.self_cpu_time_total / steps:9.1f} us self {e.count / steps:5.1f}x  {e.key[:110]}")
    return lines


def kernel_timeline(variant: str, step) -> list[str]:
    """The kernels of one step in the order they ran, with their GPU time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [f"-- {variant}: one step, {len(kernels)} kernels in launch order"] + [
        f"{e.time_range.elapsed_us():9.1f} us  {e.name[:110]}" for e in kernels
    ]


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default=BASE_FORMAT, choices=FORMATS)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", default="reduce_overhead,helion_inductor",
                        help=f"comma list of {VARIANTS}")
    parser.add_argument("--layers", type=int, default=QWEN3_8B.layers)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--timeline", action="store_true", help="also list one step's kernels in order")
    parser.add_argument("--host", action="store_true",
                        help="also time the host side of a step and list its CUDA API calls and host events")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--helion-options", type=json.loads, metavar="JSON",
                        help='backend options of the helion_inductor variant, e.g. \'{"frozen_weights": true}\'')
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py needs a CUDA device")
    device = torch.device("cuda")
    config = dataclasses.replace(QWEN3_8B, layers=args.layers)
    configure_dynamo()
    base = build_model(config, FLOAT_FORMATS[BASE_FORMAT], device, seed=0)
    model = make_format_model(args.format, base, config, device, seed=0)
    inputs = DecodeInputs.make(args.batch, config, device, seed=args.batch)
    model.allocate_cache(args.batch, config.context, seed=args.batch)
    lines = [f"{args.format} batch={args.batch}, {config.layers} layers, {args.steps} steps"]
    with torch.no_grad():
        for variant in args.variants.split(","):
            step = model_step(compile_variant(variant, model, device, args.helion_options), variant)
            run_step = functools.partial(step, inputs.tokens_a, inputs.pos_a)
            for _ in range(5):  # cudagraph trees warm up, record, then replay
                run_step()
            lines += kernel_table(variant, run_step, args.steps, args.top)
            if args.timeline:
                lines += kernel_timeline(variant, run_step)
            if args.host:
                lines += host_table(variant, run_step, args.steps, args.top)
            release_memory(device)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
