"""Where a matched site, or a shared launch of sites, runs (Helion, the reference composite, or Inductor), up
to which M, and on what evidence from the config tables: what the placement and shared-input passes ask."""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import torch

from helion_backend import environment, tables
from helion_backend.compile.context import GemmSite, PassContext
from helion_backend.compile.recognize.patterns import gathered_input, reduce_scattered_output
from helion_backend.options import DEFAULT_NUM_TOKENS, UNTUNED_HELION, BackendOptions
from helion_backend.policy import NO_EVIDENCE, Decision
from helion_backend.semantics.norm import FUSED_DTYPES
from helion_backend.vocabulary import (
    EVIDENCE_CALIBRATED,
    EVIDENCE_EXACT,
    EVIDENCE_NONE,
    INT4_FAMILY,
    dtype_name,
)

log = logging.getLogger(__name__)

# The smallest K worth a GEMM kernel: one tensor-core dot step. Below it a "GEMM" is a few multiply-adds per
# output (a rotary embedding's ``inv_freq @ position_ids`` has K = 1), which Inductor computes as pointwise
# work fused with its neighbours; Helion 1.4 also mis-tiles a K of one (see ``kernels.gemm.check_gemm_shapes``).
MIN_KERNEL_K = 16


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


def norm_unfusable(site: GemmSite, max_m: int) -> str | None:
    """Why the kernels' fused norm (:mod:`helion_backend.semantics.norm`) should not run at this site, if it should not."""
    if site.dtype not in FUSED_DTYPES:
        return (f"{dtype_name(site.dtype)} rows times the norm's weight could overflow before the rows are scaled "
                f"(fused for {', '.join(map(dtype_name, FUSED_DTYPES))})")
    if site.static_m is not None and site.static_m > max_m:
        return (f"M={site.static_m} > rmsnorm_prologue_max_m={max_m} (the norm's own kernel is faster than every "
                "output tile taking its rows' statistics)")
    return None


class Placement(NamedTuple):
    """Where a site runs, why, and up to which M; the evidence of each M checked (M as text -> the
    :data:`~helion_backend.vocabulary.EVIDENCE` word); ``untuned``: kept off Helion (or sent to it untimed)
    for want of any measurement, so the tuner's manifest lists it."""

    runs_on: str
    why: str | None
    max_helion_m: int
    evidence: dict[str, str] = {}
    untuned: bool = False


def place(site: GemmSite, ctx: PassContext, kernel: str, n: int) -> Placement:
    """Where ``site``, run by the ``kernel`` family at width ``n``, runs: on CUDA, Helion for the Ms up to
    ``max_helion_size`` where the config tables measured Helion faster at the key or close enough to it
    (:mod:`helion_backend.policy`), else Inductor (or, for keys nothing close was measured at,
    as option ``untuned_sites`` says); the reference where Helion cannot run or on request off CUDA. A site
    that no kernel should run (:func:`_not_worth_a_kernel`), or that Inductor's micro-pipeline TP takes
    (:func:`_left_to_async_tp`), stays with Inductor whatever its M."""
    options = ctx.options
    not_worth = _not_worth_a_kernel(site, ctx) or _left_to_async_tp(site)
    if not_worth:
        return Placement("inductor", not_worth, 0)
    if site.device.type != "cuda":
        if options.rewrite_on_cpu:
            return Placement("reference", f"no Helion kernel on {site.device.type}: rewrite_on_cpu runs the "
                             "reference", options.max_helion_size)
        return Placement("inductor", f"{site.device.type} graph: left to Inductor (option rewrite_on_cpu "
                         "rewrites it to the reference)", options.max_helion_size)
    problem = environment.helion_unavailable_reason()
    if problem:
        return Placement("reference", problem, options.max_helion_size)
    placed = (_place_static_m(site.static_m, site, ctx, kernel, n) if site.static_m is not None
              else _place_dynamic_m(site, ctx, kernel, n))
    return placed._replace(why=f"{placed.why}{_tinygemm_note(site, ctx, kernel, n, placed)}")


def _tinygemm_note(site: GemmSite, ctx: PassContext, kernel: str, n: int, placed: Placement) -> str:
    """Where an int4 site with frozen weights runs tinygemm instead of its Helion config: the checked Ms on
    Helion whose table entry timed tinygemm faster (``tables.tinygemm_measured_faster``; the placement's
    lead there is tinygemm's where only tinygemm beat Inductor)."""
    if kernel != INT4_FAMILY or not ctx.options.frozen_weights or placed.runs_on != "helion":
        return ""
    checked = ([site.static_m] if site.static_m is not None
               else [m for m in DEFAULT_NUM_TOKENS if m <= placed.max_helion_m])
    at = [m for m in checked if tables.tinygemm_measured_faster(m, site.k, n, site.dtype, site.device,
                                                                 ctx.options.config_dir or None, kernel)]
    if not at:
        return ""
    return (f"; frozen weights: tinygemm (aten._weight_int4pack_mm, on a tiled copy of the weight) and one Helion "
            f"epilogue pass at M={', '.join(map(str, at))}, where the config table timed it faster")


def _decide(m: int, site: GemmSite, ctx: PassContext, kernel: str, n: int) -> Decision:
    decided = tables.placement_decision(m, site.k, n, site.dtype, site.device, ctx.options.config_dir, kernel)
    return NO_EVIDENCE if decided is None else _frozen_tinygemm(decided, m, site, ctx, kernel, n)


def _frozen_tinygemm(decided: Decision, m: int, site: GemmSite, ctx: PassContext, kernel: str, n: int) -> Decision:
    """``decided``, or for an int4 key with frozen weights whose own entry measured Inductor faster than Helion's
    config but tinygemm faster than Inductor, the fused op (which then runs tinygemm) with tinygemm's lead."""
    if (decided.helion or kernel != INT4_FAMILY or not ctx.options.frozen_weights
            or decided.evidence not in (EVIDENCE_EXACT, EVIDENCE_CALIBRATED)):
        return decided
    lead = tables.tinygemm_lead_over_fallback(m, site.k, n, site.dtype, site.device, ctx.options.config_dir or None,
                                              kernel)
    return decided if lead is None or lead <= 1 else dataclasses.replace(decided, helion=True, lead=lead)


def _untuned_on_helion(options: BackendOptions) -> str | None:
    """Why a key without evidence runs Helion anyway, if it does."""
    if options.autotune_missing:
        return "autotune_missing tunes it before the first run"
    if options.untuned_sites == UNTUNED_HELION:
        return f"untuned_sites={UNTUNED_HELION!r}: the default config, untimed"
    return None


def _place_static_m(m: int, site: GemmSite, ctx: PassContext, kernel: str, n: int) -> Placement:
    max_m = ctx.options.max_helion_size
    if m > max_m:
        return Placement("inductor", f"M={m} > max_helion_size={max_m}: cuBLAS + Inductor's epilogue", max_m)
    decided = _decide(m, site, ctx, kernel, n)
    evidence = {str(m): decided.evidence}
    if decided.evidence == EVIDENCE_NONE:
        anyway = _untuned_on_helion(ctx.options)
        if anyway:
            return Placement("helion", f"no config table entry at or close to M={m}, K={site.k}, N={n} (evidence "
                             f"none): {anyway}", max(m, max_m), evidence, untuned=True)
        return Placement("inductor", decided.describe(site.k, n, m), max_m, evidence, untuned=True)
    # Above its limit the fused op runs its fallback: a static M on Helion needs a limit of at least M.
    return Placement("helion" if decided.helion else "inductor", decided.describe(site.k, n, m), max(m, max_m),
                     evidence)


def _place_dynamic_m(site: GemmSite, ctx: PassContext, kernel: str, n: int) -> Placement:
    """Helion up to the largest checked M below which every checked M runs Helion (the tuned token counts
    and ``max_helion_size``): an M between two checked ones runs the config of the one above, measured
    faster at both; above the limit, the plain graph (the router) or cuBLAS."""
    max_m = ctx.options.max_helion_size
    anyway = _untuned_on_helion(ctx.options)
    checked = sorted(m for m in {*DEFAULT_NUM_TOKENS, max_m} if 1 <= m <= max_m)
    evidence: dict[str, str] = {}
    limit, stop = 0, None
    for m in checked:
        decided = _decide(m, site, ctx, kernel, n)
        evidence[str(m)] = decided.evidence
        if not (decided.helion or (decided.evidence == EVIDENCE_NONE and anyway)):
            stop = (m, decided)
            break
        limit = m
    untuned = EVIDENCE_NONE in evidence.values()
    if limit == 0:
        m, decided = stop if stop else (1, NO_EVIDENCE)
        return Placement("inductor", f"M is dynamic; at M={m}: {decided.describe(site.k, n, m)}", max_m,
                         evidence, untuned)
    why = f"M is dynamic: Helion when M <= {limit} at run time, cuBLAS above"
    if stop is not None:
        m, decided = stop
        why += f" (at M={m}: {decided.describe(site.k, n, m)})"
    elif untuned and anyway:
        why += f" (no config table entry at some M: {anyway})"
    return Placement("helion", why, limit, evidence, untuned)
