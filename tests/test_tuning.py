"""``python -m helion_backend tune``: arguments, manifest errors, the key loop (resumable, one line per key
with an ETA) and the per-key searches and selection of every kernel family, on the CPU with injected tuners
and timers and the kernels replaced by the reference; on a GPU, one small key per family end to end."""

import functools
import io
import json
import math
import os

import helion
import pytest
import torch

import benchmarks.common
from helion_backend import tables
from helion_backend.__main__ import main
from helion_backend.kernels import configs
from helion_backend.kernels.gemm import Layout, Signature, check_operands, norm_kernel_config
from helion_backend.manifest import ManifestSite
from helion_backend.runtime import dispatch
from helion_backend.tuning import loop as tuning
from helion_backend.tuning import problems as tuning_problems
from helion_backend.tuning import timing
from helion_backend.tuning.candidates import candidates_for
from helion_backend.tuning.loop import ConfigTable, TuneError, TuneKey
from helion_backend.tuning.problems import QUANT_FORMAT_OF, build_problem, quantized_site

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
    site = ManifestSite.declared("gemm", ("bias",), "bfloat16", 1024, 256, m=4, max_helion_m=32)
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
    for words in ("manifest.json", "configs/<gpu>.json", "--num-tokens", "--budget-per-key", "--force", "--table",
                  "gemm_multi", "gemm_fp8_block", "exit status", "{sweep,quick,full}", "fixed list of candidate configs",
                  "--write-manifest"):
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
    site = ManifestSite.declared("gemm", ("bias",), "bfloat16", 1024, 256, m=None, max_helion_m=0)
    assert main(["tune", str(write_manifest(tmp_path / "manifest.json", [site]))]) == 0
    assert "nothing to tune" in capsys.readouterr().err


# --- keys ------------------------------------------------------------------------------------------


def test_keys_are_static_m_and_num_tokens_up_to_the_dynamic_limit():
    sites = [
        ManifestSite("gemm", ("bias",), "bfloat16", 4096, 1024, frozenset({3, 64}), max_helion_m=8),
        ManifestSite("gemm", ("bias", "gelu_tanh"), "bfloat16", 4096, 12288, frozenset({1})),
    ]
    keys = tuning.expand_keys(sites, num_tokens=(1, 2, 4, 8, 16))
    assert [(k.n, k.m) for k in keys] == [(1024, 1), (1024, 2), (1024, 3), (1024, 4), (1024, 8), (1024, 64),
                                          (12288, 1)]


def test_one_key_per_shape_tuned_with_the_longest_epilogue():
    sites = [ManifestSite("gemm", epilogue, "bfloat16", 4096, 1024, frozenset({1}))
             for epilogue in [("bias",), ("bias", "gelu_tanh", "residual"), ("bias", "silu")]]
    assert tuning.expand_keys(sites, num_tokens=()) == [key(1, n=1024, epilogue=("bias", "gelu_tanh", "residual"))]


def test_a_fused_norm_outranks_a_longer_epilogue_and_widths_are_kept():
    sites = [
        ManifestSite("gemm", ("bias", "gelu_tanh"), "bfloat16", 4096, 1024, frozenset({1, 32})),
        ManifestSite("gemm", (), "bfloat16", 4096, 1024, frozenset({1}), prologue=("rmsnorm",)),
        ManifestSite("gemm_multi", (), "bfloat16", 4096, 6144, frozenset({1}), prologue=("rmsnorm",),
                     widths=(4096, 1024, 1024)),
    ]
    keys = tuning.expand_keys(sites, num_tokens=())
    assert [(k.kernel, k.m, k.prologue, k.epilogue, k.widths) for k in keys] == [
        ("gemm", 1, ("rmsnorm",), (), ()),
        ("gemm", 32, (), ("bias", "gelu_tanh"), ()),
        ("gemm_multi", 1, ("rmsnorm",), (), (4096, 1024, 1024)),
    ]
    assert str(keys[2]) == "gemm_multi bfloat16 K=4096 N=6144 (4096+1024+1024) M=1 [rmsnorm -> no epilogue]"


# --- the loop --------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_loop(table_path, keys, tune_one, *, force=False, budget_s=None, clock=None, **options):
    progress = io.StringIO()
    table = ConfigTable.load(table_path, "python -m helion_backend tune m.json")
    summary = tuning.tune_all(keys, table, tune_one, lambda: {"device": "test"}, force=force, budget_s=budget_s,
                              progress=progress, clock=clock or FakeClock(), **options)
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
    monkeypatch.setattr(tables, "TUNED_DIR", tmp_path / "shipped")
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    configs.forget_tables()
    yield tmp_path / "configs"
    configs.forget_tables()


@pytest.fixture
def reference_kernels(monkeypatch):
    """Every family's kernel replaced by the reference, recording the configs it is run with (a config
    equal to ``wrong`` computes twice the result). The operands are checked as the kernels check them."""
    ran, wrong = [], []

    def run_kernel(family, x, w_kn, steps, operands, scalars, out_dtype, config_dir=None, program=None, up_kn=None,
                   weight_scale=None, norm=None, config=None):
        check_operands(Signature(Layout.of(x), Layout.of(w_kn), tuple(map(Layout.of, operands)), len(scalars),
                                 tuple(steps), out_dtype))
        ran.append(config)
        out = dispatch.unfused(x, w_kn, steps, operands, scalars, out_dtype, program, up_kn, weight_scale, norm)
        return out * 2 if config in wrong else out

    def multi_gemm_helion(x, w_kns, steps, operands, scalars, out_dtype, config=None, config_dir=None, norm=None):
        ran.append(config)
        return dispatch.unfused_multi(x, w_kns, steps, operands, scalars, out_dtype, norm)

    monkeypatch.setattr(tuning_problems, "run_kernel", run_kernel)
    monkeypatch.setattr(tuning_problems, "multi_gemm_helion", multi_gemm_helion)
    return ran, wrong


def fixed_times(table: dict[str, float]):
    """A timer by what it times: ``"current"`` (today's config), ``"tuned"`` (any other config), and the
    fallback or an extra timing (``"other"``); nothing runs, so nothing compiles."""
    def timer(step):
        if isinstance(step, functools.partial):
            return table["current"] if step.args[0] == timer.current else table["tuned"]
        return table["other"]
    return timer


def test_tune_key_validates_every_split_and_writes_an_entry_the_backend_loads(cpu_table_dir, reference_kernels):
    _, wrong = reference_kernels
    # K = 2048: split-K 1 and 2 are searched; 16 rows: no GEMV form
    k = key(16, k=2048, n=64, epilogue=("bias", "residual"))
    tuned = {1: config(32, split_k=1), 2: config(64, split_k=2)}
    wrong.append(tuned[2])
    searched = []

    def tuner(search, effort, budget_s):
        searched.append((dict(search.fixed), effort, budget_s))
        assert search.seed["split_k"] == search.fixed["split_k"] and search.overrides == search.fixed
        return tuned[search.fixed["split_k"]]

    timed = []

    def timer(step):
        timed.append(step)
        return [3.0, 3.5, 4.5][len(timed) - 1]  # the valid configs in order (tuned, current), then the fallback

    entry = tuning.tune_key(k, torch.device("cpu"), effort="quick", budget_s=61, tuner=tuner, timer=timer)
    assert searched == [({"split_k": 1}, "quick", 30), ({"split_k": 2}, "quick", 30)]  # the budget is shared
    assert len(timed) == 3
    assert entry["config"] == dict(tuned[1]) and entry["candidates"] == 3 and "kernel" not in entry
    assert (entry["us"], entry["fallback_us"], entry["helion_wins"]) == (3.0, 4.5, True)
    assert entry["error"] < 1e-2 and entry["effort"] == "quick" and entry["epilogue"] == ["bias", "residual"]

    ConfigTable.load(cpu_table_dir / "test_gpu.json", "cmd").put(entry, tuning.table_metadata(torch.device("cpu")))
    user_dir = str(cpu_table_dir)
    assert configs.config_for(16, 2048, 64, torch.bfloat16, CUDA, user_dir) == tuned[1]
    decided = tables.decision(16, 2048, 64, torch.bfloat16, CUDA, user_dir)
    assert (decided.evidence, decided.helion, decided.lead) == ("exact", True, 1.5)  # 4.5 us against 3.0


def test_tune_key_keeps_todays_config_when_the_search_finds_nothing_better(cpu_table_dir, reference_kernels):
    def tuner(search, effort, budget_s):
        return config(16, split_k=search.fixed["split_k"])

    timings = iter([9.0, 2.0, 2.5])  # the autotuned config, today's, the fallback
    entry = tuning.tune_key(key(16, k=1024, n=64), torch.device("cpu"), effort="full", budget_s=None, tuner=tuner,
                            timer=lambda step: next(timings))
    assert entry["config"] == dict(configs.default_config(16, 1024, 64, torch.bfloat16))
    assert (entry["us"], entry["helion_wins"]) == (2.0, True)


def test_tune_key_without_a_valid_config_fails_with_the_reasons(cpu_table_dir, monkeypatch):
    def tuner(search, effort, budget_s):
        raise RuntimeError(f"Helion failed at {search}")

    monkeypatch.setattr(tuning_problems, "run_kernel", lambda *args, config: torch.full((1, 64), math.nan))
    # One search per value of the keys a search cannot change (at one row: the dot and the GEMV), each named.
    failures = (r"split_k=1, gemv=False: RuntimeError: Helion failed at split_k=1, gemv=False; "
                r"split_k=1, gemv=True: RuntimeError: Helion failed at split_k=1, gemv=True")
    with pytest.raises(TuneError, match=rf"no valid config among 1 \({failures}\)"):
        tuning.tune_key(key(1, k=1024, n=64), torch.device("cpu"), effort="quick", budget_s=None, tuner=tuner,
                        timer=lambda step: 1.0)


def never_search(search, effort, budget_s):
    raise AssertionError(f"the sweep effort ran Helion's autotuner at {search}")


def test_sweep_effort_times_the_familys_candidates_and_todays_config_without_searching(cpu_table_dir,
                                                                                    reference_kernels):
    _, wrong = reference_kernels
    k = key(4, k=1024, n=64, epilogue=("bias",))
    problem = build_problem(k, torch.device("cpu"))
    candidates = candidates_for(k)
    assert problem.current not in candidates and len(candidates) > 3
    fastest, runner_up = candidates[2], candidates[-1]
    wrong.append(fastest)  # the fastest computes the wrong result: dropped
    times = {fastest: 1.0, runner_up: 2.0}
    timed = []

    def timer(step):
        if not isinstance(step, functools.partial):  # the fallback
            return 9.0
        timed.append(step.args[0])
        return times.get(step.args[0], 5.0)

    clock = iter([100.0, 112.25])
    entry = tuning.tune_key(k, torch.device("cpu"), effort="sweep", budget_s=None, tuner=never_search, timer=timer,
                            clock=lambda: next(clock))
    assert timed == [c for c in candidates if c != fastest] + [problem.current]  # each valid one once, in order
    assert entry["config"] == dict(runner_up) and (entry["us"], entry["fallback_us"]) == (2.0, 9.0)
    assert (entry["effort"], entry["seconds"], entry["candidates"]) == ("sweep", 12.2, len(candidates) + 1)


def test_sweep_effort_keeps_todays_config_when_no_candidate_beats_it(cpu_table_dir, reference_kernels):
    k = key(1, k=1024, n=64, epilogue=("bias",))
    current = build_problem(k, torch.device("cpu")).current

    def timer(step):
        return 1.0 if isinstance(step, functools.partial) and step.args[0] == current else 3.0

    entry = tuning.tune_key(k, torch.device("cpu"), effort="sweep", budget_s=60, tuner=never_search, timer=timer)
    assert entry["config"] == dict(current) and entry["us"] == 1.0


def test_an_unknown_effort_is_refused_before_any_work():
    def problem_of(key, device):
        raise AssertionError("built a problem")

    with pytest.raises(TuneError, match=r"unknown effort 'medium'; one of \['sweep', 'quick', 'full'\]"):
        tuning.tune_key(key(1), CUDA, effort="medium", budget_s=1, problem_of=problem_of)


def family_key(kernel: str, fused: bool = False) -> TuneKey:
    """A small key of ``kernel`` as a compile records it (the float ones with their RMSNorm; the quantized ones
    as the option ``fuse_activation_quant`` says), at more rows than the GEMV form is searched at (its
    searches have tests of their own)."""
    m = tuning_problems.GEMV_MAX_M + 1
    if kernel in QUANT_FORMAT_OF:
        dtype, prologue, steps = quantized_site(kernel, fused)
        return TuneKey(kernel, (*steps, "gelu_tanh", "residual"), dtype, 1024, 256, m, prologue=prologue)
    widths = (128, 64, 64) if kernel == "gemm_multi" else ()
    epilogue = {"gemm": ("bias", "gelu_tanh"), "gemm_glu": ("silu", "up_mul"), "gemm_multi": ("relu",)}[kernel]
    return TuneKey(kernel, epilogue, "bfloat16", 2048, sum(widths) or 128, m, widths, ("rmsnorm",))


FAMILIES = ["gemm", "gemm_glu", "gemm_multi", *QUANT_FORMAT_OF]
# Each family's sites as compiled by default, and fp8's and int8's also with their activation quantized in the kernel.
QUANT_IN_KERNEL_FAMILIES = ("gemm_fp8", "gemm_int8")
FAMILY_CASES = [*((kernel, False) for kernel in FAMILIES), *((kernel, True) for kernel in QUANT_IN_KERNEL_FAMILIES)]
FAMILY_IDS = [kernel + ("-kernel_quant" if fused else "") for kernel, fused in FAMILY_CASES]


@pytest.mark.parametrize("kernel, fused", FAMILY_CASES, ids=FAMILY_IDS)
def test_every_family_searches_its_own_keys_and_records_the_table_layout(kernel, fused, cpu_table_dir,
                                                                         reference_kernels):
    ran, _ = reference_kernels
    k = family_key(kernel, fused)
    assert ("token_scale" in k.epilogue) == (kernel in QUANT_IN_KERNEL_FAMILIES and not fused), k
    problem = build_problem(k, torch.device("cpu"))
    searches = []

    def tuner(search, effort, budget_s):
        """What Helion would return: a config of the searched kernel, in its own layout."""
        searches.append(search)
        found = helion.Config(**{**search.seed, "num_warps": 8})
        return norm_kernel_config(found) if kernel == "gemm" else found

    timer = fixed_times({"current": 2.0, "tuned": 1.0, "other": 1.5})
    timer.current = problem.current
    entry = tuning.tune_key(k, torch.device("cpu"), effort="quick", budget_s=12, tuner=tuner, timer=timer)

    splits = [{"split_k": s} for s in configs.split_k_choices(k.k)]
    # prequantize is searched where the kernel quantizes the rows (block fp8's always does), a pre-quantized
    # site keeping today's; paired_loads for int4; swap_ab for fp8, int8, int8 and int4 weight-only, never on
    # rows the kernel would quantize nor with int4's paired_loads.
    def with_both(ours: str) -> list[dict]:
        return [{**s, ours: value} for s in splits for value in (False, True)]

    swapped = with_both("swap_ab")
    prequantize_swapped = [{**s, "prequantize": p, "swap_ab": w} for s in splits for p in (False, True)
                           for w in (False, True) if p or not w]
    expected = {"gemm_glu": [{}], "gemm_multi": [{}], "gemm_fp8": prequantize_swapped if fused else swapped,
                "gemm_int8": prequantize_swapped if fused else swapped, "gemm_weight_only": swapped,
                "gemm_fp8_block": with_both("prequantize"),
                "gemm_int4": [{**s, "paired_loads": p, "swap_ab": w} for s in splits for p in (False, True)
                              for w in (False, True) if not (p and w)]}.get(kernel, splits)
    assert [dict(s.fixed) for s in searches] == expected
    best = problem.table_config(tuner(searches[0], "quick", 1), searches[0])
    ours = {"gemm_fp8_block": "prequantize", "gemm_int4": "paired_loads"}.get(kernel, "prequantize")
    if kernel in (*QUANT_IN_KERNEL_FAMILIES, "gemm_fp8_block", "gemm_int4"):
        assert ours in best, best
    assert entry["config"] == dict(best) and entry["config"]["num_warps"] == 8 and best in ran
    assert (entry["us"], entry["fallback_us"], entry["helion_wins"]) == (1.0, 1.5, True)
    prologue = {"prologue": list(k.prologue)} if k.prologue else {}  # an entry names a prologue only where there is one
    assert {"kernel": kernel, "dtype": k.dtype, "k": k.k, "n": k.n, "m": k.m, **prologue}.items() \
        <= {"kernel": "gemm", **entry}.items()
    if kernel == "gemm":  # the norm kernel's [K, M, N] blocks, back in the table's [M, N, K]
        assert best == helion.Config(**{**searches[0].seed, "num_warps": 8})
    if kernel == "gemm_glu":
        assert "split_k" not in entry["config"] and entry["epilogue"] == ["silu", "up_mul"]
    if kernel == "gemm_multi":
        assert entry["widths"] == [128, 64, 64] and entry["separate_us"] == 1.5
        assert entry["epilogue"] == []  # tuned without its outputs' epilogues
    else:
        assert entry["epilogue"] == list(k.epilogue)

    ConfigTable.load(cpu_table_dir / "test_gpu.json", "cmd").put(entry, {})
    dtype = tuning_problems.RULE_DTYPES[k.dtype]
    assert configs.config_for(k.m, k.k, k.n, dtype, CUDA, str(cpu_table_dir), kernel) == best


@pytest.mark.parametrize("m, ours", [(1, {configs.GEMV: (False, True)}), (tuning_problems.GEMV_MAX_M,
                                      {configs.GEMV: (False, True)}), (tuning_problems.GEMV_MAX_M + 1, {})])
def test_the_16_bit_gemm_searches_its_gemv_form_at_a_few_rows_only(m, ours):
    """Helion's search cannot switch between a dot and a GEMV (a constant of ours), so up to ``GEMV_MAX_M`` rows
    each split is searched both ways; past it the GEMV's multiply-adds a weight outweigh its read."""
    problem = build_problem(TuneKey("gemm", ("bias",), "bfloat16", 2048, 128, m), torch.device("cpu"))
    assert dict(problem.searched) == {"split_k": configs.split_k_choices(2048), **ours}


@pytest.mark.parametrize("tune_key, ours", [
    (TuneKey("gemm_fp8", ("token_scale", "channel_scale"), "float8_e4m3fn", 256, 256, 1), {"gemv", "swap_ab"}),
    (TuneKey("gemm_fp8", ("token_scale", "channel_scale"), "float8_e4m3fn", 256, 256, 8), {"gemv", "swap_ab"}),
    (TuneKey("gemm_fp8", ("token_scale", "channel_scale"), "float8_e4m3fn", 256, 256, 16), {"swap_ab"}),
    (TuneKey("gemm_int8", ("act_scale", "channel_scale"), "int8", 256, 256, 1, prologue=("quant_int8_per_token",)),
     {"prequantize", "gemv", "swap_ab"}),
    (TuneKey("gemm_weight_only", ("channel_scale",), "bfloat16", 256, 256, 1, prologue=("dequant_int8",)),
     {"gemv", "swap_ab"}),
    (TuneKey("gemm_int4", (), "bfloat16", 256, 256, 1, prologue=("dequant_int4",)),
     {"paired_loads", "gemv", "swap_ab"}),
    (TuneKey("gemm_int4", (), "bfloat16", 256, 256, 2, prologue=("dequant_int4",)),
     {"paired_loads", "gemv", "swap_ab"}),
    (TuneKey("gemm_int4", (), "bfloat16", 256, 256, 16, prologue=("dequant_int4",)),
     {"paired_loads", "swap_ab"}),
    (TuneKey("gemm_fp8_block", (), "bfloat16", 256, 256, 8, prologue=("quant_fp8_per_group", "dequant_fp8_block")),
     {"prequantize"}),
])
def test_the_quantized_gemms_search_the_gemv_at_a_few_rows_and_the_swap(tune_key, ours):
    """fp8, int8 and weight-only int8 also run the GEMV kernel at a few rows and the swapped kernel at any M, both
    on rows quantized first; int4 both on its packed weight; block fp8 neither."""
    assert set(tuning_problems.wrapper_keys(tune_key)) == ours


def test_the_gemv_is_searched_once_on_quantized_rows():
    """Where the site quantizes its own rows the GEMV always runs on rows quantized first, so its search
    with ``prequantize`` off would repeat the one with it on, and is not made; nor is a split GEMV."""
    searched = {"split_k": [1, 2], configs.PREQUANTIZE: (False, True), configs.GEMV: (False, True)}
    problem = tuning_problems.Problem(run=None, reference=None, fallback=None, current=helion.Config(), epilogue=(),
                                      searched=searched)
    fixed = [tuple(search.fixed.values()) for search in problem.searches()]
    assert fixed == [(1, False, False), (1, True, False), (1, True, True), (2, False, False), (2, True, False)]


def test_the_swap_is_searched_on_quantized_rows_and_never_with_the_gemv():
    """The swapped kernel, like the GEMV, reads rows quantized first (no search with ``prequantize`` off); it
    splits K, and it is another form than the GEMV, so no search sets both."""
    searched = {"split_k": [1, 2], configs.PREQUANTIZE: (False, True), configs.GEMV: (False, True),
                configs.SWAP_AB: (False, True)}
    problem = tuning_problems.Problem(run=None, reference=None, fallback=None, current=helion.Config(), epilogue=(),
                                      searched=searched)
    fixed = [tuple(search.fixed.values()) for search in problem.searches()]
    assert fixed == [(1, False, False, False), (1, True, False, False), (1, True, False, True),
                     (1, True, True, False), (2, False, False, False), (2, True, False, False),
                     (2, True, False, True)]
    found = helion.Config(block_sizes=[16, 64, 256], num_warps=4, num_stages=3)
    swapped = next(search for search in problem.searches() if search.fixed[configs.SWAP_AB])
    assert problem.table_config(found, swapped) == helion.Config(**found, **swapped.fixed)


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rmsnorm"])
def test_the_gemv_searches_run_unsplit_and_keep_the_tables_layout(normed):
    """The GEMV kernel has no split-K, so no search pairs it with a split; it registers its block sizes in the
    table's order, so what Helion finds for it is stored as found, with or without the norm (whose dot
    kernel's K block comes first and is rotated)."""
    prologue = ("rmsnorm",) if normed else ()
    problem = build_problem(TuneKey("gemm", (), "bfloat16", 4096, 128, 1, prologue=prologue), torch.device("cpu"))
    searches = {tuple(search.fixed.items()): search for search in problem.searches()}
    assert set(searches) == {(("split_k", s), ("gemv", False)) for s in configs.split_k_choices(4096)} | {
        (("split_k", 1), ("gemv", True))}
    found = helion.Config(block_sizes=[1, 4, 512], num_warps=4, num_stages=1)
    gemv = searches[("split_k", 1), ("gemv", True)]
    assert problem.table_config(found, gemv)["block_sizes"] == [1, 4, 512]
    dot = searches[("split_k", 1), ("gemv", False)]
    assert problem.table_config(found, dot)["block_sizes"] == ([4, 512, 1] if normed else [1, 4, 512])


@pytest.mark.parametrize("tune_key, message", [
    (TuneKey("gemm_multi", (), "bfloat16", 256, 384, 1), "gemm_multi site recorded without its outputs' widths"),
    (TuneKey("gemm_fp8", ("act_scale",), "float8_e4m3fn", 256, 256, 1),  # pre-quantized: its scale is token_scale
     r"the gemm_fp8 layer computes the steps \['token_scale', 'channel_scale'\]; the site's epilogue "
     r"\['act_scale'\] does not start with them"),
    (TuneKey("gemm_fp8", ("bias",), "float8_e4m3fn", 256, 256, 1, prologue=("quant_fp8_per_token",)),
     r"the gemm_fp8 layer computes the steps \['act_scale', 'channel_scale', 'bias'\]; the site's epilogue "
     r"\['bias'\] does not start with them"),
    (TuneKey("gemm_int4", ("bias",), "int8", 256, 256, 1), "the gemm_int4 layer multiplies bfloat16 inputs, the "
     "site int8"),
    (TuneKey("gemm_unknown", (), "bfloat16", 256, 256, 1), "no tuning problem for the kernel family 'gemm_unknown'"),
])
def test_keys_that_cannot_be_rebuilt_fail_alone_saying_why(tune_key, message):
    with pytest.raises(TuneError, match=message):
        tuning.tune_key(tune_key, torch.device("cpu"), effort="quick", budget_s=1, timer=lambda step: 1.0)


def test_helions_accuracy_check_compares_the_kernel_arguments_of_every_family():
    """Tensors only (the epilogue callables are skipped), with a tolerance, and fp8/int8 inputs bitwise."""
    w = torch.randn(8, 8).to(torch.float8_e4m3fn)
    out = torch.randn(4, 8)
    tuning.assert_tensors_close((w, out, [out], lambda acc: acc), (w.clone(), out + 1e-3, [out], lambda acc: acc))
    with pytest.raises(AssertionError):
        tuning.assert_tensors_close((w, out), (w.clone(), out + 1))


def test_split_k_choices_keep_each_split_deep():
    assert configs.split_k_choices(1024) == [1]
    assert configs.split_k_choices(4096) == [1, 2, 4]
    assert configs.split_k_choices(25600) == [1, 2, 4, 8, 16]


def test_benchmarks_share_the_package_timing_helpers():
    for name in ("TimingConfig", "capture_calls", "median_replay_ms", "time_callable_us", "relative_error",
                 "run_metadata"):
        assert getattr(benchmarks.common, name) is getattr(timing, name)


# --- --table ---------------------------------------------------------------------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as the command's checks go, whose keys tune to a fixed entry."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    monkeypatch.setattr(tuning, "table_metadata", lambda device: {"device": "test"})
    monkeypatch.setattr(tuning, "tune_key", lambda key, **kwargs: fake_entry(key))
    monkeypatch.setattr(tuning, "default_tune_jobs", lambda: 1)  # --jobs: tests/test_tuning_warmup.py


def test_table_option_writes_that_file_with_the_command_history(manifest, tmp_path, fake_gpu, capsys):
    path = tmp_path / "shipped" / "nvidia_h200.json"
    ConfigTable.load(path, "python benchmarks/sweep_gemm_configs.py").put(fake_entry(key(1, k=1024, n=256)), {})
    assert main(["tune", str(manifest), "--table", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [e["m"] for e in data["entries"]] == [1, 4]
    assert data["metadata"]["commands"][0] == "python benchmarks/sweep_gemm_configs.py"
    assert len(data["metadata"]["commands"]) == 2
    assert not (manifest.parent / "configs").exists()  # not the user table
    assert f"-> {path}" in capsys.readouterr().err


@pytest.mark.parametrize("where, message", [
    (lambda tmp: tmp / "a_file" / "table.json", "cannot create the folder of the config table"),
    (lambda tmp: tmp, "is a folder; name a file"),
])
def test_an_unusable_table_path_is_refused_before_tuning(manifest, tmp_path, fake_gpu, capsys, where, message):
    (tmp_path / "a_file").write_text("")
    assert main(["tune", str(manifest), "--table", str(where(tmp_path))]) == 2
    assert message in capsys.readouterr().err


def test_sweep_effort_on_the_command_line_tunes_without_a_search_budget(manifest, tmp_path, fake_gpu, monkeypatch,
                                                                         capsys):
    calls = []
    monkeypatch.setattr(tuning, "tune_key", lambda key, **kwargs: calls.append(kwargs) or fake_entry(key))
    path = tmp_path / "table.json"
    assert main(["tune", str(manifest), "--effort", "sweep", "--table", str(path)]) == 0
    assert [(c["effort"], c["budget_s"]) for c in calls] == [("sweep", None)]
    err = capsys.readouterr().err
    assert f"1 key(s) from {manifest} -> {path} (effort sweep)" in err and "ETA unknown" in err
    assert main(["tune", str(manifest), "--effort", "full", "--budget-per-key", "9", "--force", "--table",
                 str(path)]) == 0
    assert [(c["effort"], c["budget_s"]) for c in calls[1:]] == [("full", 9)]
    assert "(effort full, 9s per key)" in capsys.readouterr().err


def test_table_and_cache_dir_exclude_each_other(manifest, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune", str(manifest), "--table", str(tmp_path / "t.json"), "--cache-dir", str(tmp_path)])
    assert info.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


# --- on a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_tune_one_small_key_end_to_end(tmp_path, capsys):
    site = ManifestSite.declared("gemm", ("bias", "gelu_tanh"), "bfloat16", 1024, 256, m=4, max_helion_m=32)
    manifest = write_manifest(tmp_path / "manifest.json", [site])
    assert main(["tune", str(manifest), "--effort", "quick", "--budget-per-key", "20"]) == 0
    user_dir = tmp_path / "configs"
    table = json.loads((user_dir / f"{tables.gpu_key(CUDA)}.json").read_text())
    (entry,) = table["entries"]
    assert (entry["dtype"], entry["k"], entry["n"], entry["m"]) == ("bfloat16", 1024, 256, 4)
    assert entry["us"] > 0 and entry["fallback_us"] > 0 and entry["error"] <= tuning.TOLERANCE
    loaded = configs.config_for(4, 1024, 256, torch.bfloat16, CUDA, str(user_dir))
    assert loaded == helion.Config(**entry["config"])
    assert "[1/1]" in capsys.readouterr().err
    # A rerun finds the key done.
    assert main(["tune", str(manifest)]) == 0
    assert "skipped" in capsys.readouterr().err


def gpu_family_site(kernel: str, fused: bool = False) -> ManifestSite:
    """A small site of ``kernel`` at M = 4, K = 1024, as a compile records it."""
    k = family_key(kernel, fused)
    n = 1536 if kernel == "gemm_multi" else 1024
    widths = (1024, 256, 256) if kernel == "gemm_multi" else ()
    return ManifestSite.declared(kernel, k.epilogue, k.dtype, 1024, n, m=4, max_helion_m=32, prologue=k.prologue,
                                 widths=widths)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, fused", FAMILY_CASES, ids=FAMILY_IDS)
def test_every_family_tunes_a_small_key_into_the_table_end_to_end(kernel, fused, tmp_path, capsys):
    """A few seconds of autotuning per family (with --table): the entry is valid and its config runs right."""
    site = gpu_family_site(kernel, fused)
    manifest = write_manifest(tmp_path / "manifest.json", [site])
    path = tmp_path / "table.json"
    argv = ["tune", str(manifest), "--table", str(path), "--effort", "quick", "--budget-per-key", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    (entry,) = json.loads(path.read_text())["entries"]
    assert (entry.get("kernel", "gemm"), entry["dtype"], entry["k"], entry["n"], entry["m"]) == (
        kernel, site.dtype, 1024, site.n, 4)
    assert entry["us"] > 0 and entry["fallback_us"] > 0 and entry["effort"] == "quick"
    assert entry["error"] <= tuning.TOLERANCE and entry["candidates"] >= 1
    assert entry.get("widths", []) == list(site.widths)
    (k,) = tuning.expand_keys([site], ())
    problem = build_problem(k, CUDA)
    error = timing.relative_error(problem.run(helion.Config(**entry["config"]), 0), problem.reference)
    assert error <= problem.tolerance


@pytest.mark.parametrize("family", ["gemm_multi_int8", "gemm_glu_int8", "gemm_multi_fp8", "gemm_glu_fp8"])
def test_quantized_sibling_families_have_tuning_problems(family):
    """The fused quantized families are tunable: their problem rebuilds the member layers on quantized rows;
    int8's kernel runs here on the interpreter and matches the problem's reference (fp8's loads are wrong there)."""
    import helion

    from helion_backend.tuning.problems import TuneKey, quantized_sibling_epilogue
    from helion_backend.tuning.timing import relative_error

    glu = "glu" in family
    widths = () if glu else (64, 32, 32)
    dtype = "int8" if family.endswith("int8") else "float8_e4m3fn"
    key = TuneKey(family, quantized_sibling_epilogue(family), dtype, 128, 64 if glu else 128, 3, widths)
    problem = build_problem(key, torch.device("cpu"))
    refs = problem.reference if isinstance(problem.reference, list) else [problem.reference]
    assert [r.shape for r in refs] == ([(3, 64)] if glu else [(3, n) for n in widths])
    if dtype == "int8" and os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
        out = problem.run(helion.Config(block_sizes=[16, 32, 32], num_warps=4, num_stages=1), 0)
        assert relative_error(out, problem.reference) <= 1e-2
    if dtype == "int8":  # the timed fallback is the unfused layers (one int8 GEMM each), computing the same
        assert relative_error(problem.fallback()(0), problem.reference) <= 1e-2


def test_fallback_compiles_afresh_without_dropping_other_compiled_functions(monkeypatch):
    """Each problem's fallback compiles past Dynamo's recompile limit, and a function the user compiled
    before (``autotune_missing`` tunes inside its first call) is not compiled again afterwards."""
    from torch._dynamo.testing import CompileCounter
    from torch._dynamo.utils import counters

    from helion_backend.tuning.problems import compiled

    counter = CompileCounter()
    user = torch.compile(lambda x: x * 2, backend=counter)
    user(torch.randn(4))
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)

    def add_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    before = counters["stats"]["unique_graphs"]
    for n in (3, 5, 7):  # three shapes of one function: over the limit of two with a shared code object
        x = torch.randn(n)
        assert torch.equal(compiled(add_one, lambda i, x=x: (x,))(0), x + 1)
    assert counters["stats"]["unique_graphs"] - before == 3
    user(torch.randn(4))
    assert counter.frame_count == 1


def test_on_a_terminal_the_loop_draws_a_progress_bar_with_the_eta(tmp_path):
    """``bar=True`` (the command's choice on a terminal): the same lines, above a bar that counts the keys done and
    shows the ETA; a pipe or a log gets the lines alone (every test above)."""
    keys = [key(1), key(2), key(4)]
    clock = FakeClock()

    def tune_one(k):
        clock.now += 10.0
        return fake_entry(k)

    summary, lines = run_loop(tmp_path / "t.json", keys, tune_one, clock=clock, bar=True, budget_s=60)
    assert summary.tuned == 3
    drawn = "\n".join(lines)
    assert "━" in drawn and "3/3" in drawn, drawn  # rich's bar, finished
    assert "ETA ~3m00s (budget)" in drawn and "ETA 20s" in drawn  # before the first key ends, then the mean
    assert sum("saved" in line for line in lines) == 3
