"""The pass manager: one ``CustomGraphPass`` that runs the pipeline, reports what it did and records the
sites it sent to Helion in the manifest (:mod:`helion_backend.manifest`, what the tuner reads).

Its ``uuid()`` covers the package's own source code, the options that change the rewrite and the
content of every rule file, so Inductor's FX graph cache stays on and never serves a graph rewritten
under other rules or by other pass code (an edited install keeps its version number).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from pathlib import Path

import sympy
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .. import __version__, dispatch, logs
from ..graph_drawing import GraphSketch, Picture, draw
from ..manifest import ManifestSite, record_sites
from ..options import BackendOptions
from ..report import (
    AttentionReport,
    GraphReport,
    SiteReport,
    UnfusedGemm,
    dim_for_report,
    new_graph_name,
    record,
    write_dump,
)
from ..rules import builtin_rule_files, load_rules, rules_digest
from ..vocabulary import dtype_name
from . import ANALYSIS, TRANSFORMS
from .context import AttentionSite, GemmSite, PassContext, SiteGroup, tf32_matmuls_allowed
from .provenance import model_location

log = logging.getLogger(__name__)


def source_digest(root: Path) -> str:
    """sha256 of the Python sources under ``root`` (paths and contents, in a stable order)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache  # once per process: the sources do not change under a running compile
def package_digest() -> str:
    """The digest of this package's sources: the passes decide what a cached graph holds."""
    return source_digest(Path(__file__).resolve().parents[1])


class HelionPassManager(CustomGraphPass):
    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.rule_files = [*(builtin_rule_files() if options.builtin_rules else []), *map(Path, options.rules)]
        self.rules = sorted(load_rules(self.rule_files), key=lambda r: -r.priority)
        self.tf32 = tf32_matmuls_allowed()
        self._uuid = hashlib.sha256(
            json.dumps(
                {
                    "version": __version__,
                    "code": package_digest(),
                    "options": options.fingerprint(),
                    "rules": rules_digest(self.rule_files),
                    # The fused op reads user-tuned configs from here; their contents decide placement.
                    "config_dir": options.config_dir,
                    "placement": dispatch.placement_digest(options.config_dir),
                    "tf32": self.tf32,
                },
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()
        self.graph_kind = "unknown"
        self.reports: list[GraphReport] = []  # of the compile under way
        self.helion_sites: list[list[ManifestSite]] = []  # of each report's graph: what autotune_missing tunes
        # (before, after) of each report's graph where it was dumped: a cache hit replays them.
        self.dumps: list[tuple[str, str] | None] = []
        # (M expression, Helion limit) of rewritten sites whose token count is symbolic (for the router).
        self.dynamic_sites: list[tuple[sympy.Expr, int]] = []

    def uuid(self) -> str:
        return self._uuid

    def __call__(self, graph: fx.Graph) -> None:
        report = GraphReport(graph=new_graph_name(), kind=self.graph_kind)
        dump_dirs = self._dump_dirs(report)
        graph_text = bool(dump_dirs) or logs.wants_graph_text()
        before = _readable(graph) if graph_text else ""
        sketch = GraphSketch.of(graph) if dump_dirs else None
        ctx = PassContext(graph=graph, options=self.options, rules=self.rules, report=report, tf32=self.tf32)
        try:
            for stage in ANALYSIS:
                stage.run(ctx)
        except Exception as e:  # a bug of ours must not fail a compile that plain Inductor would pass
            report.error = f"{stage.__name__.rsplit('.', 1)[-1]}: {type(e).__name__}: {e}"
            log.warning("helion_inductor: %s failed on %s; the graph is left to Inductor unchanged",
                        report.error, report.graph, exc_info=True)
            ctx.sites.clear()
            ctx.attention.clear()
        for stage in TRANSFORMS:
            stage.run(ctx)
        _fill_report(ctx)
        picture = _picture(sketch, ctx) if sketch is not None else None
        report.picture = picture.note if picture is not None else None
        helion_sites = _helion_sites(ctx)
        record_sites(Path(self.options.manifest_path), helion_sites)
        self.dynamic_sites.extend(
            (site.m.node.expr, site.helion_limit)
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
        logs.publish(report, before, after)

    def _dump_dirs(self, report: GraphReport) -> list[Path]:
        """Where this graph's dumps go: the debug_dir option, and Inductor's debug folder when
        TORCH_COMPILE_DEBUG=1 is on."""
        dirs = [Path(self.options.debug_dir) / report.graph] if self.options.debug_dir else []
        inductor_dir = _inductor_debug_dir()
        if inductor_dir is not None:
            dirs.append(inductor_dir / "helion_inductor")
        return dirs


def _fill_report(ctx: PassContext) -> None:
    rules_tried: dict[fx.Node, list[str]] = {}
    for site in ctx.sites:
        if site.rule is None:
            ctx.unanchored.append((site.anchor, site.reason or "no rule applies"))
            rules_tried[site.anchor] = list(site.objections)
        else:
            ctx.report.sites.append(_site_report(site))
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
    launches = [(site, site.group or SiteGroup([site], site.rule.kernel)) for site in ctx.sites
                if (site.runs_on == "helion" or site.untuned) and (site.group is None or site.group.sites[0] is site)]
    launches += [(group.sites[0], group) for group in ctx.untuned_groups]
    return [
        ManifestSite.declared(
            kernel=launch.family,
            epilogue=[s.name for member in launch.sites for s in member.steps],
            dtype=dtype_name(site.dtype),
            k=site.k,
            n=sum(member.n for member in launch.sites),
            m=site.static_m,
            helion_limit=ctx.options.max_helion_size if site.untuned else site.helion_limit,
            prologue=[s.name for s in site.prologue],
            widths=[member.n for member in launch.sites] if len(launch.sites) > 1 else (),
        )
        for site, launch in launches
    ]


def _kernel(site: GemmSite) -> str:
    """The kernel family that runs the site: its rule's, or the shared launch's."""
    return site.group.family if site.group is not None else site.rule.kernel


def _site_report(site: GemmSite) -> SiteReport:
    module, source = model_location(site.anchor, site.output)
    return SiteReport(
        rule=site.rule.name,
        anchor=site.anchor.name,
        anchor_op=str(site.anchor.target),
        prologue=[s.name for s in site.prologue],
        epilogue=[s.name for s in site.steps],
        kernel=_kernel(site),
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
