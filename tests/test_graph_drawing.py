"""The dumps' picture: ``graph.svg`` draws the graph before the rewrite with each site's nodes in a labelled
box, and without pydot or Graphviz the report says how to get it. The compiles run without Inductor's caches:
a cached graph runs no pass, and the patches here are invisible to the cache key."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import CPU_REWRITE, compile_run, randn, rel_err

from helion_backend.compile import graph_drawing

SVG = "{http://www.w3.org/2000/svg}"
needs_graphviz = pytest.mark.skipif(
    not graph_drawing.drawing_available(),
    reason="needs pydot and Graphviz's dot (pip install pydot; apt-get install graphviz)")


def model(x, w1, b1, wq, wk, wv, ints, w_ints, short, w_short, h, w_gate, w_up):
    """One site of each kind: a bias + SiLU linear (the reference on CPU), three projections of its result in
    one launch, an int32 mm that no rule takes, a K=4 GEMM left to Inductor (too short for a kernel), and a
    gated MLP (its up projection runs in the gate's kernel)."""
    y = F.silu(F.linear(x, w1, b1))
    q, k, v = F.linear(y, wq), F.linear(y, wk), F.linear(y, wv)
    gated = F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)
    return q, k, v, torch.mm(ints, w_ints), torch.relu(short @ w_short), gated


def inputs():
    ints = torch.randint(-4, 4, (4, 8), dtype=torch.int32)
    return (randn(4, 32), randn(48, 32), randn(48), randn(16, 48), randn(8, 48), randn(8, 48), ints,
            torch.randint(-4, 4, (8, 8), dtype=torch.int32), randn(4, 4), randn(4, 24), randn(4, 32), randn(64, 32),
            randn(64, 32))


def boxes(svg: Path) -> dict[str, tuple[str, tuple[float, float, float, float]]]:
    """Each box (SVG cluster) of the picture: its label's text and its bounding box, by its first label line."""
    found = {}
    for group in ET.parse(svg).getroot().iter(f"{SVG}g"):
        if group.get("class") != "cluster":
            continue
        lines = [t.text or "" for t in group.iter(f"{SVG}text")]
        outline = next(e for e in group.iter() if e.tag in (f"{SVG}path", f"{SVG}polygon"))
        numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", outline.get("d") or outline.get("points"))]
        xs, ys = numbers[0::2], numbers[1::2]
        found[lines[0]] = (" ".join(lines), (min(xs), min(ys), max(xs), max(ys)))
    return found


def node_centres(svg: Path) -> dict[str, tuple[float, float]]:
    centres = {}
    for group in ET.parse(svg).getroot().iter(f"{SVG}g"):
        if group.get("class") == "node":
            text = next(group.iter(f"{SVG}text"))
            centres[group.find(f"{SVG}title").text] = (float(text.get("x")), float(text.get("y")))
    return centres


def inside(point: tuple[float, float], box: tuple[float, float, float, float]) -> bool:
    return box[0] <= point[0] <= box[2] and box[1] <= point[1] <= box[3]


@needs_graphviz
def test_the_picture_boxes_each_site_with_its_kernel_and_where_it_runs(tmp_path, no_compile_caches):
    args = inputs()
    out, (report,) = compile_run(model, *args, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    for got, expected in zip(out, model(*(a.double() if a.is_floating_point() else a for a in args))):
        assert rel_err(got, expected) < 1e-5
    svg = tmp_path / report.graph / graph_drawing.PICTURE_FILE
    assert report.picture.startswith(graph_drawing.PICTURE_FILE)
    assert f"picture: {graph_drawing.PICTURE_FILE}" in (svg.parent / "summary.txt").read_text()

    activation = next(s for s in report.sites if s.epilogue == ["bias", "silu"])
    projections = [s for s in report.sites if s.kernel == "gemm_multi"]
    short = next(s for s in report.sites if s.k == 4)
    (unfused,) = report.unfused_gemms
    assert len(projections) == 3 and short.runs_on == "inductor", report.summary()

    found = boxes(svg)
    label, box = found[f"[{activation.rule}] {activation.anchor}: addmm -> bias -> silu"]
    assert f"kernel {activation.kernel}, runs on reference" in label
    launch_label, launch = found["one launch: gemm_multi"]
    assert ", ".join(s.anchor for s in projections) in launch_label
    label, _ = found[f"[{short.rule}] {short.anchor}: mm -> relu"]
    assert "left to Inductor (K=4 < 16" in label
    label, unfused_box = found[f"{unfused.node}: not fused"]
    assert "input dtypes torch.int32" in label

    centres = node_centres(svg)
    assert inside(centres[activation.anchor], box)
    assert inside(centres[unfused.node], unfused_box)
    gated = next(s for s in report.sites if "up_mul" in s.epilogue)
    (up,) = [note.split()[3] for note in gated.notes if note.startswith("the up projection")]
    _, gated_box = found[f"[{gated.rule}] {gated.anchor}: mm -> silu -> up_mul"]
    assert inside(centres[gated.anchor], gated_box) and inside(centres[up], gated_box)
    for site in projections:  # each projection's own box, inside the launch's
        _, own = found[f"[{site.rule}] {site.anchor}: mm"]
        assert inside(centres[site.anchor], own) and inside(centres[site.anchor], launch)


def test_without_graphviz_the_report_says_how_to_get_the_picture(tmp_path, monkeypatch, no_compile_caches):
    monkeypatch.setattr(graph_drawing, "graphviz_dot", lambda: None)
    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.silu(F.linear(x, w, b))  # noqa: E731
    out, (report,) = compile_run(fn, x, w, b, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5
    graph_dir = tmp_path / report.graph
    assert not (graph_dir / graph_drawing.PICTURE_FILE).exists()
    summary = (graph_dir / "summary.txt").read_text()
    assert f"picture: {graph_drawing.INSTALL_HINT}" in summary
    assert "pip install 'helion-inductor[viz]'" in summary and "apt-get install graphviz" in summary


def test_a_failure_to_draw_costs_the_picture_not_the_compile(tmp_path, monkeypatch, no_compile_caches):
    def broken(sketch, ctx):
        raise RuntimeError("no layout")

    monkeypatch.setattr("helion_backend.compile.manager.draw", broken)
    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
    out, (report,) = compile_run(fn, x, w, b, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5
    assert report.sites[0].runs_on == "reference"
    assert report.picture == "not drawn (RuntimeError: no layout)"
    assert "picture: not drawn (RuntimeError: no layout)" in (tmp_path / report.graph / "summary.txt").read_text()


@needs_graphviz
def test_a_graph_too_large_to_lay_out_keeps_its_dot_source(tmp_path, monkeypatch, no_compile_caches):
    monkeypatch.setattr(graph_drawing, "MAX_LAID_OUT_NODES", 3)
    x, w = randn(4, 32), randn(48, 32)
    fn = lambda x, w: torch.relu(F.linear(x, w))  # noqa: E731
    _, (report,) = compile_run(fn, x, w, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    graph_dir = tmp_path / report.graph
    assert not (graph_dir / graph_drawing.PICTURE_FILE).exists()
    source = (graph_dir / graph_drawing.DOT_FILE).read_text()
    assert "cluster_r0" in source and f"kernel {report.sites[0].kernel}, runs on reference" in source
    assert report.picture.startswith(f"{graph_drawing.DOT_FILE} (") and "dot -Tsvg graph.dot" in report.picture
