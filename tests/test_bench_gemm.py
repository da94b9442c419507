"""The GEMM benchmark (benchmarks/bench_gemm.py): the quantized suite's formats, floors, failures and merges,
and its --smoke run of the int4 and block fp8 formats end to end."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_gemm  # noqa: E402
from benchmarks.common import MERGED_COMMAND, QUANT_RECIPES  # noqa: E402
from helion_backend import tables  # noqa: E402
from helion_backend.layers.quantize import QUANT_FORMATS  # noqa: E402
from helion_backend.tuning.problems import QUANT_FORMAT_OF, quantized_site  # noqa: E402

NEW_FORMATS = ("int4_weight_only", "fp8_block")
FAMILY_OF = {fmt: family for family, fmt in QUANT_FORMAT_OF.items()}


def test_every_quantize_format_is_offered_with_a_tolerance():
    assert {fmt for fmt, _ in QUANT_RECIPES.values()} == set(QUANT_FORMATS)
    assert set(bench_gemm.QUANT_TOLERANCES) == set(QUANT_RECIPES)
    assert set(bench_gemm.QUANT_SPEEDUP_TARGETS) <= set(QUANT_RECIPES)
    assert bench_gemm.parse_args(["--quant", ",".join(reversed(QUANT_RECIPES))]).quant == tuple(QUANT_RECIPES)


@pytest.mark.parametrize("fmt, weight_bytes", [
    ("int4_weight_only", 1024 * 4096 // 2 + 1024 * (4096 // 128) * 2),  # two nibbles a byte; bf16 scale per group
    ("fp8_block", 1024 * 4096 + (1024 // 128) * (4096 // 128) * 4),  # fp8; fp32 scale per 128 x 128 block
    ("fp8_dynamic", 1024 * 4096 + 1024 * 4),  # fp8; fp32 scale per channel (not the unit scale of rescale_after)
    ("int8_dynamic", 1024 * 4096 + 1024 * 4),
    ("int8_weight_only", 1024 * 4096 + 1024 * 2),  # int8; bf16 scale per channel
    ("int4_weight_only_zp", 1024 * 4096 // 2 + 1024 * (4096 // 128) * 4),  # a bf16 scale and zero point per group
])
def test_floor_counts_the_stored_weight_and_scales(fmt, weight_bytes):
    case = bench_gemm.GemmCase("qwen3_8b", "kv", 8, 4096, 1024, "bias", torch.bfloat16, fmt)
    assert case.weight_bytes == weight_bytes
    assert case.min_bytes == weight_bytes + (8 * 4096 + 8 * 1024 + 1024) * 2  # x, output and bias in bf16


def test_a_variant_that_cannot_run_at_some_m_is_recorded_with_its_reason(monkeypatch):
    """As cuBLAS's blockwise ``_scaled_mm`` refuses an M that is not a multiple of 4: the row keeps the
    reason, the other variants and rows are measured, and the summaries leave the row out."""
    def refusing_at_odd_m(variant, module, device):
        def run(x, residual):
            if x.shape[0] % 4:
                raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
            return module(x, residual)
        return run if variant == "compile" else module

    monkeypatch.setattr(bench_gemm, "compile_variant", refusing_at_odd_m)
    ceilings, timing = bench_gemm.Ceilings(1e10, 1e12), bench_gemm.PRESETS["smoke"].timing
    rows = []
    for m in (3, 4):
        case = bench_gemm.GemmCase("tiny", "tiny", m, 256, 256, "bias", torch.float32, "fp8_block")
        with torch.no_grad():
            rows.append(bench_gemm.run_case(case, ("eager", "compile"), ceilings, timing, torch.device("cpu"), 1))
    assert rows[0]["times_us"]["compile"] is None and "CUBLAS_STATUS_NOT_SUPPORTED" in rows[0]["errors"]["compile"]
    assert rows[0]["times_us"]["eager"] > 0 and rows[1]["times_us"]["compile"] > 0 and not rows[1]["errors"]
    assert bench_gemm.error_lines(rows) == ["- compile (1 rows, M = 3): `RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED`"]
    assert [bench_gemm.format_time(row, "compile") for row in rows] == ["err", f"{rows[1]['times_us']['compile']:.1f}"]


@pytest.mark.parametrize("fmt, kernel", [("int4_weight_only", "tinygemm _weight_int4pack_mm"),
                                         ("fp8_dynamic", "cuBLASLt _scaled_mm (row-wise scales)"),
                                         ("int8_dynamic", "cuBLAS _int_mm (3 rows)"),
                                         ("int8_weight_only", "aten _weight_int8pack_mm"), ("fp8_block", None)])
def test_peers_alone_are_measured_beside_each_row(fmt, kernel):
    """The library kernel of the format (``peer``) and the bf16 GEMM (``cublas_bf16``), each alone on its
    prepared inputs: checked against their float64 products, timed, named, and in the table beside the
    backend's time; a format without a peer here gets no time and no error."""
    ceilings, timing = bench_gemm.Ceilings(1e10, 1e12), bench_gemm.PRESETS["smoke"].timing
    case = bench_gemm.GemmCase("tiny", "tiny", 3, 256, 128, "bias_gelu_tanh", torch.bfloat16, fmt)
    with torch.no_grad():
        row = bench_gemm.run_case(case, ("eager", "peer", "cublas_bf16"), ceilings, timing, torch.device("cpu"), 2)
    assert not row["errors"], row["errors"]
    assert row["kernels"] == {"cublas_bf16": "cuBLAS mm (bf16 weight)", **({"peer": kernel} if kernel else {})}
    assert (row["times_us"]["peer"] is not None) == (kernel is not None)
    assert row["times_us"]["cublas_bf16"] > 0 and row["rel_err"]["cublas_bf16"] < 1e-2
    if kernel:
        assert row["rel_err"]["peer"] < 1e-2, row["rel_err"]
    row["times_us"][bench_gemm.HELION] = row["times_us"]["eager"]  # as if the backend's time
    header, _, line = bench_gemm.table_lines([row], ["eager", "peer", "cublas_bf16"])
    cells = dict(zip(header.split(" | "), line.split(" | ")))
    assert cells["vs cublas_bf16"] == f"{row['times_us']['cublas_bf16'] / row['times_us']['eager']:.2f}x"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (tinygemm's CUDA packing)")
@pytest.mark.parametrize("zero_points", [False, True])
def test_tinygemm_peer_on_cuda_computes_the_layers_weight(zero_points):
    """On CUDA tinygemm packs the even column in the high nibble: the peer still multiplies the layer's weight."""
    import torch.nn as nn

    from benchmarks.peers import peer_call
    from helion_backend.layers.quantize import Int4WeightOnlyLinear

    torch.manual_seed(4)
    linear = nn.Linear(4096, 1024, bias=False).to(device="cuda", dtype=torch.bfloat16)
    layer = Int4WeightOnlyLinear.from_linear(linear, zero_points=zero_points)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    call = peer_call("peer", "int4_weight_only", linear.weight, layer, x)
    out, expected = call.run(), layer(x)
    assert ((out.double() - expected.double()).norm() / expected.double().norm()).item() < 1e-2
    reference = call.reference()
    assert ((out.double() - reference).norm() / reference.norm()).item() < 1e-2


@pytest.mark.gpu
def test_peer_graphs_replay_after_later_captures(tmp_path):
    """The int4 peer's tinygemm operands (8 MB at 4096 x 4096) are prepared outside its graph; the
    cublas_bf16 capture after it empties the allocator's cache, and the replays in turns then read them.
    They died with an illegal address while only the peer's closure, dropped after capture, held them."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gemm.py"), "--quant", "int4_weight_only",
                             "--suite", "qwen3_8b", "--shapes", "q_o", "--m", "1", "--epilogues", "bias",
                             "--variants", "eager,peer,cublas_bf16", "--budget-min", "0", "--replays", "5",
                             "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (path,) = tmp_path.glob("*_quant.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert not row["errors"], row["errors"]
    assert all(row["times_us"][v] > 0 for v in ("eager", "peer", "cublas_bf16")), row["times_us"]
    assert row["rel_err"]["peer"] < 1e-2 and row["rel_err"]["cublas_bf16"] < 1e-2, row["rel_err"]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> dict:
    """``--smoke`` of the new formats, with one M above the decode range (the summaries' other half)."""
    tmp = tmp_path_factory.mktemp("bench_gemm")
    env = {**os.environ,
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp / "backend")}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gemm.py"), "--smoke",
                             "--quant", ",".join(NEW_FORMATS), "--epilogues", "bias_gelu_tanh", "--m", "1,40",
                             "--out-dir", str(tmp / "out")],
                            capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"json": tmp / "out" / "cpu_quant.json", "markdown": (tmp / "out" / "cpu_quant.md").read_text()}


@pytest.mark.slow
def test_smoke_run_measures_int4_and_block_fp8_with_their_prologues(smoke_run):
    data = json.loads(smoke_run["json"].read_text())
    plan = bench_gemm.PRESETS["smoke"]
    assert data["metadata"]["quants"] == ["fp8_block", "int4_weight_only"]  # QUANT_FORMATS' order
    assert data["metadata"]["complete"] and not data["metadata"]["skipped"]
    assert sorted((row["quant"], row["m"]) for row in data["rows"]) == [
        (fmt, m) for fmt in sorted(NEW_FORMATS) for m in (1, 40)]
    for row in data["rows"]:
        assert not row["errors"], row["errors"]
        assert all(bench_gemm.row_is_correct(row, variant) for variant in plan.variants), row["rel_err"]
        prologue = ", ".join(quantized_site(FAMILY_OF[row["quant"]])[1])  # as a compile records the layer's
        assert row["helion_sites"].startswith(f"reference [{prologue}]"), row["helion_sites"]
    table = smoke_run["markdown"]
    assert "| format | vs compile, M <= 32, geomean |" in table
    assert all(f"\n| {fmt} | " in table and f"### {fmt} " in table for fmt in NEW_FORMATS)
    assert "(>= 1.5x)" in table  # block fp8's target


def _rerun(data: dict, command: str, variants: dict[str, float], quant: str | None = None) -> dict:
    """``data`` as if measured again by ``command``: only ``variants`` (with those times), and with
    ``quant`` for the rows' format if given."""
    rerun = copy.deepcopy(data)
    rerun["metadata"] = {**rerun["metadata"], "command": command, "variants": list(variants)}
    if quant:
        rerun["metadata"]["quants"] = [quant]
    for row in rerun["rows"]:
        row["quant"] = quant or row["quant"]
        row["times_us"] = dict(variants)
        for field in ("errors", "rel_err", "compile_s"):
            row[field] = {v: x for v, x in row[field].items() if v in variants}
    return rerun


@pytest.mark.slow
def test_merge_adds_formats_and_variants_to_a_result_file(smoke_run, tmp_path):
    """A run of some formats merged into a file keeps the file's other formats; a run of some variants
    replaces those variants only; a merged file merged again still lists every run it came from."""
    first = json.loads(smoke_run["json"].read_text())
    files = {"first": first, "other_format": _rerun(first, "other format", {"eager": 1.0, "compile": 2.0,
                                                                            bench_gemm.HELION: 0.5}, "fp8_dynamic"),
             "compile_again": _rerun(first, "compile again", {"compile": 7.0})}
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    merged_path = bench_gemm.merge_results([tmp_path / "first.json", tmp_path / "other_format.json"], tmp_path / "m1")
    merged_path = bench_gemm.merge_results([merged_path, tmp_path / "compile_again.json"], tmp_path / "m2")
    merged = json.loads(merged_path.read_text())

    assert merged["metadata"]["quants"] == ["fp8_dynamic", "fp8_block", "int4_weight_only"]
    assert merged["metadata"]["merged_from"] == [first["metadata"]["command"], "other format", "compile again"]
    assert merged["metadata"]["command"] == MERGED_COMMAND  # not the last run's, which made only some rows
    assert merged["metadata"]["tolerance"] == max(bench_gemm.QUANT_TOLERANCES[q] for q in merged["metadata"]["quants"])
    rows = {(row["quant"], row["m"]): row for row in merged["rows"]}
    assert len(rows) == 3 * 2
    before = {(row["quant"], row["m"]): row for row in first["rows"]}
    for key, row in rows.items():
        if key in before:  # compile measured again; eager and helion_inductor as the first run measured them
            assert row["times_us"]["compile"] == 7.0, key
            assert row["times_us"]["eager"] == before[key]["times_us"]["eager"], key
            assert row["helion_sites"] == before[key]["helion_sites"], key
        else:
            assert row["times_us"] == {"eager": 1.0, "compile": 2.0, bench_gemm.HELION: 0.5}, key
    assert "| fp8_dynamic | " in merged_path.with_suffix(".md").read_text()


@pytest.mark.slow
def test_merge_refuses_results_of_another_suite(smoke_run, tmp_path):
    other = json.loads(smoke_run["json"].read_text())
    other["metadata"]["quants"] = []
    (tmp_path / "bf16.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different devices, dtypes or suites"):
        bench_gemm.merge_results([smoke_run["json"], tmp_path / "bf16.json"], tmp_path / "out")


# --- the popular families and the held-out mode ------------------------------------------------------------


def test_popular_suites_have_each_decoder_linear():
    for suite in bench_gemm.POPULAR_SUITES:
        shapes = {shape.name: shape for shape in bench_gemm.SUITES[suite]}
        assert {"kv", "gate_up", "down", "lm_head"} <= set(shapes) and ("q_o" in shapes or {"q", "o"} <= set(shapes))
        q = shapes.get("q_o", shapes.get("q"))
        hidden = q.k
        # The MLP goes hidden -> intermediate -> hidden, attention's output back to hidden, the vocabulary from it.
        assert shapes["down"] == bench_gemm.LinearShape("down", shapes["gate_up"].n, hidden)
        assert shapes["kv"].k == hidden and shapes["lm_head"].k == hidden
        assert shapes.get("o", q).n == hidden
    gemma = {shape.name: shape for shape in bench_gemm.SUITES["gemma2_2b"]}
    assert (gemma["q"].n, gemma["o"].k) == (8 * 256, 8 * 256)  # 8 heads of 256: not the hidden size 2304


def test_held_out_shapes_include_the_fused_qkv_width():
    shapes = bench_gemm.held_out_shapes(["llama3_1_8b"])
    assert shapes == {(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256), (4096, 6144)}


def test_holding_out_a_family_removes_its_keys_from_the_tables_for_the_run(monkeypatch):
    """Llama-3.1-8B's attention shapes are Qwen3-8B's: holding it out leaves them, and the fused q/k/v key,
    without an entry in any family, while Qwen3-32B's keep theirs; afterwards the shipped table is back."""
    from helion_backend.kernels import configs

    monkeypatch.setattr(tables, "gpu_key", lambda device: "nvidia_h200")
    cuda = torch.device("cuda")

    def evidence(k, n, kernel="gemm", dtype=torch.bfloat16, m=8):
        return tables.decision(m, k, n, dtype, cuda, None, kernel).evidence

    shipped_dir = tables.TUNED_DIR
    configs.forget_tables()
    assert evidence(4096, 4096) == "exact" and evidence(4096, 6144, "gemm_multi") == "exact"
    with bench_gemm.holding_out(["llama3_1_8b"]) as shapes:
        assert (4096, 4096) in shapes and tables.TUNED_DIR != shipped_dir
        assert evidence(4096, 4096) != "exact" and evidence(4096, 1024, "gemm_fp8", torch.float8_e4m3fn) != "exact"
        assert evidence(4096, 6144, "gemm_multi") != "exact"
        assert evidence(5120, 8192) == "exact"  # Qwen3-32B's q
        assert "bench_held_out_" in os.environ["HELION_INDUCTOR_CACHE_DIR"]  # no user table
    assert tables.TUNED_DIR == shipped_dir and evidence(4096, 4096) == "exact"
    assert os.environ.get("HELION_INDUCTOR_CACHE_DIR", "").find("bench_held_out_") < 0


def test_summary_sets_held_out_rows_against_their_targets():
    def row(m, compile_us, helion_us, held_out):
        return {"m": m, "dtype": "bf16", "quant": None, "held_out": held_out,
                "times_us": {"compile": compile_us, bench_gemm.HELION: helion_us},
                "rel_err": {"compile": 1e-3, bench_gemm.HELION: 1e-3}, "weight_bound": False, "hbm_floor_us": 1.0}

    rows = [row(1, 10.0, 9.0, True), row(8, 10.0, 10.5, True), row(8, 10.0, 8.0, False), row(128, 10.0, 10.0, True)]
    lines = bench_gemm.summary_lines(rows)
    held = [line for line in lines if "held-out" in line or "tuned shapes" in line]
    assert held == [
        f"{bench_gemm.HELION} vs compile, M <= 32, held-out shapes: geomean 1.029x (n=2): missed (>= 1.05x)",
        f"{bench_gemm.HELION} vs compile, M <= 32, held-out shapes: worst row 0.952x (n=2): missed (>= 0.97x)",
        f"{bench_gemm.HELION} vs compile, M <= 32, tuned shapes: geomean 1.250x (n=1)",
    ]
    assert not [line for line in bench_gemm.summary_lines(rows[2:3]) if "held-out" in line]


def test_popular_preset_and_hold_out_parse():
    plan = bench_gemm.resolve_plan(bench_gemm.parse_args(["--popular", "--hold-out", "gemma2_2b,mistral_7b"]))
    assert plan.suites == bench_gemm.POPULAR_SUITES and plan.held_out == ("mistral_7b", "gemma2_2b")
    assert len(bench_gemm.plan_cases(plan)) == 3 * sum(len(bench_gemm.SUITES[s]) for s in bench_gemm.POPULAR_SUITES)
    with pytest.raises(SystemExit):
        bench_gemm.parse_args(["--hold-out", "llama9"])


def test_a_quantized_row_must_match_the_unfused_layer_to_40_db():
    """helion_inductor within the format's tolerance of float64 but 2% off the eager quantized layer (a wrong
    scale the quantization error would hide) is not correct, and the summary's SQNR cell says so; a
    baseline's own distance from the eager layer is recorded, not judged."""
    row = {"quant": "int4_weight_only", "dtype": "bf16", "times_us": {bench_gemm.HELION: 5.0, "compile": 6.0},
           "rel_err": {bench_gemm.HELION: 0.08, "compile": 0.08},
           "rel_err_layer": {bench_gemm.HELION: 2e-2, "compile": 5e-2}}
    assert not bench_gemm.row_is_correct(row, bench_gemm.HELION) and bench_gemm.row_is_correct(row, "compile")
    assert bench_gemm.worst_layer_sqnr([row]) == "34.0 dB (n=1): missed (>= 40 dB)"
    row["rel_err_layer"][bench_gemm.HELION] = 1e-3
    assert bench_gemm.row_is_correct(row, bench_gemm.HELION)
    assert bench_gemm.worst_layer_sqnr([row]) == "60.0 dB (n=1): met (>= 40 dB)"
    del row["rel_err_layer"]  # rows measured before the check keep their verdict
    assert bench_gemm.row_is_correct(row, bench_gemm.HELION)
