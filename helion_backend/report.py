"""What the backend did to each graph: ``report.json``, a human summary, and before/after dumps."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUNS_ON = ("helion", "reference", "inductor")  # where a site runs, in the order reports count them

_lock = threading.Lock()
_reports: list[GraphReport] = []
_graph_ids = itertools.count()


def new_graph_name() -> str:
    """A graph name no other report of this process has: ``graph_000``, ``graph_001``, ..."""
    return f"graph_{next(_graph_ids):03d}"


@dataclass
class SiteReport:
    rule: str
    anchor: str
    anchor_op: str
    prologue: list[str]
    epilogue: list[str]
    kernel: str
    runs_on: str  # "helion" | "reference" | "inductor"
    why: str | None
    m: int | str  # "dynamic" when the token dimension is symbolic
    k: int
    n: int
    dtype: str
    notes: list[str] = field(default_factory=list)
    # Run-time events: a Helion kernel that failed to compile or launch, and what ran instead.
    fallbacks: list[str] = field(default_factory=list)
    # The option verify's checks of the site's Helion output against its reference, one per M.
    verified: list[str] = field(default_factory=list)
    module: str = ""  # the nn.Module the GEMM belongs to ("layers.0.mlp.down_proj"), "" when unknown
    source: str = ""  # the model's source line that made it ("model.py:42"), "" when unknown
    # What the placement rests on at each M it checked (a static M, or the tuned token counts of a dynamic
    # one): M as text -> exact | calibrated | nearest | predicted | none (helion_backend.policy).
    evidence: dict[str, str] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The site as a user finds it in the model: module path and source line, then the FX node."""
        return _label(self.anchor, self.module, self.source)

    def evidence_summary(self) -> str:
        """``evidence exact`` for one M; ``evidence M=1-8 exact, M=16-32 none`` for several."""
        runs: list[list] = []  # [first M, last M, evidence]
        for m, word in self.evidence.items():
            if runs and runs[-1][2] == word:
                runs[-1][1] = m
            else:
                runs.append([m, m, word])
        if len(runs) == 1 and len(self.evidence) == 1:
            return f"evidence {runs[0][2]}"
        return "evidence " + ", ".join(f"M={a}{'' if a == b else f'-{b}'} {word}" for a, b, word in runs)


@dataclass
class AttentionReport:
    """A ``scaled_dot_product_attention`` node and where it runs (the decode attention kernel or Inductor)."""

    node: str
    op: str
    batch: int | str
    heads: int | str
    kv_heads: int | str  # fewer than ``heads`` with grouped-query attention
    rows: int | str  # query rows per head (the query length)
    kv_len: int | str
    head_dim: int | str
    dtype: str
    mask: str  # "none" | "bool" | "bias"; a boolean mask whose masked positions add a finite bias names it
    runs_on: str  # "helion" | "reference" | "inductor"
    why: str | None
    fallbacks: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    module: str = ""
    source: str = ""

    @property
    def label(self) -> str:
        return _label(self.node, self.module, self.source)

    def summary(self) -> str:
        where = self.runs_on + (f" ({self.why})" if self.why else "")
        return (f"  [decode_attention] {self.label}: {self.op.split('.')[1]} "
                f"B={self.batch} H={self.heads} "
                f"H_kv={self.kv_heads} rows={self.rows} L={self.kv_len} D={self.head_dim} {self.dtype} "
                f"mask={self.mask} -> {where}")


@dataclass
class UnfusedGemm:
    node: str
    op: str
    reason: str  # one line: what stopped it (with no rule applying, the nearest rule's objection)
    module: str = ""
    source: str = ""
    rules_tried: list[str] = field(default_factory=list)  # every rule's objection, nearest first

    @property
    def label(self) -> str:
        return _label(self.node, self.module, self.source, self.op)


@dataclass
class GraphReport:
    graph: str
    kind: str = "unknown"  # "inference" | "forward" | "backward"
    from_cache: bool = False  # True when Inductor's cache served the graph and this report was saved
    # Served from the cache: the graph's name in the compile that rewrote it, which its fused ops carry in their
    # site ids (``graph`` is a fresh name, unique in this process).
    cached_from: str | None = None
    error: str | None = None  # an analysis pass failed: nothing in the graph was rewritten
    sites: list[SiteReport] = field(default_factory=list)
    unfused_gemms: list[UnfusedGemm] = field(default_factory=list)
    attention: list[AttentionReport] = field(default_factory=list)
    # Custom ops not known to be capture-safe, run between the graph's CUDA graphs (option cudagraph_safe_ops).
    outside_cuda_graphs: list[str] = field(default_factory=list)
    # Keys of this graph's Helion sites autotuned before its first run (option autotune_missing), and how.
    autotuned: list[str] = field(default_factory=list)
    # What the direct CUDA-graph runner did with the compiled graph this graph is part of (option
    # cudagraph_runner="direct"): each capture, or why it runs without a CUDA graph.
    direct_cuda_graph: list[str] = field(default_factory=list)
    # With dumps on: the picture of the graph with its sites boxed, or how to get one (graph_drawing.py).
    picture: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GraphReport:
        return cls(
            graph=data["graph"],
            kind=data.get("kind", "unknown"),
            from_cache=data.get("from_cache", False),
            cached_from=data.get("cached_from"),
            error=data.get("error"),
            sites=[SiteReport(**s) for s in data.get("sites", [])],
            unfused_gemms=[UnfusedGemm(**u) for u in data.get("unfused_gemms", [])],
            attention=[AttentionReport(**a) for a in data.get("attention", [])],
            outside_cuda_graphs=list(data.get("outside_cuda_graphs", [])),
            autotuned=list(data.get("autotuned", [])),
            direct_cuda_graph=list(data.get("direct_cuda_graph", [])),
            picture=data.get("picture"),
        )

    @property
    def op_graph(self) -> str:
        """The graph name in the site ids of this graph's fused ops (:func:`site_id`)."""
        return self.cached_from or self.graph

    def served_from_cache(self) -> None:
        """Mark this saved report as the one of a graph Inductor's cache served: a fresh name, the old one kept."""
        self.from_cache = True
        self.cached_from = self.op_graph
        self.graph = new_graph_name()

    def runs_on_counts(self) -> dict[str, int]:
        """How many matched sites run where (helion / reference / inductor), in that order, zeros left out."""
        counts = {place: sum(s.runs_on == place for s in self.sites) for place in RUNS_ON}
        return {place: count for place, count in counts.items() if count}

    def headline(self) -> str:
        where = ", ".join(f"{count} {place}" for place, count in self.runs_on_counts().items())
        return (f"graph {self.graph} ({self.kind}{f', from FX graph cache: {self.cached_from}' if self.from_cache else ''}): "
                f"{len(self.sites)} site(s){f' ({where})' if where else ''}, "
                f"{len(self.unfused_gemms)} unfused GEMM(s)")

    def summary(self) -> str:
        lines = [self.headline()]
        if self.error:
            lines.append(f"  error (graph left to Inductor): {self.error}")
        for s in self.sites:
            chain = " -> ".join([*s.prologue, s.anchor_op.split(".")[1], *s.epilogue])
            where = f"{s.runs_on}" + (f" ({s.why})" if s.why else "")
            evidence = f" [{s.evidence_summary()}]" if s.evidence else ""
            lines.append(f"  [{s.rule}] {s.label}: {chain}  m={s.m} k={s.k} n={s.n} {s.dtype} -> {where}{evidence}")
            lines.extend(f"      note: {note}" for note in s.notes)
            lines.extend(f"      fallback: {event}" for event in s.fallbacks)
            lines.extend(f"      verified: {event}" for event in s.verified)
        for u in self.unfused_gemms:
            lines.append(f"  unfused {u.label}: {u.reason}")
        for a in self.attention:
            lines.append(a.summary())
            lines.extend(f"      fallback: {event}" for event in a.fallbacks)
            lines.extend(f"      verified: {event}" for event in a.verified)
        lines.extend(f"  outside CUDA graphs: {op} (a custom op not known to be capture-safe; the option "
                     "cudagraph_safe_ops vouches for it)" for op in self.outside_cuda_graphs)
        lines.extend(f"  autotuned at compile time: {key}" for key in self.autotuned)
        lines.extend(f"  direct CUDA graph: {event}" for event in self.direct_cuda_graph)
        if self.picture:
            lines.append(f"  picture: {self.picture}")
        return "\n".join(lines)


def _label(node: str, module: str, source: str, op: str = "") -> str:
    """``module (node, op, source)``; the node comes first where the graph kept no module path."""
    where = ", ".join(part for part in (node if module else "", op, source) if part)
    return f"{module or node}" + (f" ({where})" if where else "")


def dim_for_report(m: object) -> int | str:
    return m if isinstance(m, int) else "dynamic"


def record(report: GraphReport) -> None:
    with _lock:
        _reports.append(report)


def site_id(graph: str, anchor: str) -> str:
    """How the fused op names its site: unique among the reports of a process."""
    return f"{graph}:{anchor}"


def record_fallback(site: str, event: str) -> None:
    """Note a run-time fallback in the report of ``site`` (a :func:`site_id`), if it is still held."""
    _record_event(site, "fallbacks", event)


def record_verified(site: str, event: str) -> None:
    """Note the outcome of a self-check (option ``verify``) in the report of ``site``, if it is still held."""
    _record_event(site, "verified", event)


def find_site(site: str) -> SiteReport | AttentionReport | None:
    """The report entry of ``site`` (a :func:`site_id`), the latest where several graphs share the name."""
    with _lock:
        found = _entries(site)
    return found[-1] if found else None


def _record_event(site: str, events: str, event: str) -> None:
    """Append ``event`` to the ``events`` list of every report entry of ``site``, once."""
    with _lock:
        for entry in _entries(site):
            if event not in getattr(entry, events):
                getattr(entry, events).append(event)


def _entries(site: str) -> list[SiteReport | AttentionReport]:
    """The report entries that ``site`` names (the caller holds the lock)."""
    graph, _, anchor = site.partition(":")
    return [entry for report in _reports if report.op_graph == graph for entry in [*report.sites, *report.attention]
            if (entry.anchor if isinstance(entry, SiteReport) else entry.node) == anchor]


def get_reports() -> list[GraphReport]:
    """Reports of every graph compiled in this process, oldest first."""
    with _lock:
        return list(_reports)


def clear_reports() -> None:
    with _lock:
        _reports.clear()


def write_dump(directory: Path, report: GraphReport, before: str, after: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "before.py").write_text(before)
    (directory / "after.py").write_text(after)
    write_report(directory, report)


def write_report(directory: Path, report: GraphReport) -> None:
    """``summary.txt`` and ``report.json`` alone: rewritten when autotuning adds to a dumped report."""
    (directory / "summary.txt").write_text(report.summary() + "\n")
    (directory / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")

