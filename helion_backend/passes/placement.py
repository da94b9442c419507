"""Placement: where each matched site runs (Helion, the reference composite, or Inductor), and up to which M."""

from __future__ import annotations

import torch

from .. import dispatch
from ..norm import FUSED_DTYPES
from ..patterns import gathered_input, reduce_scattered_output
from ..vocabulary import dtype_name
from .context import GemmSite, PassContext

# The smallest K worth a GEMM kernel: one tensor-core dot step. Below it a "GEMM" is a few multiply-adds per
# output (a rotary embedding's ``inv_freq @ position_ids`` has K = 1), which Inductor computes as pointwise
# work fused with its neighbours; Helion 1.4 also mis-tiles a K of one (see ``kernels.gemm.check_gemm_shapes``).
MIN_KERNEL_K = 16


def run(ctx: PassContext) -> None:
    for site in ctx.sites:
        if site.rule is None:
            continue
        if site.rms_norm is not None:
            problem = _norm_unfusable(site, ctx.options.rmsnorm_prologue_max_m)
            if problem:
                site.drop_prologue()
                site.notes.append(f"RMSNorm not fused: {problem}")
        site.runs_on, site.reason, site.helion_limit = place(site, ctx, site.rule.kernel, site.n)


def _not_worth_a_kernel(site: GemmSite, ctx: PassContext) -> str | None:
    """Why the site stays with Inductor whatever its M, if it does: a K too short for a GEMM, or float32 rows
    that PyTorch multiplies in TF32 (the kernels dot float32 at full precision, and a site must compute what
    PyTorch computes)."""
    if isinstance(site.k, int) and site.k < MIN_KERNEL_K:
        return f"K={site.k} < {MIN_KERNEL_K}: a few multiply-adds per output, left to Inductor's pointwise code"
    if site.dtype == torch.float32 and ctx.tf32 and site.device.type == "cuda":
        return "float32 with TF32 allowed (torch.backends.cuda.matmul.allow_tf32): Inductor's TF32 GEMM, as PyTorch"
    return None


def _left_to_async_tp(site: GemmSite) -> str | None:
    """Why the site stays with Inductor where its micro-pipeline TP pass (``torch._inductor.config._micro_pipeline_tp``,
    which runs after this pipeline) would overlap the GEMM with its collective: a GEMM multiplying an
    all-gather's result, or one whose product is reduce-scattered. Fused here, it would find no such GEMM."""
    from torch._inductor import config

    if not getattr(config, "_micro_pipeline_tp", False):
        return None
    collective = gathered_input(site.anchor) or reduce_scattered_output(site.anchor)
    if collective is None:
        return None
    return (f"left to Inductor's micro-pipeline TP (_micro_pipeline_tp), which overlaps this GEMM with "
            f"{collective.name} ({collective.target})")


def _norm_unfusable(site: GemmSite, max_m: int) -> str | None:
    """Why the kernels' fused norm (:mod:`helion_backend.norm`) should not run at this site, if it should not."""
    if site.dtype not in FUSED_DTYPES:
        return (f"{dtype_name(site.dtype)} rows times the norm's weight could overflow before the rows are scaled "
                f"(fused for {', '.join(map(dtype_name, FUSED_DTYPES))})")
    if site.static_m is not None and site.static_m > max_m:
        return (f"M={site.static_m} > rmsnorm_prologue_max_m={max_m} (the norm's own kernel is faster than every "
                "output tile taking its rows' statistics)")
    return None


def place(site: GemmSite, ctx: PassContext, kernel: str, n: int) -> tuple[str, str | None, int]:
    """``(runs_on, why, helion_limit)`` of ``site`` run by the ``kernel`` family at width ``n``: Helion on
    CUDA for M up to the limit (the measured crossover of that family and shape, else
    ``max_helion_size``), the reference where asked, else Inductor. A static M up to ``max_helion_size``
    follows the config table's verdict at that M where it has one (:func:`dispatch.measured_verdict`). A site
    that no kernel should run (:func:`_not_worth_a_kernel`), or that Inductor's micro-pipeline TP takes
    (:func:`_left_to_async_tp`), stays with Inductor whatever its M."""
    not_worth = _not_worth_a_kernel(site, ctx) or _left_to_async_tp(site)
    if not_worth:
        return "inductor", not_worth, 0
    limit, lowered_by = dispatch.helion_size_limit(
        site.k, n, site.dtype, site.device, ctx.options.max_helion_size, ctx.options.config_dir, kernel,
    )
    bound = lowered_by or f"max_helion_size={limit}"
    if site.device.type == "cuda":
        if site.static_m is not None:
            placed = _place_static_m(site.static_m, site, ctx, kernel, n, limit, bound)
            if placed is not None:
                return placed
        problem = dispatch.helion_unavailable_reason()
        if problem:
            return "reference", problem, limit
        if site.static_m is None:
            return "helion", f"M is dynamic: Helion when M <= {limit} at run time, cuBLAS above", limit
        return "helion", None, limit
    if ctx.options.rewrite_on_cpu:
        return "reference", f"no Helion kernel on {site.device.type}: rewrite_on_cpu runs the reference", limit
    return "inductor", (
        f"{site.device.type} graph: left to Inductor (option rewrite_on_cpu rewrites it to the reference)"
    ), limit


def _place_static_m(m: int, site: GemmSite, ctx: PassContext, kernel: str, n: int, limit: int,
                    bound: str) -> tuple[str, str | None, int] | None:
    """Where the config table has a verdict at ``m`` (up to ``max_helion_size``), its winner; Helion above the
    crossover raises the fused op's limit to ``m`` (above its limit the op runs its fallback). Without a
    verdict, Inductor above the limit. None: place it as any M."""
    verdict = None
    if m <= ctx.options.max_helion_size:
        verdict = dispatch.measured_verdict(m, site.k, n, site.dtype, site.device, ctx.options.config_dir, kernel)
    if verdict is None:
        return ("inductor", f"M={m} > {bound}: cuBLAS + Inductor's epilogue", limit) if m > limit else None
    if not verdict.helion_wins:
        return "inductor", (f"cuBLAS + Inductor's epilogue measured faster at M={verdict.m}, K={site.k}, N={n} "
                            "(config table)"), limit
    if m > limit:  # (a verdict implies Helion is available: dispatch.measured_verdict)
        return "helion", (f"M={m} above the crossover M={limit}: Helion measured faster at M={verdict.m} "
                          "(config table)"), m
    return None
