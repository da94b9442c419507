"""Figures of the benchmark results: PNG files beside the results JSON they are drawn from.

    python benchmarks/plot.py                      # every results file in benchmarks/results, and the headline
    python benchmarks/plot.py A.json B.json --out-dir DIR

From a GEMM results file (``bench_gemm.py``): ``<stem>_speedup_vs_<baseline>.png``, helion_inductor's speedup
over each baseline by M, a panel per shape; ``<stem>_floor.png``, the fraction of the HBM floor each variant
reaches by M (a roofline view: 1.0 is the time the bytes take at the measured bandwidth). From a decode file
(``decode.py``): ``<stem>.png``, the step time of each variant by batch. With GEMM and decode files of one
device: ``<device>_headline.png``, the figure the README shows.

A variant's time is drawn only where it ran without error within the run's tolerance (the metadata's, the
loosest of the run's formats: the tables flag each format's own). Needs matplotlib (the ``viz`` extra); reads
only the JSON, so it runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HELION = "helion_inductor"
DPI = 110
MAX_COLUMNS = 5  # panels a row
LEGEND_IN = 0.75  # the legend strip under a figure's panels, in inches
# Colours and labels by variant, the same in every figure.
VARIANT_STYLE = {
    "eager": ("#9aa0a6", "eager"),
    "compile": ("#4285f4", "torch.compile"),
    "reduce_overhead": ("#4285f4", "torch.compile (reduce-overhead)"),
    "max_autotune": ("#a142f4", "torch.compile (max-autotune)"),
    HELION: ("#0f9d58", "helion_inductor"),
}
SERIES_COLOURS = ("#db4437", "#4285f4", "#f4b400", "#795548", "#a142f4", "#00acc1", "#ff7043")

Rows = list[dict]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def kind(results: dict) -> str:
    """``gemm`` (bench_gemm.py), ``decode`` (decode.py) or ``other`` (compile_time.py, which has no figure)."""
    rows = results.get("rows") or []
    if rows and "times_us" in rows[0]:
        return "gemm"
    if rows and "wall_us" in rows[0]:
        return "decode"
    return "other"


def counts(row: dict, variant: str, tolerance: float | None) -> bool:
    """Whether ``variant`` ran at ``row`` without error, within ``tolerance`` (when the run states one)."""
    time, err = row.get("times_us", {}).get(variant), row.get("rel_err", {}).get(variant)
    if time is None or variant in (row.get("errors") or {}):
        return False
    return tolerance is None or (err is not None and err <= tolerance)


def shape_of(row: dict) -> str:
    return f"{row['suite']} {row['name']}: K={row['k']} N={row['n']}"


def series_of(row: dict) -> str:
    """What a line stands for within one shape: the quantization format, else the epilogue."""
    return row["quant"] if row.get("quant") else row["epilogue"]


def on_helion(row: dict) -> bool:
    """Whether helion_inductor's site ran its Helion kernel (placement may leave a shape's M to cuBLAS)."""
    return str(row.get("helion_sites", "")).startswith("helion")


def speedup_points(rows: Rows, baseline: str, tolerance: float | None) -> dict[str, dict[str, list[tuple]]]:
    """shape -> series -> [(M, t_baseline / t_helion_inductor, ran on Helion)], by M."""
    points: dict[str, dict[str, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        if counts(row, baseline, tolerance) and counts(row, HELION, tolerance):
            ratio = row["times_us"][baseline] / row["times_us"][HELION]
            points[shape_of(row)][series_of(row)].append((row["m"], ratio, on_helion(row)))
    return _sorted(points)


def floor_points(rows: Rows, variants: Sequence[str],
                 tolerance: float | None) -> dict[tuple[str, str], dict[str, list[tuple]]]:
    """(series, shape) -> variant -> [(M, HBM floor / t_variant)], by M."""
    points: dict[tuple[str, str], dict[str, list[tuple]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        for variant in variants:
            if counts(row, variant, tolerance) and row.get("hbm_floor_us"):
                points[(series_of(row), shape_of(row))][variant].append((row["m"], row["hbm_floor_us"] /
                                                                         row["times_us"][variant]))
    return _sorted(points)


def _sorted(points: dict) -> dict:
    """Each line's points by M (the keys keep their first-seen order)."""
    return {key: {inner: sorted(values) for inner, values in lines.items()} for key, lines in points.items()}


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def headline_points(gemm_results: Sequence[dict],
                    baseline: str = "compile") -> dict[str, list[tuple[int, float, bool]]]:
    """Format (bf16, or the quantization) -> [(M, geomean over shapes and epilogues of the speedup over
    ``baseline``, whether any of those sites ran its Helion kernel)]."""
    by_format: dict[str, dict[int, list[tuple[float, bool]]]] = defaultdict(lambda: defaultdict(list))
    for results in gemm_results:
        tolerance = results["metadata"].get("tolerance")
        for row in results["rows"]:
            if counts(row, baseline, tolerance) and counts(row, HELION, tolerance):
                ratio = row["times_us"][baseline] / row["times_us"][HELION]
                by_format[row.get("quant") or row["dtype"]][row["m"]].append((ratio, on_helion(row)))
    return {fmt: [(m, geomean([r for r, _ in v]), any(h for _, h in v)) for m, v in sorted(ms.items())]
            for fmt, ms in by_format.items()}


def decode_points(rows: Rows) -> dict[str, dict[str, list[tuple[int, float, float | None]]]]:
    """format -> variant -> [(batch, wall µs per step, GPU µs per step)] of the rows that ran correctly."""
    points: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        tolerance = row.get("tolerance")
        if row.get("error") or row.get("wall_us") is None:
            continue
        if tolerance is not None and row.get("rel_err") is not None and row["rel_err"] > tolerance:
            continue
        points[row["format"]][row["variant"]].append((row["batch"], row["wall_us"], row.get("gpu_us")))
    return _sorted(points)


# --- drawing ---------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 10, "axes.grid": True, "grid.alpha": 0.3,
                         "figure.titlesize": 13})
    return plt


def _m_axis(ax, ms: Sequence[int], label: bool) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(ms)))
    ax.set_xticklabels([str(m) for m in sorted(set(ms))])
    ax.minorticks_off()
    if label:
        ax.set_xlabel("M (tokens)")


def _grid(plt, panels: int, ncols: int, width: float = 3.3, height: float = 2.7, **kwargs):
    ncols = max(1, min(ncols, panels))
    nrows = math.ceil(panels / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + LEGEND_IN + 0.7), squeeze=False,
                             **kwargs)
    flat = [ax for row in axes for ax in row]
    for ax in flat[panels:]:
        ax.set_visible(False)
    return fig, axes, flat[:panels]


def _above_legend(fig) -> tuple[float, float, float, float]:
    """The part of the figure above the legend strip at its bottom (``tight_layout``'s rect)."""
    return (0, LEGEND_IN / fig.get_figheight(), 1, 1)


def _title_formats(metadata: dict) -> str:
    quants = metadata.get("quants") or []
    dtype = metadata.get("dtype", "")
    return f"{dtype} activations, quantized linears" if quants else f"{dtype} linears"


def _subtitle(metadata: dict) -> str:
    parts = [metadata.get("device"), f"torch {metadata['torch']}" if metadata.get("torch") else None,
             f"helion {metadata['helion']}" if metadata.get("helion") else None,
             metadata.get("date", "")[:10] or None]
    return ", ".join(p for p in parts if p)


def plot_speedups(results: dict, baseline: str, out: Path) -> Path:
    """helion_inductor's speedup over ``baseline`` by M: a panel per shape, a line per epilogue or format."""
    plt = _pyplot()
    points = speedup_points(results["rows"], baseline, results["metadata"].get("tolerance"))
    shapes = list(points)  # in the file's order: suite by suite
    series = sorted({s for lines in points.values() for s in lines})
    colours = dict(zip(series, SERIES_COLOURS * 2))
    fig, axes, flat = _grid(plt, len(shapes), ncols=MAX_COLUMNS, sharey=True)
    for i, (ax, shape) in enumerate(zip(flat, shapes)):
        for name, values in points[shape].items():
            ms = [m for m, _, _ in values]
            ax.plot(ms, [r for _, r, _ in values], color=colours[name], lw=1.5, label=name)
            for m, ratio, helion in values:
                ax.plot([m], [ratio], "o", ms=6, color=colours[name], mfc=colours[name] if helion else "white")
        ax.axhline(1.0, color="black", lw=1, ls="--")
        ax.set_title(shape)
        _m_axis(ax, [m for values in points[shape].values() for m, _, _ in values], label=i >= len(flat) - len(axes[0]))
        if i % len(axes[0]) == 0:
            ax.set_ylabel(f"speedup over {VARIANT_STYLE[baseline][1]}")
    handles = [plt.Line2D([], [], color=colours[s], marker="o", lw=1.5, label=s) for s in series]
    handles += [plt.Line2D([], [], color="black", marker="o", mfc="white", lw=0,
                           label="site left to cuBLAS + Inductor"),
                plt.Line2D([], [], color="black", ls="--", lw=1, label="1.0: as fast")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), frameon=False)
    fig.suptitle(f"helion_inductor vs {VARIANT_STYLE[baseline][1]}: t_{baseline} / t_{HELION} "
                 f"(> 1: helion_inductor faster)\n{_title_formats(results['metadata'])}; "
                 f"{_subtitle(results['metadata'])}")
    fig.tight_layout(rect=_above_legend(fig))
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def plot_floor(results: dict, out: Path) -> Path:
    """The fraction of the HBM floor each variant reaches by M: a row per epilogue or format, a panel per shape."""
    plt = _pyplot()
    variants = results["metadata"].get("variants") or list(VARIANT_STYLE)
    points = floor_points(results["rows"], variants, results["metadata"].get("tolerance"))
    # A series measured at one M draws no line (bf16's residual epilogue runs at M=512 only, where FLOPs bound).
    points = {key: lines for key, lines in points.items() if len({m for v in lines.values() for m, _ in v}) > 1}
    series = sorted({s for s, _ in points})
    shapes = list(dict.fromkeys(shape for _, shape in points))
    # Each series on rows of its own, at most MAX_COLUMNS shapes a row.
    ncols = min(len(shapes), MAX_COLUMNS)
    rows_per_series = math.ceil(len(shapes) / ncols)
    nrows = rows_per_series * len(series)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.5 * nrows + LEGEND_IN + 0.7), squeeze=False,
                             sharey=True)
    for ax in axes.flat:
        ax.set_visible(False)
    for r, name in enumerate(series):
        for i, shape in enumerate(shapes):
            row, c = r * rows_per_series + i // ncols, i % ncols
            ax = axes[row][c]
            ax.set_visible(True)
            for variant, values in points.get((name, shape), {}).items():
                colour, label = VARIANT_STYLE[variant]
                ax.plot([m for m, _ in values], [f for _, f in values], marker="o", ms=4, lw=1.5, color=colour,
                        label=label)
            ax.axhline(1.0, color="black", lw=1, ls="--")
            ax.set_ylim(0, 1.08)
            ax.set_title(f"{shape}\n{name}", fontsize=9)
            _m_axis(ax, [m for v in points.get((name, shape), {}).values() for m, _ in v], label=row == nrows - 1)
            if c == 0:
                ax.set_ylabel("fraction of HBM floor")
    handles = [plt.Line2D([], [], color=VARIANT_STYLE[v][0], marker="o", lw=1.5, label=VARIANT_STYLE[v][1])
               for v in variants]
    handles.append(plt.Line2D([], [], color="black", ls="--", lw=1, label="1.0: the HBM floor"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle("Fraction of the HBM floor reached: floor / time, the floor being the GEMM's bytes at the measured "
                 f"bandwidth\n{_title_formats(results['metadata'])}; {_subtitle(results['metadata'])}")
    fig.tight_layout(rect=_above_legend(fig))
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _decode_bars(ax, lines: dict[str, list[tuple]], variants: Sequence[str], clip: float | None) -> None:
    """Grouped bars of the step's wall time by batch (a bar per variant, its GPU time as a dark tick)."""
    batches = sorted({b for values in lines.values() for b, _, _ in values})
    present = [v for v in variants if v in lines]
    width = 0.8 / max(1, len(present))
    for j, variant in enumerate(present):
        colour, label = VARIANT_STYLE[variant]
        at = {b: (wall, gpu) for b, wall, gpu in lines[variant]}
        xs = [i + (j - (len(present) - 1) / 2) * width for i, b in enumerate(batches) if b in at]
        walls = [at[b][0] for b in batches if b in at]
        shown = [min(w, clip) if clip else w for w in walls]
        ax.bar(xs, shown, width * 0.92, color=colour, label=label)
        for x, wall, height in zip(xs, walls, shown):
            if clip and wall > clip:  # a cut bar: its value inside, under the arrow
                ax.text(x, height * 0.98, f"↑\n{wall:.0f}", ha="center", va="top", fontsize=8, color="white",
                        fontweight="bold")
            else:
                ax.text(x, height, f"{wall:.0f}", ha="center", va="bottom", fontsize=7.5)
        gpus = [(x, at[b][1]) for x, b in zip(xs, [b for b in batches if b in at]) if at[b][1] is not None]
        ax.plot([x for x, _ in gpus], [min(g, clip) if clip else g for _, g in gpus], "_", color="black", ms=12, mew=2)
    ax.set_xticks(range(len(batches)))
    ax.set_xticklabels([f"batch {b}" for b in batches])
    ax.grid(axis="x", visible=False)


def _compiled_clip(lines_by_format: dict[str, dict[str, list[tuple]]]) -> float | None:
    """A y limit that keeps the compiled variants readable beside eager's much longer step (eager is cut, its
    value printed), or None when nothing is that far above the rest."""
    compiled = [w for lines in lines_by_format.values() for v, vals in lines.items() if v != "eager"
                for _, w, _ in vals]
    eager = [w for lines in lines_by_format.values() for _, w, _ in lines.get("eager", [])]
    if not compiled or not eager or max(eager) < 2.5 * max(compiled):
        return None
    return 1.6 * max(compiled)


def plot_decode(results: dict, out: Path) -> Path:
    plt = _pyplot()
    points = decode_points(results["rows"])
    variants = results["metadata"].get("variants") or list(VARIANT_STYLE)
    formats = [f for f in results["metadata"].get("formats", sorted(points)) if f in points]
    clip = _compiled_clip(points)
    fig, axes = plt.subplots(1, len(formats), figsize=(6.2 * len(formats), 4.6), squeeze=False, sharey=True)
    for ax, fmt in zip(axes[0], formats):
        _decode_bars(ax, points[fmt], variants, clip)
        ax.set_title(fmt)
        if clip:
            ax.set_ylim(0, clip * 1.12)
    axes[0][0].set_ylabel("µs per decode step (wall; tick: GPU time)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=VARIANT_STYLE[v][0], label=VARIANT_STYLE[v][1]) for v in variants]
    handles.append(plt.Line2D([], [], color="black", marker="_", ms=12, mew=2, lw=0, label="GPU time of the step"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(f"Decode step of {_model(results['metadata'])}, lower is better\n{_subtitle(results['metadata'])}"
                 + (" (a bar with an arrow is cut: its value is printed)" if clip else ""))
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def _model(metadata: dict) -> str:
    model = metadata.get("model") or {}
    if not model:
        return "the model"
    return (f"a {model.get('layers')}-layer decoder (hidden {model.get('hidden')}, intermediate "
            f"{model.get('intermediate')}, context {model.get('context')})")


def plot_headline(gemm_results: Sequence[dict], decode_results: dict, out: Path) -> Path:
    """GEMM + epilogue speedup over torch.compile by M per format, beside the decode step by batch."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    lines = headline_points(gemm_results)
    for colour, (fmt, values) in zip(SERIES_COLOURS * 2, sorted(lines.items())):
        left.plot([m for m, _, _ in values], [g for _, g, _ in values], lw=1.8, color=colour)
        for m, g, helion in values:
            left.plot([m], [g], "o", ms=6, color=colour, mfc=colour if helion else "white")
        left.plot([], [], marker="o", lw=1.8, color=colour, label=fmt)
    left.plot([], [], "o", color="black", mfc="white", label="every site left to cuBLAS + Inductor")
    left.axhline(1.0, color="black", lw=1, ls="--", label="1.0: as fast")
    _m_axis(left, [m for values in lines.values() for m, _, _ in values], label=True)
    left.set_ylabel("speedup over torch.compile (geomean of shapes)")
    left.set_title("One linear + epilogue (Qwen3 shapes), by M")
    left.legend(fontsize=8.5, ncol=2)
    decode = decode_points(decode_results["rows"])
    shown = [v for v in ("reduce_overhead", "max_autotune", HELION) if any(v in lines for lines in decode.values())]
    formats = [f for f in decode_results["metadata"].get("formats", sorted(decode)) if f in decode]
    groups = [(fmt, b) for fmt in formats for b in sorted({b for vals in decode[fmt].values() for b, _, _ in vals})]
    width = 0.8 / len(shown)
    for j, variant in enumerate(shown):
        colour, label = VARIANT_STYLE[variant]
        heights = [{b: w for b, w, _ in decode[fmt].get(variant, [])}.get(b) for fmt, b in groups]
        xs = [i + (j - (len(shown) - 1) / 2) * width for i in range(len(groups))]
        kept = [(x, h) for x, h in zip(xs, heights) if h is not None]
        right.bar([x for x, _ in kept], [h for _, h in kept], width * 0.92, color=colour, label=label)
        for x, h in kept:
            right.text(x, h, f"{h:.0f}", ha="center", va="bottom", fontsize=7.5)
    right.set_xticks(range(len(groups)))
    right.set_xticklabels([f"batch {b}" for _, b in groups], fontsize=8.5)
    for fmt in formats:  # the format under its batches, a rule between formats
        at = [i for i, (f, _) in enumerate(groups) if f == fmt]
        right.text(sum(at) / len(at), -0.13, fmt, transform=right.get_xaxis_transform(), ha="center",
                   fontweight="bold")
        if at[0] > 0:
            right.axvline(at[0] - 0.5, color="#9aa0a6", lw=1)
    right.grid(axis="x", visible=False)
    right.set_ylabel("µs per decode step (wall)")
    right.set_title(f"Decode step, {_model(decode_results['metadata'])}", fontsize=9)
    right.set_ylim(0, 1.3 * max(h for lines in decode.values() for v in shown for _, h, _ in lines.get(v, [])))
    right.legend(fontsize=8.5, loc="upper left")
    fig.suptitle(f"helion_inductor on {_subtitle(decode_results['metadata'])}")
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out


def plot_file(path: Path, out_dir: Path) -> list[Path]:
    """The figures of one results file (none for a file without rows, such as compile_time.py's)."""
    results = load(path)
    which = kind(results)
    if which == "gemm":
        variants = results["metadata"].get("variants") or sorted({v for r in results["rows"] for v in r["times_us"]})
        figures = [plot_speedups(results, baseline, out_dir / f"{path.stem}_speedup_vs_{baseline}.png")
                   for baseline in variants if baseline != HELION]
        return [*figures, plot_floor(results, out_dir / f"{path.stem}_floor.png")]
    if which == "decode":
        return [plot_decode(results, out_dir / f"{path.stem}.png")]
    return []


def plot_all(paths: Sequence[Path], out_dir: Path | None = None) -> list[Path]:
    """Every file's figures (beside it, or in ``out_dir``), and a headline per device with GEMM and decode results."""
    written: list[Path] = []
    by_device: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        target = out_dir or path.parent
        target.mkdir(parents=True, exist_ok=True)
        written += plot_file(path, target)
        results = load(path)
        device = results.get("metadata", {}).get("device_tag")
        if device:
            by_device[device][kind(results)].append((results, target))
    for device, files in sorted(by_device.items()):
        if files["gemm"] and files["decode"]:
            decode, target = files["decode"][0]
            written.append(plot_headline([r for r, _ in files["gemm"]], decode, target / f"{device}_headline.png"))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("results", nargs="*", type=Path,
                        help="results JSON files (default: every *.json in benchmarks/results)")
    parser.add_argument("--out-dir", type=Path, help="where the figures go (default: beside each results file)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot.py needs matplotlib: pip install 'helion-inductor[viz]' (or pip install matplotlib)",
              file=sys.stderr)
        return 2
    paths = args.results or sorted(RESULTS_DIR.glob("*.json"))
    for path in plot_all(paths, args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
