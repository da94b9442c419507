"""A picture of what fused: the post-grad graph before the rewrite, each site's nodes in a labelled box.

Written as ``graph.svg`` beside a graph's dumps (option ``debug_dir``, or ``TORCH_COMPILE_DEBUG``). The graph
is built with pydot and laid out by Graphviz's ``dot``, as ``torch.fx.passes.graph_drawer.FxGraphDrawer``
does; that drawer is not reused because it boxes nodes only by Inductor's ``buf_meta`` and labels each node
with its full argument record (no shapes from the post-grad ``val``), which makes a decoder's graph unreadable.
Both pydot and ``dot`` are optional (the ``viz`` extra, Graphviz from the OS): without them the report says how
to get the picture.

The pass manager takes a :class:`GraphSketch` before the rewrite (the rewrite erases the sites' nodes) and
draws it once the report is final (a failed rewrite changes where a site runs).
"""

from __future__ import annotations

import functools
import html
import importlib.util
import shutil
import subprocess
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from helion_backend.vocabulary import dtype_name

if TYPE_CHECKING:
    from helion_backend.compile.context import AttentionSite, GemmSite, PassContext

PICTURE_FILE = "graph.svg"
DOT_FILE = "graph.dot"  # written instead when ``dot`` fails or takes too long, to render by hand
INSTALL_HINT = (f"no {PICTURE_FILE}: pip install 'helion-inductor[viz]' (pydot) and Graphviz's dot "
                "(apt-get install graphviz, brew install graphviz) to draw the graph with its sites boxed")
# Graphviz's layout time grows faster than the node count: a graph above this many nodes, or one ``dot`` does
# not lay out in the time, keeps its DOT source (an eight-layer decoder, about 900 nodes, takes seconds).
MAX_LAID_OUT_NODES = 2500
DOT_TIMEOUT_S = 60.0
_LABEL_WIDTH = 64  # characters per line of a box's label
_REASON_LINES = 3  # a longer reason is cut (the box's tooltip has all of it)

# Fill and border colours by where a box runs; a GEMM no rule takes gets its own.
_STYLES: dict[str, tuple[str, str, str]] = {  # runs_on -> (fill, border, style)
    "helion": ("#e6f4ea", "#1e8e3e", "rounded,filled,bold"),
    "reference": ("#fef7e0", "#e37400", "rounded,filled,bold"),
    "inductor": ("#f1f3f4", "#5f6368", "rounded,filled,dashed"),
    "unfused": ("#fce8e6", "#d93025", "rounded,filled,dashed"),
    "launch": ("#e8f0fe", "#1a73e8", "rounded,filled,bold"),
}
_LEGEND = (  # style -> what its box means
    ("helion", "a Helion kernel"),
    ("reference", "the reference implementation (no Helion kernel on this device)"),
    ("launch", "one launch for several sites"),
    ("inductor", "matched, left to Inductor (dashed)"),
    ("unfused", "a GEMM no rule takes (dashed)"),
)
_VIEWS = frozenset({torch.ops.aten.permute.default, torch.ops.aten.t.default})


@dataclass(frozen=True)
class NodeSketch:
    """What the picture shows of one FX node."""

    name: str
    op: str
    label: str
    tooltip: str
    inputs: tuple[str, ...]
    # A transpose read by one node only: a site's kernel reading the weight through it absorbs it.
    private_view: bool = False


@dataclass(frozen=True)
class GraphSketch:
    """The graph's nodes and edges as plain data, taken before the rewrite changes the graph."""

    nodes: tuple[NodeSketch, ...]

    @classmethod
    def of(cls, graph: fx.Graph) -> GraphSketch:
        return cls(tuple(_sketch(node) for node in graph.nodes))

    def inputs(self, name: str) -> tuple[str, ...]:
        return self._by_name[name].inputs if name in self._by_name else ()

    def private_views(self, names: Iterable[str]) -> list[str]:
        """The private transposes that the nodes ``names`` read."""
        return [i for name in names for i in self.inputs(name) if self._by_name[i].private_view]

    @functools.cached_property
    def _by_name(self) -> dict[str, NodeSketch]:
        return {node.name: node for node in self.nodes}


@dataclass
class Region:
    """One box of the picture: a site, a shared launch holding its sites' boxes, or an unfused GEMM."""

    style: str  # a key of ``_STYLES``
    title: str
    detail: str  # where it runs, or why not
    nodes: list[str]  # node names
    children: list[Region] = field(default_factory=list)


@dataclass(frozen=True)
class Picture:
    """The rendered picture (or the DOT source that could not be rendered) and the report's line about it."""

    note: str
    svg: bytes | None = None
    dot: str | None = None

    def write(self, directory: Path) -> None:
        if self.svg is not None:
            (directory / PICTURE_FILE).write_bytes(self.svg)
        elif self.dot is not None:
            (directory / DOT_FILE).write_text(self.dot)


def graphviz_dot() -> str | None:
    """Graphviz's ``dot`` program, if it is on PATH."""
    return shutil.which("dot")


def drawing_available() -> bool:
    """Whether pydot imports and Graphviz's ``dot`` is on PATH."""
    return importlib.util.find_spec("pydot") is not None and graphviz_dot() is not None


def draw(sketch: GraphSketch, ctx: PassContext) -> Picture:
    """The picture of ``sketch`` with the sites ``ctx`` holds boxed, or the note saying how to get it."""
    dot = graphviz_dot()
    if dot is None or importlib.util.find_spec("pydot") is None:
        return Picture(note=INSTALL_HINT)
    title = f"{ctx.report.graph} ({ctx.report.kind}) before the rewrite"
    source = to_dot(sketch, site_regions(ctx, sketch), title=title)
    render = f"dot -Tsvg {DOT_FILE} -o {PICTURE_FILE}"
    if len(sketch.nodes) > MAX_LAID_OUT_NODES:
        return Picture(note=f"{DOT_FILE} ({len(sketch.nodes)} nodes, not laid out at compile time: {render})",
                       dot=source)
    try:
        svg = subprocess.run([dot, "-Tsvg"], input=source.encode(), capture_output=True,
                             timeout=DOT_TIMEOUT_S, check=True).stdout
    except subprocess.TimeoutExpired:
        return Picture(note=f"{DOT_FILE} (dot took over {DOT_TIMEOUT_S:g} s: {render})", dot=source)
    except (OSError, subprocess.CalledProcessError) as e:
        error = e.stderr.decode(errors="replace").strip() if isinstance(e, subprocess.CalledProcessError) else e
        return Picture(note=f"{DOT_FILE} (dot failed: {error})", dot=source)
    return Picture(note=f"{PICTURE_FILE} (the graph before the rewrite, each site boxed)", svg=svg)


def site_regions(ctx: PassContext, sketch: GraphSketch) -> list[Region]:
    """The boxes of a graph: each site (a shared launch's inside the launch's box), each attention site,
    each GEMM that no rule takes."""
    regions: list[Region] = []
    launches: dict[int, Region] = {}
    for site in ctx.sites:
        if site.rule is None:
            continue
        region = _gemm_region(site, sketch)
        group = site.group
        if group is None:
            regions.append(region)
            continue
        if id(group) not in launches:
            members = ", ".join(s.anchor.name for s in group.sites)
            launches[id(group)] = Region("launch", f"one launch: {group.family}", members, [])
            regions.append(launches[id(group)])
        launches[id(group)].children.append(region)
    for launch in launches.values():
        _lift_shared_nodes(launch)
    regions.extend(map(_attention_region, ctx.attention))
    regions.extend(Region("unfused", f"{node.name}: not fused", reason, [node.name]) for node, reason in ctx.unanchored)
    return regions


def to_dot(sketch: GraphSketch, regions: Sequence[Region], title: str) -> str:
    """The DOT source of the picture (each node drawn once: in the first box that claims it)."""
    import pydot

    graph = pydot.Dot("fused_sites", graph_type="digraph", rankdir="TB", newrank="true",
                      fontname="Helvetica", fontsize="12", labelloc="t", labeljust="l",
                      label=_title_label(title), nodesep="0.2", ranksep="0.3",
                      # One pass of network simplex per node for the x positions: without the limit, a decoder's
                      # long residual and weight edges take minutes to place, for a picture barely better.
                      nslimit="1")
    graph.set_node_defaults(shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10",
                            fillcolor="#f8f9fa", color="#9aa0a6", margin="0.08,0.03")
    graph.set_edge_defaults(color="#80868b", arrowsize="0.6")
    known = {node.name: node for node in sketch.nodes}
    drawn: set[str] = set()
    for i, region in enumerate(regions):
        graph.add_subgraph(_cluster(pydot, region, f"r{i}", known, drawn))
    for node in sketch.nodes:
        if node.name not in drawn:
            graph.add_node(_node(pydot, node, inside=False))
    for node in sketch.nodes:
        for source in dict.fromkeys(node.inputs):
            graph.add_edge(pydot.Edge(_id(source), _id(node.name)))
    return graph.to_string()


def _cluster(pydot: Any, region: Region, key: str, known: dict[str, NodeSketch], drawn: set[str]) -> Any:
    fill, border, style = _STYLES[region.style]
    cluster = pydot.Cluster(key, label=_html_label(region), tooltip=_text(f"{region.title}: {region.detail}"),
                            style=style, fillcolor=fill, color=border, penwidth="2", fontsize="11",
                            fontname="Helvetica", labeljust="l", margin="10")
    for j, child in enumerate(region.children):
        cluster.add_subgraph(_cluster(pydot, child, f"{key}_{j}", known, drawn))
    for name in region.nodes:
        if name in known and name not in drawn:
            drawn.add(name)
            cluster.add_node(_node(pydot, known[name], inside=True))
    return cluster


def _node(pydot: Any, node: NodeSketch, inside: bool) -> Any:
    fill = "#ffffff" if inside else {"placeholder": "#e8eef7", "output": "#dbe9f6"}.get(node.op, "#f8f9fa")
    return pydot.Node(_id(node.name), label=_text(node.label), tooltip=_text(node.tooltip), fillcolor=fill,
                      shape="ellipse" if node.op in ("placeholder", "output") else "box")


def _gemm_region(site: GemmSite, sketch: GraphSketch) -> Region:
    anchor_op = _target_name(site.anchor.target).removeprefix("aten.")
    chain = " -> ".join([*(s.name for s in site.prologue), anchor_op, *(s.name for s in site.steps)])
    kernel = site.group.family if site.group is not None else site.rule.kernel
    title = f"[{site.rule.name}] {site.anchor.name}: {chain}"
    shape = f"M={_dim(site.m)} K={site.k} N={site.n} {dtype_name(site.dtype)}"
    where = f"kernel {kernel}, runs on {site.runs_on}" if site.runs_on != "inductor" else "left to Inductor"
    detail = f"{shape}; {where}" + (f" ({site.reason})" if site.reason else "")
    return Region(site.runs_on, title, detail, _gemm_nodes(site, sketch))


def _gemm_nodes(site: GemmSite, sketch: GraphSketch) -> list[str]:
    """The nodes one site's kernel computes: its anchor (and a gated MLP's up projection), its prologue, its
    epilogue, and a weight's transpose it reads through."""
    steps = [*site.prologue, *site.chain, *site.up_steps]
    anchors = [site.anchor.name, *([site.up_anchor.name] if site.up_anchor is not None else [])]
    nodes = [*anchors, *(n.name for step in steps for n in step.nodes)]
    if site.rms_norm is not None and site.rms_norm.view is not None:
        nodes.append(site.rms_norm.view.name)
    return list(dict.fromkeys([*nodes, *sketch.private_views(anchors)]))


def _lift_shared_nodes(launch: Region) -> None:
    """Nodes that several sites of one launch claim (their shared RMSNorm or quantization) belong to the launch."""
    counts: dict[str, int] = {}
    for child in launch.children:
        for node in child.nodes:
            counts[node] = counts.get(node, 0) + 1
    shared = [node for node, count in counts.items() if count > 1]
    launch.nodes = shared
    for child in launch.children:
        child.nodes = [node for node in child.nodes if counts[node] == 1]


def _attention_region(site: AttentionSite) -> Region:
    where = f"kernel decode_attention, runs on {site.runs_on}" if site.runs_on != "inductor" else "left to Inductor"
    detail = where + (f" ({site.reason})" if site.reason else "")
    return Region(site.runs_on, f"{site.node.name}: attention", detail, [site.node.name, site.output.name])


def _sketch(node: fx.Node) -> NodeSketch:
    value = _value_text(node.meta.get("val"))
    if node.op == "call_function":
        what = _target_name(node.target)
    elif node.op == "placeholder":  # drawn as an ellipse: its name and value say enough
        what = ""
    else:
        what = f"{node.op} {node.target}" if node.op != "output" else ""
    label = "\\n".join(dict.fromkeys(part for part in (node.name, what, value) if part))
    return NodeSketch(node.name, node.op, label, node.format_node() or node.name,
                      tuple(arg.name for arg in node.all_input_nodes),
                      private_view=node.target in _VIEWS and len(node.users) == 1)


def _target_name(target: object) -> str:
    """``aten.mm`` for ``aten.mm.default``; a Python function's own name."""
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        return name.removesuffix(".default")
    return getattr(target, "__name__", str(target))


def _value_text(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{dtype_name(value.dtype)}[{', '.join(str(d) for d in value.shape)}]"
    if isinstance(value, (list, tuple)):
        return " ".join(text for text in map(_value_text, value) if text)
    if isinstance(value, torch.SymInt):
        return f"int {value}"
    return ""


def _dim(m: object) -> str:
    return str(m) if isinstance(m, int) else f"{m} (dynamic)"


def _title_label(title: str) -> str:
    """The picture's title, and a legend line per box colour in that colour."""
    legend = "".join(f'<FONT COLOR="{_STYLES[style][1]}">&#9632;</FONT> {html.escape(meaning)}<BR ALIGN="LEFT"/>'
                     for style, meaning in _LEGEND)
    return f'<<FONT POINT-SIZE="16"><B>{html.escape(title)}</B></FONT><BR ALIGN="LEFT"/>{legend}>'


def _html_label(region: Region) -> str:
    """The box's title in bold and its detail below, left-aligned (Graphviz's HTML-like label)."""
    lines = [f"<B>{html.escape(region.title)}</B>", *map(html.escape, _wrapped(region.detail))]
    return "<" + "".join(f'{line}<BR ALIGN="LEFT"/>' for line in lines) + ">"


def _wrapped(text: str) -> Iterable[str]:
    lines = textwrap.wrap(text, _LABEL_WIDTH) or [""]
    if len(lines) > _REASON_LINES:
        lines = [*lines[:_REASON_LINES - 1], lines[_REASON_LINES - 1][:_LABEL_WIDTH - 2] + " …"]
    return lines


def _text(text: str) -> str:
    """A string as a DOT attribute value: quoted, with backslashes kept only as the line breaks we write."""
    escaped = text.replace("\\n", "\0").replace("\\", "/").replace('"', '\\"').replace("\0", "\\n")
    return f'"{escaped}"'


def _id(name: str) -> str:
    return f'"{name}"'
