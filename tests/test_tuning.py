"""``python -m helion_backend tune``: arguments, manifest errors, the key loop (resumable, one line per key
with an ETA) and the per-key selection, on the CPU with injected tuners and timers; one GPU run end to end."""

import io
import json
import math

import helion
import pytest
import torch

import benchmarks.common
from helion_backend import dispatch, timing, tuning
from helion_backend.__main__ import main
from helion_backend.kernels import configs
from helion_backend.manifest import ManifestSite
from helion_backend.tuning import ConfigTable, TuneError, TuneKey

CUDA = torch.device("cuda")  # a device object only, except in the GPU test


def config(block_n: int, split_k: int = 1) -> helion.Config:
    return helion.Config(block_sizes=[16, block_n, 128], num_warps=4, num_stages=3, split_k=split_k)


def write_manifest(path, sites):
    path.write_text(json.dumps({"version": 1, "sites": [s.to_json() for s in sites]}))
    return path


def key(m: int, k: int = 4096, n: int = 12288, epilogue=("bias", "gelu_tanh")) -> TuneKey:
    return TuneKey("gemm", epilogue, "bfloat16", k, n, m)


def fake_entry(key: TuneKey, us: float = 5.0) -> dict:
    return {"dtype": key.dtype, "k": key.k, "n": key.n, "m": key.m, "config": dict(config(64)),
            "us": us, "fallback_us": 6.0, "helion_wins": us < 6.0}


# --- arguments and manifest errors -----------------------------------------------------------------


@pytest.fixture
def manifest(tmp_path):
    site = ManifestSite.declared("gemm", ("bias",), "bfloat16", 1024, 256, m=4, helion_limit=32)
    return write_manifest(tmp_path / "manifest.json", [site])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--effort", "medium"], "argument --effort: invalid choice: 'medium'"),
        (["--num-tokens", "1,x"], "argument --num-tokens: expected a comma-separated list of positive integers"),
        (["--num-tokens", "0,4"], "argument --num-tokens"),
        (["--num-tokens", ""], "argument --num-tokens"),
        (["--budget-per-key", "-5"], "argument --budget-per-key: expected a positive number of seconds"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(manifest, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["tune", str(manifest), *argv])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_num_tokens_parse_sorted_and_unique():
    assert tuning.parse_num_tokens("16,1,4,4") == (1, 4, 16)


def test_help_explains_the_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for words in ("manifest.json", "configs/<gpu>.json", "--num-tokens", "--budget-per-key", "--force", "exit status"):
        assert words in out


def test_missing_manifest_names_the_path(tmp_path, capsys):
    path = tmp_path / "nowhere" / "manifest.json"
    assert main(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"no manifest at {path}" in err


def test_corrupt_manifest_names_the_path(tmp_path, capsys):
    path = tmp_path / "manifest.json"
    path.write_text('{"version": 1, "sites": [{"kernel": "gemm", "k": 3}]}')
    assert main(["tune", str(path)]) == 2
    assert f"{path}: site #0: missing field(s)" in capsys.readouterr().err


def test_no_cuda_device_exits_2(manifest, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune", str(manifest)]) == 2
    assert "error: no CUDA device" in capsys.readouterr().err


def test_manifest_without_a_key_to_tune_is_no_error(tmp_path, capsys):
    site = ManifestSite.declared("gemm", ("bias",), "bfloat16", 1024, 256, m=None, helion_limit=0)
    assert main(["tune", str(write_manifest(tmp_path / "manifest.json", [site]))]) == 0
    assert "nothing to tune" in capsys.readouterr().err


# --- keys ------------------------------------------------------------------------------------------


def test_keys_are_static_m_and_num_tokens_up_to_the_dynamic_limit():
    sites = [
        ManifestSite("gemm", ("bias",), "bfloat16", 4096, 1024, frozenset({3, 64}), dynamic_m_limit=8),
        ManifestSite("gemm", ("bias", "gelu_tanh"), "bfloat16", 4096, 12288, frozenset({1})),
    ]
    keys = tuning.expand_keys(sites, num_tokens=(1, 2, 4, 8, 16))
    assert [(k.n, k.m) for k in keys] == [(1024, 1), (1024, 2), (1024, 3), (1024, 4), (1024, 8), (1024, 64),
                                          (12288, 1)]


def test_one_key_per_shape_tuned_with_the_longest_epilogue():
    sites = [ManifestSite("gemm", epilogue, "bfloat16", 4096, 1024, frozenset({1}))
             for epilogue in [("bias",), ("bias", "gelu_tanh", "residual"), ("bias", "silu")]]
    assert tuning.expand_keys(sites, num_tokens=()) == [key(1, n=1024, epilogue=("bias", "gelu_tanh", "residual"))]


# --- the loop --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_loop(table_path, keys, tune_one, *, force=False, budget_s=None, clock=None):
    progress = io.StringIO()
    table = ConfigTable.load(table_path, "python -m helion_backend tune m.json")
    summary = tuning.tune_all(keys, table, tune_one, lambda: {"device": "test"}, force=force, budget_s=budget_s,
                              progress=progress, clock=clock or FakeClock())
    return summary, progress.getvalue().splitlines()


def table_keys(path) -> list[int]:
    return [e["m"] for e in json.loads(path.read_text())["entries"]]


def test_each_key_is_written_before_the_next_starts_and_skipped_on_a_rerun(tmp_path):
    path = tmp_path / "configs" / "test_gpu.json"
    keys = [key(1), key(2), key(4)]
    seen_on_disk = []

    def tune_one(k):
        seen_on_disk.append(table_keys(path) if path.exists() else [])
        return fake_entry(k)

    summary, _ = run_loop(path, keys, tune_one)
    assert summary.tuned == 3 and not summary.failed
    assert seen_on_disk == [[], [1], [1, 2]]
    assert table_keys(path) == [1, 2, 4]

    def must_not_run(k):
        raise AssertionError(f"{k} tuned again")

    summary, lines = run_loop(path, keys + [key(8)], lambda k: must_not_run(k) if k.m != 8 else fake_entry(k))
    assert (summary.tuned, summary.skipped) == (1, 3)
    assert all("skipped" in line for line in lines[:3])
    assert table_keys(path) == [1, 2, 4, 8]

    retuned = []
    summary, _ = run_loop(path, keys, lambda k: retuned.append(k.m) or fake_entry(k, us=7.0), force=True)
    assert retuned == [1, 2, 4] and summary.skipped == 0
    assert [e["us"] for e in json.loads(path.read_text())["entries"]] == [7.0, 7.0, 7.0, 5.0]


def test_table_has_the_shipped_format_and_command_history(tmp_path):
    path = tmp_path / "test_gpu.json"
    run_loop(path, [key(1)], fake_entry)
    run_loop(path, [key(2)], fake_entry)
    data = json.loads(path.read_text())
    assert data["metadata"] == {"device": "test", "commands": ["python -m helion_backend tune m.json"]}
    assert [sorted(e) for e in data["entries"]] == [sorted(fake_entry(key(1)))] * 2


def test_a_failing_key_is_reported_and_the_rest_go_on(tmp_path):
    path = tmp_path / "test_gpu.json"

    def tune_one(k):
        if k.m == 2:
            raise TuneError("no valid config among 3 autotuned")
        return fake_entry(k)

    summary, lines = run_loop(path, [key(1), key(2), key(4)], tune_one)
    assert summary.tuned == 2 and summary.failed == [f"{key(2)}: no valid config among 3 autotuned"]
    assert any(line.startswith("[2/3]") and "FAILED" in line for line in lines)
    assert table_keys(path) == [1, 4]


def test_progress_lines_count_keys_and_estimate_the_time_left(tmp_path):
    clock = FakeClock()
    durations = iter([30.0, 90.0, 60.0])

    def tune_one(k):
        clock.now += next(durations)
        return fake_entry(k, us=5.0 if k.m != 4 else 8.0)

    path = tmp_path / "test_gpu.json"
    ConfigTable.load(path, "earlier").put(fake_entry(key(2)), {})  # tuned by an earlier run
    keys = [key(1), key(2), key(4), key(8)]
    _, lines = run_loop(path, keys, tune_one, budget_s=100, clock=clock)
    assert lines == [
        f"[1/4] {key(1)}: tuning; ETA ~5m00s (budget)",  # 3 keys to tune, 100 s budget each
        f"[1/4] {key(1)}: 5.0 us, torch.compile 6.0 us (Helion wins); 30s, saved",
        f"[2/4] {key(2)}: in the table already, skipped (--force retunes)",
        f"[3/4] {key(4)}: tuning; ETA 1m00s",  # 2 keys left at 30 s each so far
        f"[3/4] {key(4)}: 8.0 us, torch.compile 6.0 us (torch.compile wins); 1m30s, saved",
        f"[4/4] {key(8)}: tuning; ETA 1m00s",  # 1 key left at (30 + 90) / 2 s
        f"[4/4] {key(8)}: 5.0 us, torch.compile 6.0 us (Helion wins); 1m00s, saved",
    ]


def test_eta_without_budget_or_history_is_unknown():
    assert tuning.eta([], 3, None) == "unknown"
    assert tuning.format_duration(7300) == "2h01m"


def test_corrupt_user_table_is_not_overwritten(tmp_path):
    path = tmp_path / "test_gpu.json"
    path.write_text("{oops")
    with pytest.raises(TuneError, match=str(path)):
        ConfigTable.load(path, "cmd")
    assert path.read_text() == "{oops"


# --- one key ---------------------------------------------------------------------------------------


def reference_kernel(x, w_kn, steps, operands, scalars, out_dtype, config):
    return dispatch.reference(x, w_kn, steps, operands, scalars, out_dtype)


def test_fastest_valid_drops_wrong_and_failing_configs():
    reference = torch.ones(4, 8, dtype=torch.float64)
    results = {32: reference * 1.001, 64: reference * 1.5, 128: reference * math.nan, 256: None}
    times = {32: 9.0, 64: 1.0, 128: 1.0, 256: 1.0}
    ran = []

    def run(cfg, i):
        ran.append(cfg)
        out = results[cfg["block_sizes"][1]]
        if out is None:
            raise RuntimeError("does not compile")
        return out

    def timer(step):
        step(0)
        return times[ran[-1]["block_sizes"][1]]

    best = tuning.fastest_valid([config(64), config(32), config(128), config(256), config(32)], run, reference, timer)
    assert best.config == config(32) and best.us == 9.0 and best.error == pytest.approx(1e-3)
    assert tuning.fastest_valid([config(64)], run, reference, timer) is None


@pytest.fixture
def cpu_table_dir(tmp_path, monkeypatch):
    """Config tables read as if this CPU were a GPU called test_gpu, with no shipped table."""
    monkeypatch.setattr(configs, "TUNED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(configs, "gpu_key", lambda device: "test_gpu")
    for cache in (configs._table, configs.config_for, configs.measured_crossover):
        cache.cache_clear()
    yield tmp_path / "configs"
    for cache in (configs._table, configs.config_for, configs.measured_crossover):
        cache.cache_clear()


def test_tune_key_validates_every_split_and_writes_an_entry_the_backend_loads(cpu_table_dir):
    k = key(4, k=2048, n=64, epilogue=("bias", "residual"))  # K = 2048: split-K 1 and 2 are tried
    tuned = {1: config(32, split_k=1), 2: config(64, split_k=2)}
    searched = []

    def tuner(inputs, split_k, effort, budget_s):
        searched.append((split_k, effort, budget_s))
        x, w_kn, steps, operands, _, out_dtype = inputs.args(0)
        assert (x.shape, w_kn.shape, steps, [o.shape for o in operands], out_dtype) == (
            (4, 2048), (2048, 64), ("bias", "residual"), [(64,), (4, 64)], torch.bfloat16)
        return tuned[split_k]

    def wrong_for_one_config(x, w_kn, steps, operands, scalars, out_dtype, config):
        out = dispatch.reference(x, w_kn, steps, operands, scalars, out_dtype)
        return out * 2 if config == tuned[2] else out

    timed = []

    def timer(step):
        timed.append(step)
        return [3.0, 3.5, 4.5][len(timed) - 1]  # the valid configs in order (tuned, current), then the fallback

    entry = tuning.tune_key(k, torch.device("cpu"), effort="quick", budget_s=61, tuner=tuner, timer=timer,
                            kernel=wrong_for_one_config)
    assert searched == [(1, "quick", 30), (2, "quick", 30)]  # the budget is shared by the splits
    assert len(timed) == 3
    assert entry["config"] == dict(tuned[1]) and entry["candidates"] == 3
    assert (entry["us"], entry["fallback_us"], entry["helion_wins"]) == (3.0, 4.5, True)
    assert entry["error"] < 1e-2 and entry["effort"] == "quick" and entry["epilogue"] == ["bias", "residual"]

    ConfigTable.load(cpu_table_dir / "test_gpu.json", "cmd").put(entry, tuning.table_metadata(torch.device("cpu")))
    user_dir = str(cpu_table_dir)
    assert configs.config_for(4, 2048, 64, torch.bfloat16, CUDA, user_dir) == tuned[1]
    assert configs.measured_crossover(2048, 64, torch.bfloat16, CUDA, user_dir) is None  # Helion won


def test_tune_key_keeps_todays_config_when_the_search_finds_nothing_better(cpu_table_dir):
    def tuner(inputs, split_k, effort, budget_s):
        return config(16, split_k=split_k)

    timings = iter([9.0, 2.0, 2.5])  # the autotuned config, today's, the fallback
    entry = tuning.tune_key(key(4, k=1024, n=64), torch.device("cpu"), effort="full", budget_s=None, tuner=tuner,
                            timer=lambda step: next(timings), kernel=reference_kernel)
    assert entry["config"] == dict(configs.default_config(4, 1024, 64, torch.bfloat16))
    assert (entry["us"], entry["helion_wins"]) == (2.0, True)


def test_tune_key_without_a_valid_config_fails_with_the_reasons(cpu_table_dir):
    def tuner(inputs, split_k, effort, budget_s):
        raise RuntimeError(f"Helion failed at split {split_k}")

    def broken(*args, config):
        return torch.full((1, 64), math.nan)

    with pytest.raises(TuneError, match="no valid config among 1 .split_k=1: RuntimeError: Helion failed at split 1"):
        tuning.tune_key(key(1, k=1024, n=64), torch.device("cpu"), effort="quick", budget_s=None, tuner=tuner,
                        timer=lambda step: 1.0, kernel=broken)


def test_split_k_choices_keep_each_split_deep():
    assert configs.split_k_choices(1024) == [1]
    assert configs.split_k_choices(4096) == [1, 2, 4]
    assert configs.split_k_choices(25600) == [1, 2, 4, 8, 16]


def test_benchmarks_share_the_package_timing_helpers():
    for name in ("TimingConfig", "capture_calls", "median_replay_ms", "time_callable_us", "relative_error",
                 "run_metadata"):
        assert getattr(benchmarks.common, name) is getattr(timing, name)


# --- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_tune_one_small_key_end_to_end(tmp_path, capsys):
    site = ManifestSite.declared("gemm", ("bias", "gelu_tanh"), "bfloat16", 1024, 256, m=4, helion_limit=32)
    manifest = write_manifest(tmp_path / "manifest.json", [site])
    assert main(["tune", str(manifest), "--effort", "quick", "--budget-per-key", "20"]) == 0
    user_dir = tmp_path / "configs"
    table = json.loads((user_dir / f"{configs.gpu_key(CUDA)}.json").read_text())
    (entry,) = table["entries"]
    assert (entry["dtype"], entry["k"], entry["n"], entry["m"]) == ("bfloat16", 1024, 256, 4)
    assert entry["us"] > 0 and entry["fallback_us"] > 0 and entry["error"] <= tuning.TOLERANCE
    loaded = configs.config_for(4, 1024, 256, torch.bfloat16, CUDA, str(user_dir))
    assert loaded == helion.Config(**entry["config"])
    assert "[1/1]" in capsys.readouterr().err
    # A rerun finds the key done.
    assert main(["tune", str(manifest)]) == 0
    assert "skipped" in capsys.readouterr().err


@pytest.mark.parametrize("kernel", ["gemm_fp8", "gemm_glu"])
def test_keys_of_other_kernel_families_are_refused_with_the_reason(kernel):
    """The tuner drives the bf16 GEMM kernel; a manifest key of another family fails alone, saying so."""
    key = TuneKey(kernel, ("bias",), "bfloat16", 256, 128, 4)
    with pytest.raises(TuneError, match=f"autotunes the gemm family only; {kernel} keys keep"):
        tuning.tune_key(key, torch.device("cpu"), effort="quick", budget_s=1)
