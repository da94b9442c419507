"""benchmarks/plot.py: the figures of a results file, from a small synthetic GEMM and decode run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import plot  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VARIANTS = ["eager", "compile", "helion_inductor"]


def gemm_row(name: str, m: int, epilogue: str, times: dict[str, float], sites: str = "helion",
             errors: dict[str, str] | None = None) -> dict:
    return {"suite": "tiny", "name": name, "m": m, "k": 256, "n": 512, "dtype": "bf16", "epilogue": epilogue,
            "quant": None, "times_us": times, "errors": errors or {}, "rel_err": {v: 1e-3 for v in times},
            "helion_sites": sites, "hbm_floor_us": 4.0, "floor_us": 4.0, "weight_bound": True}


def gemm_results() -> dict:
    rows = [
        gemm_row("up", 1, "silu", {"eager": 12.0, "compile": 9.0, "helion_inductor": 6.0}),
        gemm_row("up", 8, "silu", {"eager": 12.0, "compile": 10.0, "helion_inductor": 8.0}),
        gemm_row("up", 1, "bias", {"eager": 11.0, "compile": 8.0, "helion_inductor": 5.0}),
        gemm_row("up", 8, "bias", {"eager": 11.0, "compile": 8.0, "helion_inductor": 8.0},
                 sites="inductor (M=8 > max_helion_size=4: cuBLAS + Inductor's epilogue)"),
        gemm_row("down", 1, "silu", {"eager": 20.0, "compile": 16.0, "helion_inductor": 10.0}),
        # compile failed here: the point is left out, not drawn as a speedup
        gemm_row("down", 8, "silu", {"eager": 20.0, "helion_inductor": 12.0}, errors={"compile": "RuntimeError"}),
    ]
    metadata = {"device": "Tiny GPU", "device_tag": "tiny_gpu", "torch": "2.13", "helion": "1.4.0",
                "date": "2026-12-01T00:00:00", "dtype": "bf16", "quants": [], "tolerance": 0.01, "variants": VARIANTS}
    return {"metadata": metadata, "rows": rows}


def decode_results() -> dict:
    rows = [{"format": fmt, "batch": batch, "variant": variant, "wall_us": wall * batch ** 0.1, "gpu_us": wall * 0.8,
             "rel_err": 0.0 if variant == "eager" else 0.01, "tolerance": 0.03, "error": None}
            for fmt in ("bf16", "fp8_dynamic") for batch in (1, 8)
            for variant, wall in (("eager", 5000.0), ("reduce_overhead", 1000.0), ("helion_inductor", 800.0))]
    metadata = {"device": "Tiny GPU", "device_tag": "tiny_gpu", "formats": ["bf16", "fp8_dynamic"],
                "variants": ["eager", "reduce_overhead", "helion_inductor"],
                "model": {"hidden": 64, "intermediate": 128, "layers": 2, "context": 16}}
    return {"metadata": metadata, "rows": rows}


def test_speedups_are_the_baseline_over_helion_and_skip_failed_runs():
    points = plot.speedup_points(gemm_results()["rows"], "compile", tolerance=0.01)
    up, down = points["tiny up: K=256 N=512"], points["tiny down: K=256 N=512"]
    assert up["silu"] == [(1, 1.5, True), (8, 1.25, True)]
    assert up["bias"] == [(1, 1.6, True), (8, 1.0, False)]  # M=8 ran cuBLAS + Inductor
    assert down == {"silu": [(1, 1.6, True)]}
    floors = plot.floor_points(gemm_results()["rows"], VARIANTS, tolerance=0.01)
    assert floors[("silu", "tiny down: K=256 N=512")]["helion_inductor"] == [(1, 0.4), (8, 4.0 / 12.0)]
    assert [m for m, _ in floors[("silu", "tiny down: K=256 N=512")]["compile"]] == [1]
    # Over the run's tolerance, a time does not count.
    loose = gemm_results()["rows"]
    loose[0]["rel_err"]["helion_inductor"] = 0.5
    assert plot.speedup_points(loose, "compile", tolerance=0.01)["tiny up: K=256 N=512"]["silu"] == [(8, 1.25, True)]


def test_headline_is_the_geomean_over_shapes_by_m():
    (line,) = plot.headline_points([gemm_results()]).values()
    (m1, g1, helion1), (m8, g8, helion8) = line
    assert (m1, m8) == (1, 8) and helion1 and helion8
    assert g1 == pytest.approx((1.5 * 1.6 * 1.6) ** (1 / 3))
    assert g8 == pytest.approx((1.25 * 1.0) ** 0.5)


def test_plot_writes_every_figure_of_a_gemm_and_a_decode_run(tmp_path):
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install 'helion-inductor[viz]')")
    gemm, decode = tmp_path / "tiny_gpu_bf16.json", tmp_path / "tiny_gpu_decode.json"
    gemm.write_text(json.dumps(gemm_results()))
    decode.write_text(json.dumps(decode_results()))
    out = tmp_path / "figures"
    assert plot.main([str(gemm), str(decode), "--out-dir", str(out)]) == 0
    expected = {"tiny_gpu_bf16_speedup_vs_eager.png", "tiny_gpu_bf16_speedup_vs_compile.png",
                "tiny_gpu_bf16_floor.png", "tiny_gpu_decode.png", "tiny_gpu_headline.png"}
    assert {p.name for p in out.iterdir()} == expected
    for path in out.iterdir():
        data = path.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, path
