"""tinygemm as the int4 family's other form (option ``frozen_weights``): the weight in tinygemm's layout, made
once beside the layer's and kept while its bytes live; where the config table says it runs; and,
on a GPU, its results through the backend against the unfused layer."""

from __future__ import annotations

import gc
import json

import pytest
import torch
import torch.nn as nn
from helpers import sites, sqnr_db

import helion_backend
from helion_backend import environment, tables
from helion_backend.kernels import configs, tinygemm
from helion_backend.layers.quantize import Int4WeightOnlyLinear

CUDA = torch.device("cuda")


def _layer(k: int = 256, n: int = 64, zero_points: bool = False, device: str = "cpu", seed: int = 3,
           bias: bool = False) -> Int4WeightOnlyLinear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).to(device=device, dtype=torch.bfloat16)
    return Int4WeightOnlyLinear.from_linear(linear, zero_points=zero_points)


def _rel(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.fixture(autouse=True)
def no_prepared_forms():
    tinygemm.forget_prepared()
    yield
    tinygemm.forget_prepared()


@pytest.mark.parametrize("zero_points", [False, True])
def test_tinygemm_operands_compute_the_layers_weight(zero_points):
    """The layer's weight in tinygemm's form (scales and zeros [K/G, N, 2], ``w = (q - 8) * scale + zero``)
    multiplies as the layer does, with the fixed zero point or one per group."""
    layer = _layer(zero_points=zero_points)
    tiled, scales_and_zeros = tinygemm.tinygemm_operands(layer.packed, layer.group_params)
    assert scales_and_zeros.shape == (2, 64, 2) and scales_and_zeros.dtype == torch.bfloat16
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    assert _rel(tinygemm.tinygemm_mm(x, tiled, scales_and_zeros), layer(x)) < 1e-2


def test_the_form_is_made_once_and_shared_by_views_and_aliases_of_the_bytes():
    """A compiled graph may hand the op a detached alias of the buffer each call (no ``_base``): the form
    belongs to the storage, so it is still made once."""
    layer = _layer()
    first = tinygemm.prepared_operands(layer.packed, layer.group_params)
    for alias in (layer.packed.t().t(), layer.packed.detach()):
        again = tinygemm.prepared_operands(alias, layer.group_params.detach())
        assert again is not None and all(a is b for a, b in zip(first, again))


def test_the_form_is_kept_while_the_bytes_live():
    """Never remade or replaced while the bytes live (a CUDA graph recorded with it reads its memory at every
    replay): an in-place change after it was made is not seen, as option ``frozen_weights`` promises."""
    layer, other = _layer(seed=3), _layer(seed=4)
    before = tinygemm.prepared_operands(layer.packed, layer.group_params)
    with torch.no_grad():
        layer.packed.copy_(other.packed)
    after = tinygemm.prepared_operands(layer.packed, layer.group_params)
    assert after is not None and all(a is b for a, b in zip(before, after))


def test_views_of_one_storage_get_forms_of_their_own():
    """Two weights sliced from one buffer (a fused q/k/v, say): each multiplies as its own weight."""
    layer = _layer(256, 128)
    halves = [(layer.packed[i * 64:(i + 1) * 64], layer.group_params[i * 64:(i + 1) * 64]) for i in range(2)]
    forms = [tinygemm.prepared_operands(packed, scales) for packed, scales in halves]
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    expected = layer(x)
    for i, form in enumerate(forms):
        assert _rel(tinygemm.tinygemm_mm(x, *form), expected[:, i * 64:(i + 1) * 64]) < 1e-2
    assert all(a is b for a, b in zip(forms[0], tinygemm.prepared_operands(*halves[0])))


def test_scales_new_at_every_call_keep_a_bounded_number_of_forms(caplog):
    """Scales that are other tensors at every call (computed anew) would each get a copy of the weight: past
    the bound the caller gets None (it runs its Helion kernel), with a warning."""
    layer = _layer()
    scales = [layer.group_params.clone() for _ in range(tinygemm.MAX_FORMS_PER_STORAGE + 2)]
    forms = [tinygemm.prepared_operands(layer.packed, each) for each in scales]
    assert all(form is not None for form in forms[:tinygemm.MAX_FORMS_PER_STORAGE])
    assert forms[-2:] == [None, None] and "no more tinygemm copies" in caplog.text
    assert caplog.text.count("no more tinygemm copies") == 1  # said once, not at every call


def _count_forms_made(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the bytes each tinygemm form is made from, in order, from now on."""
    made, real = [], tinygemm.tinygemm_operands

    def counted(packed_nk, group_params):
        made.append(tuple(packed_nk.shape))
        return real(packed_nk, group_params)

    monkeypatch.setattr(tinygemm, "tinygemm_operands", counted)
    return made


def test_a_compiled_graph_makes_the_form_once(monkeypatch):
    """Regression: a compiled graph hands the op, at its first call, an alias of the bytes with a version
    counter of its own, and later the buffer's. Keyed on that version, the form was made again at the second
    call, which under CUDA graphs is the recording: it then ran the Helion kernel at every replay."""
    from helion_backend.runtime import dispatch

    layer = _layer(256, 64)
    made = _count_forms_made(monkeypatch)
    monkeypatch.setattr(dispatch, "_helion_runs_on", lambda x: True)  # the CPU runs tinygemm's CPU form
    monkeypatch.setattr(tables, "tinygemm_measured_faster", lambda *key: True)
    compiled = torch.compile(layer, backend="helion_inductor", options={"rewrite_on_cpu": True,
                                                                      "frozen_weights": True})
    for _ in range(3):
        x = torch.randn(2, 256, dtype=torch.bfloat16)
        with torch.no_grad():
            assert _rel(compiled(x), layer(x)) < 1e-2
    assert made == [(64, 128)]


def test_the_form_goes_with_the_layer():
    layer = _layer()
    assert tinygemm.prepared_operands(layer.packed, layer.group_params) is not None
    assert len(tinygemm._PREPARED) == 1
    del layer
    gc.collect()
    assert not tinygemm._PREPARED


def test_inference_tensors_get_a_form():
    """A model made under ``torch.inference_mode`` (no version counters) runs tinygemm too."""
    with torch.inference_mode():
        layer = _layer()
    form = tinygemm.prepared_operands(layer.packed, layer.group_params)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert form is not None and _rel(tinygemm.tinygemm_mm(x, *form), layer(x)) < 1e-2


@pytest.mark.parametrize("dtype, k, n, group, expected", [
    (torch.bfloat16, 4096, 4096, 128, None),
    (torch.float16, 4096, 4096, 128, "bf16 rows"),
    (torch.bfloat16, 4160, 4096, 64, "multiple of 128"),
    (torch.bfloat16, 4096, 1020, 128, "N a multiple of 8"),
    (torch.bfloat16, 4096, 4096, 512, "group sizes"),
])
def test_what_tinygemm_takes(dtype, k, n, group, expected):
    problem = tinygemm.tinygemm_problem(dtype, k, n, group)
    assert problem is None if expected is None else expected in problem


# --------------------------------------------------------------------------------------------------
# Where the config table says it runs


def _int4_entry(m: int, us: float, tinygemm_us: float | None, n: int = 4096) -> dict:
    entry = {"kernel": "gemm_int4", "dtype": "bfloat16", "k": 4096, "n": n, "m": m, "us": us,
             "fallback_us": 3 * us, "helion_wins": True, "prologue": ["dequant_int4"],
             "config": {"block_sizes": [16, 64, 64], "num_warps": 4, "num_stages": 4, "split_k": 1}}
    return entry if tinygemm_us is None else {**entry, tables.TINYGEMM_US: tinygemm_us}


@pytest.fixture
def int4_table(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    monkeypatch.setattr(environment, "helion_unavailable_reason", lambda: None)
    (tmp_path / "test_gpu.json").write_text(json.dumps({"entries": [
        _int4_entry(1, 11.0, 7.5), _int4_entry(8, 18.0, 20.0), _int4_entry(32, 24.0, 40.0)]}))
    configs.forget_tables()
    yield
    configs.forget_tables()


def test_the_table_says_where_tinygemm_is_faster(int4_table):
    faster = {m: tables.tinygemm_measured_faster(m, 4096, 4096, torch.bfloat16, CUDA, None, "gemm_int4")
              for m in (1, 2, 8, 32, 64)}
    # M = 2 runs M = 8's config (the smallest tuned M above it), where tinygemm lost; none above the table.
    assert faster == {1: True, 2: False, 8: False, 32: False, 64: False}
    assert not tables.tinygemm_measured_faster(1, 4096, 1024, torch.bfloat16, CUDA, None, "gemm_int4")


@pytest.mark.parametrize("frozen", [False, True])
def test_the_report_says_where_a_frozen_site_runs_tinygemm(int4_table, frozen):
    from types import SimpleNamespace

    from helion_backend.compile import placing
    from helion_backend.options import BackendOptions

    site = SimpleNamespace(k=4096, dtype=torch.bfloat16, device=CUDA, static_m=None)
    ctx = SimpleNamespace(options=BackendOptions(cache_dir="/nonexistent", frozen_weights=frozen))
    placed = placing.place(site, ctx, "gemm_int4", 4096)
    assert placed.runs_on == "helion"
    assert ("tinygemm" in placed.why) == frozen
    if frozen:
        assert "at M=1, where the config table timed it faster" in placed.why


def _inductor_faster_entry(m: int) -> dict:
    """A kv-like key where torch.compile beat Helion's config and tinygemm beat both (the H100's K 4096,
    N 1024 at M = 8: 17.8, 13.2 and 8.8 us)."""
    return {**_int4_entry(m, 17.8, 8.8, n=1024), "fallback_us": 13.2, "helion_wins": False}


@pytest.mark.parametrize("frozen", [False, True])
def test_a_key_only_tinygemm_beat_inductor_at_goes_to_it_with_frozen_weights(tmp_path, monkeypatch, frozen):
    from types import SimpleNamespace

    from helion_backend.compile import placing
    from helion_backend.options import BackendOptions

    monkeypatch.setattr(tables, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    monkeypatch.setattr(environment, "helion_unavailable_reason", lambda: None)
    bf16_twin = {**_inductor_faster_entry(8), "kernel": "gemm", "prologue": []}  # a family tinygemm is not
    (tmp_path / "test_gpu.json").write_text(json.dumps({"entries": [_inductor_faster_entry(8), bf16_twin]}))
    configs.forget_tables()
    try:
        site = SimpleNamespace(k=4096, dtype=torch.bfloat16, device=CUDA, static_m=8)
        ctx = SimpleNamespace(options=BackendOptions(cache_dir="/nonexistent", frozen_weights=frozen))
        placed = placing.place(site, ctx, "gemm_int4", 1024)
        # Another family's entry with the same times is not affected: only int4 sites run tinygemm.
        other = placing.place(site, ctx, "gemm", 1024)
    finally:
        configs.forget_tables()
    assert placed.runs_on == ("helion" if frozen else "inductor"), placed.why
    if frozen:
        assert "Helion 1.50x" in placed.why and "tinygemm" in placed.why and "at M=8" in placed.why
    assert other.runs_on == "inductor"


# --------------------------------------------------------------------------------------------------
# On the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("m", [1, 8, 33])
@pytest.mark.parametrize("steps", [(), ("bias", "gelu_tanh")], ids=["plain", "bias_gelu"])
def test_tinygemm_gemm_matches_the_unfused_layer(steps, m, zero_points):
    """tinygemm's product and the Helion epilogue pass over it against the graph's dequantization."""
    from helion_backend.kernels.quant_gemm import tinygemm_gemm
    from helion_backend.semantics.reference import dequantize_int4, reference

    layer = _layer(4096, 1024, zero_points, "cuda", seed=m, bias=True)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    operands = [layer.bias] if steps else []
    out = tinygemm_gemm(x, layer.packed.t(), layer.group_params, steps, operands, [], torch.bfloat16)
    w_kn = dequantize_int4(layer.packed, layer.group_params, torch.bfloat16).t()
    assert out is not None and out.shape == (m, 1024) and out.is_contiguous()
    assert sqnr_db(reference(x, w_kn, steps, operands, [], torch.bfloat16), out) >= 40


@pytest.mark.gpu
def test_a_capture_makes_no_form_and_runs_helion():
    """Inside a CUDA-graph capture the form is not made (the conversion would be captured): the caller gets
    None and runs its Helion kernel; a form made before the capture is used in it."""
    from helion_backend.kernels.quant_gemm import tinygemm_gemm

    layer = _layer(4096, 1024, device="cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    args = (x, layer.packed.t(), layer.group_params, (), [], [], torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert tinygemm_gemm(*args) is None
    assert not tinygemm._PREPARED
    assert tinygemm_gemm(*args) is not None  # made outside the capture
    with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
        out = tinygemm_gemm(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert out is not None and _rel(out, layer(x)) < 1e-2


def _frozen_table(tmp_path, layer: Int4WeightOnlyLinear, m: int) -> str:
    """A cache folder whose user table (under this GPU's name) times tinygemm faster than Helion at the layer's
    key and M; the folder to pass as option ``cache_dir``."""
    entry = {**_int4_entry(m, 50.0, 1.0, n=layer.out_features), "k": layer.in_features, "epilogue": ["bias", "gelu_tanh"]}
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / f"{tables.gpu_key(CUDA)}.json").write_text(json.dumps({"entries": [entry]}))
    configs.forget_tables()
    return str(tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_points", [False, True])
def test_a_frozen_int4_site_runs_tinygemm_under_cuda_graphs(tmp_path, monkeypatch, zero_points):
    """Through the backend with its CUDA graphs (cudagraph trees warm the graph up with allocations routed
    into their pool): the report names tinygemm, replays match the unfused layer on fresh inputs, and the
    form was made once, before the recording."""
    layer = _layer(4096, 1024, zero_points, "cuda", seed=5, bias=True)
    model = nn.Sequential(layer, nn.GELU(approximate="tanh"))
    options = {"frozen_weights": True, "cache_dir": _frozen_table(tmp_path, layer, 1)}
    made = _count_forms_made(monkeypatch)
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor", options=options)
    for _ in range(4):  # warm-up, recording, replays
        x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out, expected = compiled(x), model(x)
        assert sqnr_db(expected, out) >= 40
    (site,) = sites(helion_backend.get_reports())
    assert site.runs_on == "helion" and "tinygemm" in site.why, site.why
    assert made == [(1024, 2048)]  # at the warm-up; the recording found it


@pytest.mark.gpu
def test_a_frozen_site_inductor_would_have_run_runs_tinygemm(tmp_path):
    """A key where the table measured Inductor faster than Helion's config and tinygemm faster than both: with
    frozen weights the site is rewritten and runs tinygemm (the form is made), matching the unfused layer."""
    layer = _layer(4096, 1024, device="cuda", seed=7, bias=True)
    model = nn.Sequential(layer, nn.GELU(approximate="tanh"))
    (tmp_path / "configs").mkdir()
    entry = {**_inductor_faster_entry(8), "epilogue": ["bias", "gelu_tanh"]}
    (tmp_path / "configs" / f"{tables.gpu_key(CUDA)}.json").write_text(json.dumps({"entries": [entry]}))
    configs.forget_tables()
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor",
                             options={"frozen_weights": True, "cache_dir": str(tmp_path)})
    for _ in range(3):
        x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert sqnr_db(model(x), compiled(x)) >= 40
    (site,) = sites(helion_backend.get_reports())
    assert site.runs_on == "helion" and "tinygemm" in site.why, site.why
    assert len(tinygemm._PREPARED) == 1


@pytest.mark.gpu
def test_without_frozen_weights_the_site_keeps_helion(tmp_path):
    layer = _layer(4096, 1024, device="cuda", seed=6, bias=True)
    model = nn.Sequential(layer, nn.GELU(approximate="tanh"))
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor", options={"cache_dir": _frozen_table(tmp_path, layer, 1)})
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert sqnr_db(model(x), compiled(x)) >= 40
    (site,) = sites(helion_backend.get_reports())
    assert site.runs_on == "helion" and "tinygemm" not in site.why
    assert not tinygemm._PREPARED
