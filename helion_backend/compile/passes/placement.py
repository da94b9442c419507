"""Placement: where each matched site runs (Helion, the reference composite, or Inductor), up to which M, and
on what evidence from the config tables (:mod:`helion_backend.compile.placing`)."""

from __future__ import annotations

import logging

from helion_backend.compile import placing
from helion_backend.compile.context import PassContext
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.provenance import model_location
from helion_backend.vocabulary import dtype_name

log = logging.getLogger(__name__)


class PlacementPass(GraphPass):
    name = "placement"

    def run(self, ctx: PassContext) -> None:
        for site in ctx.sites:
            if site.rule is None:
                continue
            if site.rms_norm is not None:
                problem = placing.norm_unfusable(site, ctx.options.rmsnorm_prologue_max_m)
                if problem:
                    site.drop_prologue()
                    site.notes.append(f"RMSNorm not fused: {problem}")
            placed = placing.place(site, ctx, site.rule.kernel, site.n)
            site.runs_on, site.reason, site.max_helion_m = placed.runs_on, placed.why, placed.max_helion_m
            site.evidence, site.untuned = placed.evidence, placed.untuned
            if log.isEnabledFor(logging.DEBUG):
                log.debug("placement: %s m=%s k=%s n=%s %s (rule %s, kernel %s): %s up to M=%s%s",
                          model_location(site.anchor)[0] or site.anchor.name, site.m, site.k, site.n,
                          dtype_name(site.dtype), site.rule.name, site.rule.kernel, site.runs_on,
                          site.max_helion_m, f" ({site.reason})" if site.reason else "")
