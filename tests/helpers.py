"""Shared test helpers: compile with the backend on the CPU and read what it reported."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Collection, Iterable

import pytest
import torch
import torch.nn.functional as F

import helion_backend
from helion_backend.compile.rules import BUILTIN_RULES_DIR
from helion_backend.options import UNTUNED_HELION
from helion_backend.report import GraphReport, SiteReport

CPU_REWRITE = {"rewrite_on_cpu": True}
# The fp8/int8 per-token activation quantization in the Helion kernel's prologue (by default Inductor computes it).
QUANT_IN_KERNEL = {**CPU_REWRITE, "fuse_activation_quant": True}
# The RMSNorm prologue at every M the CPU tests use (by default it fuses only for one row).
NORMS_FUSED = {"rmsnorm_prologue_max_m": 64}
# The shipped rules without the gated MLP's (gate and up projections then stay two sites), with the CPU rewrite.
WITHOUT_GATED = {**CPU_REWRITE, "builtin_rules": False,
                 "rules": [str(p) for p in sorted(BUILTIN_RULES_DIR.glob("*.toml")) if p.name != "gated_mlp.toml"]}

# Where device-generic tests run, and how: on CUDA with the default options (the Helion kernels run),
# elsewhere with the CPU rewrite (the reference implementation runs).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# On CUDA the differential tests run the kernels at shapes no config table holds (which would otherwise stay
# with Inductor); on the CPU the sites run the reference.
DEVICE_OPTIONS: dict[str, object] = {"untuned_sites": UNTUNED_HELION} if DEVICE.type == "cuda" else dict(CPU_REWRITE)
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
    """Counts the fused ops' executions (extern calls, so each one goes through dispatch): ``epilogues``
    has one entry per site run (a shared launch runs several), ``launches`` one per op call."""

    def __init__(self, monkeypatch) -> None:
        from helion_backend.runtime import dispatch
        from helion_backend.semantics.epilogue import format_steps

        self.epilogues: list[str] = []
        self.launches = 0
        single, multi = dispatch.run_gemm_epilogue, dispatch.run_multi_gemm_epilogue

        def counting(run):
            def count(spec, *args, **kwargs):
                self.launches += 1
                self.epilogues += [format_steps(steps) for steps in spec.epilogues]
                return run(spec, *args, **kwargs)

            return count

        monkeypatch.setattr(dispatch, "run_gemm_epilogue", counting(single))
        monkeypatch.setattr(dispatch, "run_multi_gemm_epilogue", counting(multi))

    @property
    def count(self) -> int:
        return len(self.epilogues)


def slow_except(keep: Collection, values: Iterable) -> list:
    """``values`` for ``pytest.mark.parametrize`` with those not in ``keep`` marked ``slow``: the default run
    keeps a representative few, ``--runslow`` (and CI) runs them all. A tuple is one case of several arguments."""
    return [value if value in keep else pytest.param(*(value if isinstance(value, tuple) else (value,)),
                                                     marks=pytest.mark.slow)
            for value in values]


class Spread(list):
    """A dimension of :func:`diagonal` over several arguments: each of its values is a tuple of them."""


def diagonal(*dims: list) -> list:
    """The cases of the product of ``dims`` for a ``parametrize``, all marked ``slow`` but a diagonal that takes
    each value of each dimension at least once (case ``j`` takes each dimension's ``j``-th value, cycling): the
    default run keeps a few cases, ``--runslow`` runs them all."""
    fast = {tuple(dim[j % len(dim)] for dim in dims) for j in range(max(map(len, dims)))}

    def args(case: tuple) -> tuple:
        return tuple(arg for dim, value in zip(dims, case) for arg in (value if isinstance(dim, Spread) else (value,)))

    return [args(case) if case in fast else pytest.param(*args(case), marks=pytest.mark.slow)
            for case in itertools.product(*dims)]
