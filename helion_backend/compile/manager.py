"""The pass manager: one ``CustomGraphPass`` that runs the pipeline, reports what it did and records the
sites it sent to Helion in the manifest (:mod:`helion_backend.manifest`, what the tuner reads).

Its ``uuid()`` covers the package's own source code, the options that change the rewrite and the
content of every rule file, so Inductor's FX graph cache stays on and never serves a graph rewritten
under other rules or by other pass code (an edited install keeps its version number).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import time
from pathlib import Path

import sympy
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from helion_backend import logs, tables
from helion_backend.compile.context import (
    AttentionSite,
    GemmSite,
    PassContext,
    tf32_matmuls_allowed,
)
from helion_backend.compile.graph_drawing import GraphSketch, Picture, draw
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.passes import ANALYSIS, TRANSFORMS
from helion_backend.compile.provenance import model_location
from helion_backend.compile.rules import builtin_rule_files, load_rules, rules_digest
from helion_backend.compile.site_spec import spec_of
from helion_backend.environment import package_digest
from helion_backend.manifest import ManifestSite, record_sites
from helion_backend.options import BackendOptions
from helion_backend.report import (
    AttentionReport,
    GraphReport,
    SiteReport,
    UnfusedGemm,
    dim_for_report,
    new_graph_name,
    record,
    write_dump,
)
from helion_backend.version import __version__
from helion_backend.vocabulary import dtype_name

log = logging.getLogger(__name__)


class HelionPassManager(CustomGraphPass):
    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.rule_files = [*(builtin_rule_files() if options.builtin_rules else []), *map(Path, options.rules)]
        self.rules = sorted(load_rules(self.rule_files), key=lambda r: -r.priority)
        self.tf32 = tf32_matmuls_allowed()
        # The switches of the passes, read once here: the uuid covers the options that set them.
        self.analysis = [stage for stage in ANALYSIS if stage.enabled(options)]
        self.transforms = [stage for stage in TRANSFORMS if stage.enabled(options)]
        self._uuid = hashlib.sha256(
            json.dumps(
                {
                    "version": __version__,
                    "code": package_digest(),
                    "options": options.fingerprint(),
                    "rules": rules_digest(self.rule_files),
                    # The fused op reads user-tuned configs from here; their contents decide placement.
                    "config_dir": options.config_dir,
                    "placement": tables.placement_digest(options.config_dir),
                    "tf32": self.tf32,
                },
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()
        self.graph_kind = "unknown"
        # Custom ops of the graph being compiled that run between its CUDA graphs (:mod:`..cuda_graphs`).
        self.outside_cuda_graphs: list[str] = []
        self.reports: list[GraphReport] = []  # of the compile under way
        self.helion_sites: list[list[ManifestSite]] = []  # of each report's graph: what autotune_missing tunes
        # (before, after) of each report's graph where it was dumped: a cache hit replays them.
        self.dumps: list[tuple[str, str] | None] = []
        # (M expression, Helion limit) of rewritten sites whose token count is symbolic (for the router).
        self.dynamic_sites: list[tuple[sympy.Expr, int]] = []

    def uuid(self) -> str:
        return self._uuid

    def __call__(self, graph: fx.Graph) -> None:
        report = GraphReport(graph=new_graph_name(), kind=self.graph_kind,
                             outside_cuda_graphs=list(self.outside_cuda_graphs))
        dump_dirs = self._dump_dirs(report)
        graph_text = bool(dump_dirs) or logs.wants_graph_text()
        before = _readable(graph) if graph_text else ""
        sketch = GraphSketch.of(graph) if dump_dirs else None
        ctx = PassContext(graph=graph, options=self.options, rules=self.rules, report=report, tf32=self.tf32)
        trail = _PassTrail(ctx) if dump_dirs else None
        try:
            for stage in self.analysis:
                _run_pass(stage, ctx, trail)
        except Exception as e:  # a bug of ours must not fail a compile that plain Inductor would pass
            report.error = f"{stage.name}: {type(e).__name__}: {e}"
            log.warning("helion_inductor: %s failed on %s; the graph is left to Inductor unchanged",
                        report.error, report.graph, exc_info=True)
            ctx.sites.clear()
            ctx.attention.clear()
        for stage in self.transforms:
            _run_pass(stage, ctx, trail)
        _fill_report(ctx)
        picture = _picture(sketch, ctx) if sketch is not None else None
        report.picture = picture.note if picture is not None else None
        helion_sites = _helion_sites(ctx)
        record_sites(Path(self.options.manifest_path), helion_sites)
        self.dynamic_sites.extend(
            (site.m.node.expr, site.max_helion_m)
            for site in ctx.sites
            if site.fused is not None and site.static_m is None
        )
        after = _readable(graph) if graph_text else ""
        self.reports.append(report)
        self.helion_sites.append(helion_sites)
        self.dumps.append((before, after) if dump_dirs else None)
        record(report)
        for directory in dump_dirs:
            write_dump(directory, report, before, after)
            picture.write(directory)
            trail.write(directory / "passes")
        logs.publish(report, before, after)

    def _dump_dirs(self, report: GraphReport) -> list[Path]:
        """Where this graph's dumps go: the debug_dir option, and Inductor's debug folder when
        TORCH_COMPILE_DEBUG=1 is on."""
        dirs = [Path(self.options.debug_dir) / report.graph] if self.options.debug_dir else []
        inductor_dir = _inductor_debug_dir()
        if inductor_dir is not None:
            dirs.append(inductor_dir / "helion_inductor")
        return dirs


def _run_pass(stage: GraphPass, ctx: PassContext, trail: _PassTrail | None) -> None:
    """Run one pass, timed (logged at debug level) and, with dumps on, recorded for its own dump."""
    start = time.perf_counter()
    try:
        stage.run(ctx)
    finally:
        ms = (time.perf_counter() - start) * 1e3
        log.debug("helion_inductor: pass %s took %.2f ms on %s", stage.name, ms, ctx.report.graph)
        if trail is not None:
            trail.record(stage, ms)


class _PassTrail:
    """What each pass of one graph saw and left (the sites, and the graph where it changed), for the dumps:
    ``passes/NN_<name>.txt`` per pass. Built only with dumps on."""

    def __init__(self, ctx: PassContext) -> None:
        self.ctx = ctx
        self.states = [self._state()]
        self.records: list[tuple[str, float]] = []

    def _state(self) -> tuple[str, str]:
        return _sites_text(self.ctx), _readable(self.ctx.graph)

    def record(self, stage: GraphPass, ms: float) -> None:
        """The state ``stage`` left; a failure to describe it costs its dump, never the compile."""
        try:
            state = self._state()
        except Exception as e:
            log.warning("helion_inductor: cannot dump the %s pass of %s: %s", stage.name, self.ctx.report.graph, e)
            state = (f"not dumped ({type(e).__name__}: {e})", self.states[-1][1])
        self.records.append((stage.name, ms))
        self.states.append(state)

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for i, (name, ms) in enumerate(self.records):
            (sites_before, graph_before), (sites_after, graph_after) = self.states[i], self.states[i + 1]
            diff = "".join(difflib.unified_diff(graph_before.splitlines(keepends=True),
                                                graph_after.splitlines(keepends=True), "before", "after"))
            (directory / f"{i:02d}_{name}.txt").write_text(
                f"pass {name}: {ms:.2f} ms\n\n# sites before\n{sites_before}\n\n# sites after\n{sites_after}\n\n"
                f"# graph\n{diff or 'unchanged'}\n")


def _sites_text(ctx: PassContext) -> str:
    """One line per site: what the passes have decided about it so far."""
    lines = []
    for site in ctx.sites:
        steps = ", ".join(step.name for step in site.chain)
        prologue = ", ".join(step.name for step in site.prologue)
        group = f" group={site.group.family}x{len(site.group.sites)}" if site.group is not None else ""
        lines.append(f"{site.anchor.name}: rule={site.rule.name if site.rule else None} prologue=[{prologue}] "
                     f"chain=[{steps}] runs_on={site.runs_on} max_helion_m={site.max_helion_m}{group} "
                     f"reason={site.reason}")
    lines += [f"{site.node.name}: attention runs_on={site.runs_on} reason={site.reason}" for site in ctx.attention]
    return "\n".join(lines) or "(none)"


def _fill_report(ctx: PassContext) -> None:
    rules_tried: dict[fx.Node, list[str]] = {}
    for site in ctx.sites:
        if site.rule is None:
            ctx.unanchored.append((site.anchor, site.reason or "no rule applies"))
            rules_tried[site.anchor] = list(site.objections)
        else:
            ctx.report.sites.append(_site_report(site, ctx.report.graph))
    ctx.report.unfused_gemms.extend(
        UnfusedGemm(node.name, str(node.target), reason, *model_location(node), rules_tried.get(node, []))
        for node, reason in ctx.unanchored
    )
    ctx.report.attention.extend(map(_attention_report, ctx.attention))


def _helion_sites(ctx: PassContext) -> list[ManifestSite]:
    """The launches this graph sends to Helion, for the tuner's manifest: a shared launch once, keyed as its
    configs are (the sum of its widths, which it records too), with every site's epilogue in turn; each with
    its prologue (the shared launch's is its first site's: the sites share the activation and its norm).
    Also the launches kept off Helion only for want of a measurement of their key (evidence ``none``), up to
    ``max_helion_size``: tuning them is what would let a later compile place them on Helion."""
    launches = [(site, site.group) for site in ctx.sites
                if (site.runs_on == "helion" or site.untuned) and (site.group is None or site.group.sites[0] is site)]
    launches += [(group.sites[0], group) for group in ctx.untuned_groups]
    manifest = []
    for site, group in launches:
        spec = spec_of(site, ctx.report.graph, ctx.options.config_dir, group)
        members = group.sites if group is not None else [site]
        manifest.append(ManifestSite.declared(
            kernel=spec.kernel,
            epilogue=spec.steps,
            dtype=dtype_name(site.dtype),
            k=site.k,
            n=sum(member.n for member in members),
            m=site.static_m,
            max_helion_m=ctx.options.max_helion_size if site.untuned else spec.max_helion_m,
            prologue=spec.prologue,
            widths=[member.n for member in members] if len(members) > 1 else (),
        ))
    return manifest


def _site_report(site: GemmSite, graph: str) -> SiteReport:
    module, source = model_location(site.anchor, site.output)
    try:
        spec = spec_of(site, graph)
    except ValueError:  # a site its rewrite could not describe (the rewrite left it to Inductor, saying why)
        spec = None
    output = next(i for i, member in enumerate(site.group.sites) if member is site) if site.group is not None else 0
    return SiteReport(
        rule=site.rule.name,
        anchor=site.anchor.name,
        anchor_op=str(site.anchor.target),
        prologue=list(spec.prologue) if spec is not None else [s.name for s in site.prologue],
        epilogue=list(spec.epilogues[output]) if spec is not None else [s.name for s in site.steps],
        kernel=spec.kernel if spec is not None else site.rule.kernel,
        runs_on=site.runs_on,
        why=site.reason,
        evidence=dict(site.evidence),
        m=dim_for_report(site.m),
        k=site.k,
        n=site.n,
        dtype=dtype_name(site.dtype),
        notes=list(site.notes),
        module=module,
        source=source,
    )


def _attention_report(site: AttentionSite) -> AttentionReport:
    shape = [d if isinstance(d, int) else str(d) for d in site.shape]
    if len(shape) != 6:  # not 4-D attention: the reason says what it is
        shape = ["?"] * 6
    batch, heads, kv_heads, rows, kv_len, head_dim = shape
    module, source = model_location(site.node)
    return AttentionReport(node=site.node.name, op=str(site.node.target), batch=batch, heads=heads,
                           kv_heads=kv_heads, rows=rows, kv_len=kv_len, head_dim=head_dim,
                           dtype=dtype_name(site.dtype), mask=_mask_description(site), runs_on=site.runs_on,
                           why=site.reason, module=module, source=source)


def _mask_description(site: AttentionSite) -> str:
    """The mask kind, and for a boolean one whose masked positions get a finite bias (cuDNN's), that bias."""
    if site.mask_kind == "bool" and math.isfinite(site.masked_bias):
        return f"bool (masked positions add {site.masked_bias:g})"
    return site.mask_kind


def _picture(sketch: GraphSketch, ctx: PassContext) -> Picture:
    """The graph's picture for its dumps; a failure to draw costs the picture, never the compile."""
    try:
        return draw(sketch, ctx)
    except Exception as e:
        log.warning("helion_inductor: cannot draw %s: %s", ctx.report.graph, e, exc_info=True)
        return Picture(note=f"not drawn ({type(e).__name__}: {e})")


def _readable(graph: fx.Graph) -> str:
    module = graph.owning_module
    if module is not None:
        return module.print_readable(print_output=False)
    return str(graph)


def _inductor_debug_dir() -> Path | None:
    from torch._inductor import config
    from torch._inductor.virtualized import V

    if not config.trace.enabled:
        return None
    path = getattr(V.debug, "_path", None)
    return Path(path) if path else None
