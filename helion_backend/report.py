"""What the backend did to each graph: ``report.json``, a human summary, and before/after dumps."""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_lock = threading.Lock()
_reports: list[GraphReport] = []


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

    def summary(self) -> str:
        where = self.runs_on + (f" ({self.why})" if self.why else "")
        return (f"  [decode_attention] {self.node}: {self.op.split('.')[1]} B={self.batch} H={self.heads} "
                f"H_kv={self.kv_heads} rows={self.rows} L={self.kv_len} D={self.head_dim} {self.dtype} "
                f"mask={self.mask} -> {where}")


@dataclass
class UnfusedGemm:
    node: str
    op: str
    reason: str


@dataclass
class GraphReport:
    graph: str
    kind: str = "unknown"  # "inference" | "forward" | "backward"
    from_cache: bool = False  # True when Inductor's cache served the graph and this report was saved
    error: str | None = None  # an analysis pass failed: nothing in the graph was rewritten
    sites: list[SiteReport] = field(default_factory=list)
    unfused_gemms: list[UnfusedGemm] = field(default_factory=list)
    attention: list[AttentionReport] = field(default_factory=list)
    # Keys of this graph's Helion sites autotuned before its first run (option autotune_missing), and how.
    autotuned: list[str] = field(default_factory=list)
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
            error=data.get("error"),
            sites=[SiteReport(**s) for s in data.get("sites", [])],
            unfused_gemms=[UnfusedGemm(**u) for u in data.get("unfused_gemms", [])],
            attention=[AttentionReport(**a) for a in data.get("attention", [])],
            autotuned=list(data.get("autotuned", [])),
            picture=data.get("picture"),
        )

    def summary(self) -> str:
        lines = [f"graph {self.graph} ({self.kind}{', from FX graph cache' if self.from_cache else ''}): "
                 f"{len(self.sites)} fused site(s), {len(self.unfused_gemms)} unfused GEMM(s)"]
        if self.error:
            lines.append(f"  error (graph left to Inductor): {self.error}")
        for s in self.sites:
            chain = " -> ".join([*s.prologue, s.anchor_op.split(".")[1], *s.epilogue])
            where = f"{s.runs_on}" + (f" ({s.why})" if s.why else "")
            lines.append(f"  [{s.rule}] {s.anchor}: {chain}  m={s.m} k={s.k} n={s.n} {s.dtype} -> {where}")
            lines.extend(f"      note: {note}" for note in s.notes)
            lines.extend(f"      fallback: {event}" for event in s.fallbacks)
        for u in self.unfused_gemms:
            lines.append(f"  unfused {u.node} ({u.op}): {u.reason}")
        for a in self.attention:
            lines.append(a.summary())
            lines.extend(f"      fallback: {event}" for event in a.fallbacks)
        lines.extend(f"  autotuned at compile time: {key}" for key in self.autotuned)
        if self.picture:
            lines.append(f"  picture: {self.picture}")
        return "\n".join(lines)


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
    graph, _, anchor = site.partition(":")
    with _lock:
        for report in _reports:
            if report.graph == graph:
                for s in report.sites:
                    if s.anchor == anchor and event not in s.fallbacks:
                        s.fallbacks.append(event)
                for a in report.attention:
                    if a.node == anchor and event not in a.fallbacks:
                        a.fallbacks.append(event)


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

