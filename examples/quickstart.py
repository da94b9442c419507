"""Compile a transformer MLP block with the helion_inductor backend and show what it fused.

    python examples/quickstart.py

On a GPU the block runs in bf16 at decode size (8 tokens) and the script also times it against
``torch.compile`` default. On a CPU there is no Helion kernel: the backend is asked to rewrite the
graph anyway (``rewrite_on_cpu``) so the fused sites run through the reference implementation.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import helion_backend


class MLPBlock(nn.Module):
    """Linear + bias, GELU (tanh), Linear + bias, residual: the block every decoder layer has."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, intermediate)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def gpu_time_us(fn, x: torch.Tensor, calls: int = 20, replays: int = 50) -> float:
    """Median GPU time per call, replaying a CUDA graph of ``calls`` calls (no launch overhead)."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(x)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    hidden, intermediate = (4096, 12288) if on_gpu else (256, 1024)
    model = MLPBlock(hidden, intermediate).to(device, dtype).eval()
    x = torch.randn(2, 4, hidden, device=device, dtype=dtype)  # 8 tokens: a decode step at batch 8

    # CUDA graphs are on by default on CUDA; turned off here so the block can be timed inside one.
    options = {"cudagraphs": False} if on_gpu else {"rewrite_on_cpu": True}
    compiled = torch.compile(model, backend="helion_inductor", options=options)
    with torch.no_grad():
        out = compiled(x)
        reference = copy.deepcopy(model).double()(x.double())

    for report in helion_backend.get_reports():
        print(report.summary())
    error = ((out.double() - reference).abs().max() / reference.abs().max()).item()
    print(f"max error against eager float64, relative to max |out|: {error:.2e}")

    if on_gpu:
        with torch.no_grad():
            baseline = torch.compile(model)
            ours, theirs = gpu_time_us(compiled, x), gpu_time_us(baseline, x)
        print(f"GPU time per call: helion_inductor {ours:.1f} us, torch.compile default {theirs:.1f} us "
              f"({theirs / ours:.2f}x)")


if __name__ == "__main__":
    main()
