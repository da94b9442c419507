"""The option ``autotune_missing``: off by default; on, a compiled graph autotunes the keys of its Helion sites
that no config table holds exactly (into the user table, before its first run, never under CUDA-graph capture),
and a key that fails costs a warning, not the compile. On the CPU the loop runs with the CUDA device, the Helion
placement and the tuner replaced; on a GPU, one small key end to end."""

import argparse
import functools
import json
import logging

import helion
import pytest
import torch
import torch.nn.functional as F
from test_manifest import sites_placed_on_helion  # noqa: F401 (a fixture)
from test_tuning import config, reference_kernels  # noqa: F401 (a fixture)

import helion_backend
from helion_backend import backend, tables
from helion_backend.kernels import configs
from helion_backend.options import DEFAULT_TUNE_BUDGET_S, DEFAULT_TUNE_EFFORT, BackendOptions
from helion_backend.tuning import loop as tuning
from helion_backend.tuning.loop import ConfigTable, TuneKey

CUDA = torch.device("cuda")
REAL_TUNE_KEY = tuning.tune_key
REAL_TUNING_DEVICE = backend._tuning_device
# The test model's two sites at M = 4: the first linear (K=64, N=32) and the second (K=32, N=16).
FIRST = ("gemm", "float32", 64, 32, 4)
SECOND = ("gemm", "float32", 32, 16, 4)


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(64, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def entry(key: tuple, us: float = 5.0) -> dict:
    kernel, dtype, k, n, m = key
    return {"dtype": dtype, "k": k, "n": n, "m": m, "config": dict(config(64)), "us": us, "fallback_us": 6.0,
            "helion_wins": us < 6.0}


@pytest.fixture
def fake_cuda(tmp_path, monkeypatch, sites_placed_on_helion):  # noqa: F811
    """A compile on the CPU whose sites go to Helion and whose tables are test_gpu's (the shipped one in
    ``tmp_path/shipped``); the key loop tunes with ``tuned`` (default: a fixed entry), recording the keys."""
    monkeypatch.setattr(backend, "_tuning_device", lambda example_inputs: torch.device("cpu"))
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    monkeypatch.setattr(tables, "TUNED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(tuning, "table_metadata", lambda device: {"device": "test"})
    configs.forget_tables()
    tuned: list[TuneKey] = []

    def tune_key(key, device, *, effort, budget_s):
        tuned.append(key)
        return entry(key.table_key)

    monkeypatch.setattr(tuning, "tune_key", tune_key)
    yield tuned
    configs.forget_tables()


def compile_mlp(tmp_path, **options):
    """Compile and run the MLP once at M = 4; (output, eager output, reports)."""
    model, x = Mlp(), torch.randn(4, 64)
    options = {"rewrite_on_cpu": True, "cache_dir": str(tmp_path), "inductor_config": {"fx_graph_cache": False},
               **options}
    helion_backend.clear_reports()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="helion_inductor", options=options)(x)
        return out, model(x), helion_backend.get_reports()


def user_table(tmp_path) -> list[tuple]:
    path = tmp_path / "configs" / "test_gpu.json"
    if not path.exists():
        return []
    entries = json.loads(path.read_text())["entries"]
    return [(e.get("kernel", "gemm"), e["dtype"], e["k"], e["n"], e["m"]) for e in entries]


def test_off_by_default_nothing_tunes(tmp_path, fake_cuda):
    assert BackendOptions().autotune_missing is False
    out, expected, reports = compile_mlp(tmp_path)
    torch.testing.assert_close(out, expected)
    assert fake_cuda == [] and user_table(tmp_path) == []
    assert [r.autotuned for r in reports] == [[]]
    assert [s.runs_on for r in reports for s in r.sites] == ["helion", "helion"]  # there were keys to tune


def test_on_tunes_exactly_the_keys_no_table_holds(tmp_path, fake_cuda, caplog):
    # SECOND is shipped; FIRST has only a neighbouring M in the user table, which does not count.
    ConfigTable.load(tmp_path / "shipped" / "test_gpu.json", "sweep").put(entry(SECOND), {})
    ConfigTable.load(tmp_path / "configs" / "test_gpu.json", "earlier").put(entry(FIRST[:4] + (8,)), {})
    with caplog.at_level(logging.INFO, logger="helion_backend"):
        out, expected, reports = compile_mlp(tmp_path, autotune_missing=True)
    torch.testing.assert_close(out, expected)
    assert [key.table_key for key in fake_cuda] == [FIRST]
    assert fake_cuda[0].epilogue == ("bias", "gelu")
    assert sorted(user_table(tmp_path)) == [FIRST[:4] + (4,), FIRST[:4] + (8,)]
    data = json.loads((tmp_path / "configs" / "test_gpu.json").read_text())
    assert data["metadata"]["commands"] == ["earlier", tuning.COMPILE_COMMAND]
    # This process sees the new entry at once (the lookups are memoized).
    assert configs.config_for(4, 64, 32, torch.float32, CUDA, str(tmp_path / "configs")) == config(64)
    (report,) = reports
    (line,) = report.autotuned
    assert "K=64 N=32 M=4" in line and "tuned in" in line
    assert "autotuned at compile time: float32 K=64 N=32 M=4" in report.summary()
    assert "autotuned 1 key(s) in" in caplog.text
    # What it does and how long it should take, then a line per key, at WARNING: a first call that tunes for
    # minutes is not silent.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("autotuning 1 key(s) no config table holds (effort quick, 300s per key) before the graph's first "
               "run: up to about 5m00s" in w for w in warnings), warnings
    assert any("[1/1] float32 K=64 N=32 M=4" in w and "tuning; ETA" in w for w in warnings), warnings
    assert any("[1/1] float32 K=64 N=32 M=4" in w and "saved" in w for w in warnings), warnings
    # A second compile finds every key in a table: nothing more tunes.
    compile_mlp(tmp_path, autotune_missing=True)
    assert len(fake_cuda) == 1


@pytest.mark.parametrize("effort, budget_s", [("full", 7), ("sweep", None)])  # the sweep does not search
def test_options_reach_the_tuner_and_the_report_dump(tmp_path, monkeypatch, fake_cuda, effort, budget_s):
    seen = []
    monkeypatch.setattr(tuning, "tune_key", lambda key, device, *, effort, budget_s: seen.append((effort, budget_s))
                        or entry(key.table_key))
    compile_mlp(tmp_path, autotune_missing=True, autotune_effort=effort, autotune_budget_s=7,
                debug_dir=str(tmp_path / "debug"))
    assert seen == [(effort, budget_s)] * 2
    (dump,) = (tmp_path / "debug").iterdir()
    assert len(json.loads((dump / "report.json").read_text())["autotuned"]) == 2
    assert "autotuned at compile time" in (dump / "summary.txt").read_text()


def test_a_failing_key_warns_and_the_compile_still_runs_right(tmp_path, monkeypatch, fake_cuda, caplog):
    def tune_key(key, device, *, effort, budget_s):
        if key.table_key == FIRST:
            raise RuntimeError("Helion exploded")
        return entry(key.table_key)

    monkeypatch.setattr(tuning, "tune_key", tune_key)
    with caplog.at_level(logging.INFO, logger="helion_backend"):
        out, expected, reports = compile_mlp(tmp_path, autotune_missing=True)
    torch.testing.assert_close(out, expected)
    assert user_table(tmp_path) == [SECOND]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("K=64 N=32 M=4" in w and "failed (RuntimeError: Helion exploded); keeps its config" in w
               for w in warnings), warnings
    assert any("failed" in line for line in reports[0].autotuned)


def test_an_unwritable_table_warns_and_the_compile_still_runs(tmp_path, fake_cuda, caplog):
    (tmp_path / "configs").write_text("a file where the folder goes")
    with caplog.at_level(logging.WARNING):
        out, expected, reports = compile_mlp(tmp_path, autotune_missing=True)
    torch.testing.assert_close(out, expected)
    assert fake_cuda == [] and "autotune_missing stopped (TuneError" in caplog.text
    assert all("not tuned" in line for line in reports[0].autotuned) and len(reports[0].autotuned) == 2


def test_the_real_key_loop_with_a_fake_tuner_and_timer(tmp_path, monkeypatch, fake_cuda, reference_kernels):  # noqa: F811
    """tune_key itself (problem, searches, validation against the reference), Helion and the clock replaced."""
    searched = []

    def tuner(search, effort, budget_s):
        searched.append((effort, budget_s))
        return config(16, split_k=search.fixed["split_k"])

    monkeypatch.setattr(tuning, "tune_key", functools.partial(REAL_TUNE_KEY, tuner=tuner, timer=lambda step: 1.0))
    out, expected, reports = compile_mlp(tmp_path, autotune_missing=True, autotune_budget_s=4)
    torch.testing.assert_close(out, expected)
    assert sorted(user_table(tmp_path)) == sorted([FIRST, SECOND])
    # K <= 1024: one split each, as a dot and as a GEMV (M = 4), half the budget each
    assert searched == [("quick", 2)] * 4
    entries = json.loads((tmp_path / "configs" / "test_gpu.json").read_text())["entries"]
    assert all(e["error"] <= tuning.TOLERANCE for e in entries)


def test_the_sweep_effort_times_candidates_at_compile_time_without_helions_autotuner(
        tmp_path, monkeypatch, fake_cuda, reference_kernels, caplog):  # noqa: F811
    def tuner(search, effort, budget_s):
        raise AssertionError("searched")

    monkeypatch.setattr(tuning, "tune_key", functools.partial(REAL_TUNE_KEY, tuner=tuner, timer=lambda step: 1.0))
    with caplog.at_level(logging.INFO, logger="helion_backend"):
        out, expected, _ = compile_mlp(tmp_path, autotune_missing=True, autotune_effort="sweep")
    torch.testing.assert_close(out, expected)
    assert "autotuning 2 key(s) no config table holds (effort sweep)" in caplog.text
    entries = json.loads((tmp_path / "configs" / "test_gpu.json").read_text())["entries"]
    assert [e["effort"] for e in entries] == ["sweep", "sweep"] and all(e["candidates"] > 1 for e in entries)


def test_no_tuning_while_a_cuda_graph_is_captured(tmp_path, monkeypatch, fake_cuda):
    capturing = [True]
    monkeypatch.setattr(backend.cuda_graphs, "stream_capturing", lambda: capturing[0])
    model, x = Mlp(), torch.randn(4, 64)
    options = {"rewrite_on_cpu": True, "cache_dir": str(tmp_path), "autotune_missing": True,
               "inductor_config": {"fx_graph_cache": False}}
    compiled = torch.compile(model, backend="helion_inductor", options=options)
    with torch.no_grad():
        compiled(x)
        assert fake_cuda == []  # left to the next call
        capturing[0] = False
        compiled(x)
        compiled(x)
    assert len(fake_cuda) == 2  # once


def test_a_graph_served_from_the_caches_tunes_from_its_saved_sites(tmp_path, monkeypatch, fake_cuda):
    # The option is part of the cache key (it sends untuned keys to Helion): the first compile has it too, on a
    # device that cannot tune, and fills the caches.
    options = {"rewrite_on_cpu": True, "cache_dir": str(tmp_path), "autotune_missing": True}
    model, x = Mlp(), torch.randn(4, 64)
    with torch.no_grad():
        with monkeypatch.context() as no_device:
            no_device.setattr(backend, "_tuning_device", lambda example_inputs: None)
            torch.compile(model, backend="helion_inductor", options=options)(x)
        assert fake_cuda == []
        torch._dynamo.reset()
        helion_backend.clear_reports()
        torch.compile(model, backend="helion_inductor", options=options)(x)
    (report,) = helion_backend.get_reports()
    assert report.from_cache
    assert sorted(key.table_key for key in fake_cuda) == sorted([FIRST, SECOND])


def test_off_cuda_nothing_tunes(tmp_path, monkeypatch, fake_cuda):
    monkeypatch.setattr(backend, "_tuning_device", REAL_TUNING_DEVICE)  # these inputs are on the CPU
    _, _, reports = compile_mlp(tmp_path, autotune_missing=True)
    assert fake_cuda == [] and user_table(tmp_path) == [] and reports[0].autotuned == []


@pytest.mark.parametrize("options, error, message", [
    ({"autotune_missing": "yes"}, TypeError, "option 'autotune_missing' must be bool, got 'yes'"),
    ({"autotune_missing": 1}, TypeError, "option 'autotune_missing' must be bool, got 1"),
    ({"autotune_effort": "medium"}, ValueError, r"option 'autotune_effort' must be one of \['sweep', 'quick', 'full'\]"),
    ({"autotune_effort": None}, TypeError, "option 'autotune_effort' must be str"),
    ({"autotune_budget_s": 0}, ValueError, "option 'autotune_budget_s' must be >= 1"),
    ({"autotune_budget_s": 2.5}, TypeError, "option 'autotune_budget_s' must be int, got 2.5"),
    ({"autotune_missed": True}, ValueError, "unknown option.*'autotune_missed'.*valid options are"),
])
def test_bad_option_values_are_refused_clearly(options, error, message):
    with pytest.raises(error, match=message):
        BackendOptions.from_user(options)
    with pytest.raises(Exception, match=message):
        compile_mlp_quietly(options)


def compile_mlp_quietly(options):
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(Mlp(), backend="helion_inductor", options=options)(torch.randn(4, 64))


def test_defaults_are_the_tune_commands():
    options = BackendOptions()
    assert (options.autotune_effort, options.autotune_budget_s) == (DEFAULT_TUNE_EFFORT, DEFAULT_TUNE_BUDGET_S)
    parser = argparse.ArgumentParser()
    tuning.add_arguments(parser)
    command = parser.parse_args(["manifest.json"])
    assert (command.effort, command.budget_per_key) == (DEFAULT_TUNE_EFFORT, DEFAULT_TUNE_BUDGET_S)
    # How it tunes does not change the rewrite, so it does not change the cache key; whether it tunes does (the
    # keys it will tune run Helion instead of Inductor).
    assert BackendOptions(autotune_budget_s=5).fingerprint() == options.fingerprint()
    assert BackendOptions.from_user({"autotune_effort": "sweep"}).fingerprint() == options.fingerprint()
    assert BackendOptions(autotune_missing=True).fingerprint() != options.fingerprint()


# --- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_compile_autotunes_a_missing_key_into_the_user_table(tmp_path, caplog):
    """A shape no shipped table has (K=1024, N=384, M=3), a few seconds of autotuning: the user table gains its
    key before the first run, and the result matches float64."""
    torch.manual_seed(0)
    helion_backend.clear_reports()
    linear = torch.nn.Linear(1024, 384, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    options = {"autotune_missing": True, "autotune_budget_s": 5, "cache_dir": str(tmp_path)}
    gpu = tables.gpu_key(CUDA)
    assert not tables.has_entry("gemm", "bfloat16", 1024, 384, 3, CUDA, None), "the shipped table has the key"
    compiled = torch.compile(lambda x: F.gelu(linear(x), approximate="tanh"), backend="helion_inductor",
                             options=options)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="helion_backend"):
        out = compiled(x).clone()  # cudagraph trees reuse the output's memory on the next replay
        out_again = compiled(x).clone()
    table = json.loads((tmp_path / "configs" / f"{gpu}.json").read_text())
    (tuned,) = table["entries"]
    assert (tuned["dtype"], tuned["k"], tuned["n"], tuned["m"]) == ("bfloat16", 1024, 384, 3)
    assert tuned["error"] <= tuning.TOLERANCE and tuned["us"] > 0
    assert table["metadata"]["commands"] == [tuning.COMPILE_COMMAND]
    assert configs.config_for(3, 1024, 384, torch.bfloat16, CUDA, str(tmp_path / "configs")) == \
        helion.Config(**tuned["config"])
    expected = F.gelu(x.double() @ linear.weight.double().t() + linear.bias.double(), approximate="tanh")
    for result in (out, out_again):
        error = (result.double() - expected).norm() / expected.norm()
        assert error < 1e-2, error
    (report,) = helion_backend.get_reports()  # one graph: tuning (which compiles fallbacks) recompiled nothing
    assert [s.runs_on for s in report.sites] == ["helion"]
    assert len(report.autotuned) == 1 and "K=1024 N=384 M=3" in report.autotuned[0], report.autotuned
    assert "autotuned 1 key(s) in" in caplog.text
