"""Shared test helpers: compile with the backend on the CPU and read what it reported."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F

import helion_backend
from helion_backend.report import GraphReport, SiteReport
from helion_backend.rules import BUILTIN_RULES_DIR

CPU_REWRITE = {"rewrite_on_cpu": True}
# The experimental gated MLP rules (gate and up projections in one kernel), with the CPU rewrite.
GATED_RULES = str(BUILTIN_RULES_DIR / "experimental" / "gated_mlp.toml")
WITH_GATED = {**CPU_REWRITE, "rules": [GATED_RULES]}

# Where device-generic tests run, and how: on CUDA with the default options (the Helion kernels run),
# elsewhere with the CPU rewrite (the reference implementation runs).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DEVICE_OPTIONS: dict[str, object] = {} if DEVICE.type == "cuda" else dict(CPU_REWRITE)
# Relative error against float64 that each input dtype may reach (as in eager: one rounding per op).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}

# PyTorch's own definition of each vocabulary activation.
TORCH_ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}


def compile_run(fn: Callable, *args: Any, options: dict | None = None, **compile_kwargs: Any):
    """Compile ``fn`` with the backend, run it once, return (output, reports of that compile)."""
    helion_backend.clear_reports()
    compiled = torch.compile(fn, backend="helion_inductor", options=dict(CPU_REWRITE if options is None else options),
                             **compile_kwargs)
    out = compiled(*args)
    return out, helion_backend.get_reports()


def sites(reports: list[GraphReport]) -> list[SiteReport]:
    return [s for r in reports for s in r.sites]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``ref`` in dB (inf when they are equal)."""
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())).item()


def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype)


class OpCalls:
    """Counts the fused op's executions (it is an extern call, so each one goes through dispatch)."""

    def __init__(self, monkeypatch) -> None:
        from helion_backend import dispatch

        self.epilogues: list[str] = []
        original = dispatch.run_gemm_epilogue
        signature = inspect.signature(original)

        def counting(*args, **kwargs):
            self.epilogues.append(signature.bind(*args, **kwargs).arguments["epilogue"])
            return original(*args, **kwargs)

        monkeypatch.setattr(dispatch, "run_gemm_epilogue", counting)

    @property
    def count(self) -> int:
        return len(self.epilogues)
