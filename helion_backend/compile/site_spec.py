"""The :class:`~helion_backend.gemm_spec.GemmSpec` of a matched site: what the rewrite hands the fused op, and
what the manifest and the report read about the site's launch."""

from __future__ import annotations

from helion_backend.compile.context import GemmSite, SiteGroup
from helion_backend.compile.recognize.patterns import val
from helion_backend.report import site_id
from helion_backend.semantics.gemm_spec import GemmSpec


def spec_of(site: GemmSite, graph: str, config_dir: str = "", group: SiteGroup | None = None,
            frozen_weights: bool = False) -> GemmSpec:
    """The launch that runs ``site`` (with a rule): its own, or the shared launch of its group (``group``,
    by default the one it was placed in), named after the first site of the group in graph ``graph``;
    ``frozen_weights`` is the option's."""
    assert site.rule is not None, site
    group = group or site.group
    sites = group.sites if group is not None else [site]
    leader = sites[0]
    norm = leader.rms_norm
    single = group is None
    steps = [step for member in sites for step in member.steps]
    up_steps = site.up_steps if single else []
    return GemmSpec(
        kernel=site.rule.kernel if single else group.family,
        out_dtype=val(leader.output).dtype,
        weight_layouts=tuple(member.weight_layout for member in sites),
        epilogues=tuple(tuple(step.name for step in member.steps) for member in sites),
        # Every output's scalars in turn, then the up projection's own steps' (a quantized gated MLP).
        scalars=tuple(step.scalar for step in [*steps, *up_steps] if step.scalar is not None),
        prologue=tuple(step.name for step in leader.prologue),
        quant_program=leader.quant_program if single else None,
        up_layout=site.up_layout if single and site.up_weight is not None else None,
        up_epilogue=tuple(step.name for step in up_steps),
        norm=norm.spec if norm is not None else None,
        max_helion_m=leader.max_helion_m,
        config_dir=config_dir,
        site=site_id(graph, leader.anchor.name),
        frozen_weights=frozen_weights,
    )
