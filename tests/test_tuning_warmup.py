"""``tune --effort sweep --jobs N``: the key loop warms each batch of keys before timing it, the warm-up runs
what the sweep times, the command line and its defaults, and the worker processes themselves (spawned for
real, with the cheap warm-ups of tests/warmup_fakes.py)."""

import _thread
import functools
import json
import multiprocessing
import os
import signal
import threading
import time

import helion
import pytest
import torch
import warmup_fakes
from test_tuning import FakeClock, fake_entry, key, run_loop, write_manifest
from warmup_fakes import HANG_M

from helion_backend import options, tables
from helion_backend.__main__ import main
from helion_backend.manifest import ManifestSite
from helion_backend.tuning import loop as tuning
from helion_backend.tuning import warmup as tuning_warmup
from helion_backend.tuning.candidates import candidates_for
from helion_backend.tuning.loop import ConfigTable, TuneError
from helion_backend.tuning.problems import Problem
from helion_backend.tuning.warmup import WarmPool, warm_key

# --- the key loop ----------------------------------------------------------------------------------


def test_each_batch_is_warmed_once_before_its_keys_are_timed(tmp_path):
    path = tmp_path / "test_gpu.json"
    ConfigTable.load(path, "earlier").put(fake_entry(key(4)), {})  # in the table: neither warmed nor timed
    events = []

    def warm(keys):
        events.append(("warm", [k.m for k in keys]))
        return []

    def tune_one(k):
        events.append(("time", k.m))
        return fake_entry(k)

    keys = [key(m) for m in (1, 2, 4, 8, 16, 32)]
    summary, lines = run_loop(path, keys, tune_one, warm=warm, batch_size=2)
    assert events == [("warm", [1, 2]), ("time", 1), ("time", 2),
                      ("warm", [8, 16]), ("time", 8), ("time", 16),
                      ("warm", [32]), ("time", 32)]
    assert (summary.tuned, summary.skipped, summary.failed) == (5, 1, [])
    # Each warmed entry records its share of its batch's compile (the fake clock stands still: 0 s).
    entries = {e["m"]: e for e in json.loads(path.read_text())["entries"]}
    assert "warm_seconds" not in entries[4] and all(entries[m]["warm_seconds"] == 0.0 for m in (1, 2, 8, 16, 32))
    assert lines[0] == "[1/6] compiling the next 2 key(s) in parallel"
    assert lines[1] == "[1/6] compiled in 0s"
    assert lines[2].startswith(f"[1/6] {key(1)}: tuning; ETA")
    assert f"[4/6] {key(8)}: tuning; ETA 0s" in lines  # after "[4/6] compiling the next 2 key(s) in parallel"
    assert lines[lines.index("[4/6] compiling the next 2 key(s) in parallel") - 1].startswith(f"[3/6] {key(4)}")

    events.clear()
    summary, _ = run_loop(path, keys, tune_one, warm=warm, batch_size=4, force=True)
    assert events == [("warm", [1, 2, 4, 8]), ("time", 1), ("time", 2), ("time", 4), ("time", 8),
                      ("warm", [16, 32]), ("time", 16), ("time", 32)]


def test_the_eta_counts_each_keys_share_of_its_batchs_warm_up(tmp_path):
    clock = FakeClock()

    def warm(keys):
        clock.now += 10.0 * len(keys)  # 10 s a key, in parallel or not
        return []

    def tune_one(k):
        clock.now += 20.0
        return fake_entry(k)

    keys = [key(m) for m in (1, 2, 4, 8)]
    _, lines = run_loop(tmp_path / "t.json", keys, tune_one, warm=warm, batch_size=2, clock=clock)
    assert lines == [
        "[1/4] compiling the next 2 key(s) in parallel",
        "[1/4] compiled in 20s",
        f"[1/4] {key(1)}: tuning; ETA unknown",
        f"[1/4] {key(1)}: 5.0 us, torch.compile 6.0 us (Helion wins); 20s, saved",  # its timing, in this process
        f"[2/4] {key(2)}: tuning; ETA 1m30s",  # 3 keys at 20 s + 10 s of warm-up each
        f"[2/4] {key(2)}: 5.0 us, torch.compile 6.0 us (Helion wins); 20s, saved",
        "[3/4] compiling the next 2 key(s) in parallel",
        "[3/4] compiled in 20s",
        f"[3/4] {key(4)}: tuning; ETA 1m00s",
        f"[3/4] {key(4)}: 5.0 us, torch.compile 6.0 us (Helion wins); 20s, saved",
        f"[4/4] {key(8)}: tuning; ETA 30s",
        f"[4/4] {key(8)}: 5.0 us, torch.compile 6.0 us (Helion wins); 20s, saved",
    ]


@pytest.mark.parametrize("outcome", ["some keys", "raises"])
def test_a_failed_warm_up_costs_a_warning_not_a_key(tmp_path, caplog, outcome):
    def warm(keys):
        if outcome == "raises":
            raise RuntimeError("the pool broke")
        return [f"{key(2)}: RuntimeError: cannot build"]

    summary, lines = run_loop(tmp_path / "t.json", [key(1), key(2)], fake_entry, warm=warm, batch_size=2)
    assert (summary.tuned, summary.failed) == (2, [])
    not_warmed = "1 not warmed: they compile when timed"
    assert lines[1] == f"[1/2] compiled in 0s ({not_warmed})"
    said = {"some keys": f"{key(2)}: RuntimeError: cannot build", "raises": "the batch: RuntimeError: the pool broke"}
    assert f"not warmed: {said[outcome]}" in caplog.text


# --- what a worker runs ----------------------------------------------------------------------------


def recording_problem(ran: list, failing: helion.Config, current: helion.Config) -> Problem:
    """A problem whose steps record that they ran; ``failing`` does not compile."""
    reference = torch.ones(4, 64)

    def run(config, i):
        ran.append(("run", dict(config), i))
        if config == failing:
            raise RuntimeError("does not compile")
        return reference

    def fallback():
        ran.append(("fallback",))
        return lambda i: ran.append(("fallback step", i)) or reference

    return Problem(run=run, reference=reference, fallback=fallback, current=current, epilogue=(),
                   extra_timings={"separate_us": lambda i: ran.append(("separate", i))})


@pytest.mark.parametrize("current_is_a_candidate", [False, True])
def test_warm_key_runs_once_each_config_the_sweep_times_and_the_fallback(current_is_a_candidate):
    k = key(4, k=1024, n=64, epilogue=("bias",))
    candidates = candidates_for(k)
    current = candidates[1] if current_is_a_candidate else helion.Config(block_sizes=[16, 16, 64], num_warps=2)
    warmed, timed = [], []
    warm_key(k, torch.device("cpu"), problem_of=lambda *_: recording_problem(warmed, candidates[0], current))
    tuning.tune_key(k, torch.device("cpu"), effort="sweep", budget_s=None, timer=lambda step: 1.0,
                    problem_of=lambda *_: recording_problem(timed, candidates[0], current))

    def runs(ran):
        return [entry[1:] for entry in ran if entry[0] == "run"]

    # Each config once on call 0, the one that fails and those after it included, as the sweep runs them first.
    assert runs(warmed) == runs(timed) == [(dict(c), 0) for c in dict.fromkeys([*candidates, current])]
    assert [entry for entry in warmed if entry[0] != "run"] == [("separate", 0), ("fallback",), ("fallback step", 0)]


def test_warm_key_raises_what_building_the_problem_raises():
    def problem_of(k, device):
        raise TuneError("gemm_multi site recorded without its outputs' widths")

    with pytest.raises(TuneError, match="widths"):
        warm_key(key(1), torch.device("cpu"), problem_of=problem_of)


def test_pool_for_pins_the_triton_cache_folder_and_starts_no_worker(monkeypatch):
    from helion.autotuner.local_cache import helion_triton_cache_dir

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    pool = tuning_warmup.pool_for(3, torch.device("cuda", 1))
    assert os.environ["TRITON_CACHE_DIR"] == helion_triton_cache_dir(1)  # where Helion compiles
    assert (pool.jobs, pool.started) == (3, 0)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")  # the user's folder is kept
    tuning_warmup.pool_for(2, torch.device("cuda", 0))
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"


# --- the command line ------------------------------------------------------------------------------


@pytest.fixture
def manifest(tmp_path):
    site = ManifestSite.declared("gemm", ("bias",), "bfloat16", 1024, 256, m=None, max_helion_m=32)
    return write_manifest(tmp_path / "manifest.json", [site])


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device as far as the command's checks go, a machine of 2 CPUs (default --jobs 1), and the
    timing of each key recorded in ``timed``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    monkeypatch.setattr(tuning, "table_metadata", lambda device: {"device": "test"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    timed = []
    monkeypatch.setattr(tuning, "tune_key", lambda key, **kwargs: timed.append(key.m) or fake_entry(key))
    return timed


@pytest.mark.parametrize("value", ["0", "-2", "x", "1.5", ""])
def test_bad_jobs_values_exit_2_with_a_clear_message(manifest, capsys, value):
    with pytest.raises(SystemExit) as info:
        main(["tune", str(manifest), "--effort", "sweep", "--jobs", value])
    assert info.value.code == 2
    assert f"argument --jobs: expected a positive number of worker processes, got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("cpus, jobs", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8), (128, 8)])
def test_default_jobs_is_half_the_cpus_from_1_to_8(monkeypatch, capsys, cpus, jobs):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert options.default_tune_jobs() == jobs
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"(default: half the CPUs, at most 8: {jobs} here)" in help_text
    assert "--effort sweep: N worker processes compile the candidate configs and fallback of the next 2N keys" \
        in help_text and "quick and full ignore it" in help_text


def forbid_workers(monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("a compile worker was started")

    monkeypatch.setattr(tuning, "pool_for", no_pool)
    monkeypatch.setattr(WarmPool, "_start", no_pool)


@pytest.mark.parametrize("argv", [["--effort", "sweep", "--jobs", "1"], ["--effort", "sweep"],
                                  ["--effort", "quick", "--jobs", "4"], ["--effort", "full", "--jobs", "4"]])
def test_one_job_or_a_search_effort_starts_no_worker(manifest, tmp_path, fake_gpu, monkeypatch, capsys, argv):
    forbid_workers(monkeypatch)
    assert main(["tune", str(manifest), "--num-tokens", "1,2,4", "--table", str(tmp_path / "t.json"), *argv]) == 0
    assert fake_gpu == [1, 2, 4] and not multiprocessing.active_children()
    err = capsys.readouterr().err
    assert "compiling" not in err and "workers" not in err  # the output of the command before --jobs
    assert f"3 key(s) from {manifest} -> {tmp_path / 't.json'} (effort {argv[1]}" in err


class FakePool:
    """What the command uses of a :class:`WarmPool`, recording instead of spawning."""

    def __init__(self, jobs, device):
        self.jobs, self.device, self.warmed, self.exited_with = jobs, device, [], "still open"

    def warm(self, keys):
        self.warmed.append([k.m for k in keys])
        return []

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        self.exited_with = exc_type


def test_the_command_warms_batches_of_2n_keys_and_closes_its_pool(manifest, tmp_path, fake_gpu, monkeypatch, capsys):
    pools = []
    monkeypatch.setattr(tuning, "pool_for", lambda jobs, device: pools.append(FakePool(jobs, device)) or pools[-1])
    path = tmp_path / "t.json"
    ConfigTable.load(path, "earlier").put(fake_entry(key(2, k=1024, n=256, epilogue=("bias",))), {})
    assert main(["tune", str(manifest), "--effort", "sweep", "--jobs", "2", "--table", str(path)]) == 0
    (pool,) = pools
    assert (pool.jobs, pool.device, pool.exited_with) == (2, torch.device("cuda", 0), None)
    assert pool.warmed == [[1, 4, 8, 16], [24, 32]]  # M = 2 is in the table already
    assert fake_gpu == [1, 4, 8, 16, 24, 32]
    assert "(effort sweep, 2 compile workers)" in capsys.readouterr().err


def test_ctrl_c_stops_the_workers_and_keeps_the_keys_done(manifest, tmp_path, fake_gpu, monkeypatch, capsys):
    pools = []
    monkeypatch.setattr(tuning, "pool_for", lambda jobs, device: pools.append(FakePool(jobs, device)) or pools[-1])

    def tune_key(key, **kwargs):
        if key.m == 2:
            raise KeyboardInterrupt
        return fake_entry(key)

    monkeypatch.setattr(tuning, "tune_key", tune_key)
    path = tmp_path / "t.json"
    assert main(["tune", str(manifest), "--effort", "sweep", "--jobs", "3", "--table", str(path)]) == 130
    assert pools[0].exited_with is KeyboardInterrupt  # the real pool terminates its workers on any exception
    assert [e["m"] for e in json.loads(path.read_text())["entries"]] == [1]
    assert "interrupted: the keys finished so far are saved" in capsys.readouterr().err


# --- real worker processes -------------------------------------------------------------------------


def read_events(log) -> list[tuple[str, int, int]]:
    return [(what, int(m), int(pid)) for what, m, pid in (line.split() for line in log.read_text().splitlines())]


@pytest.mark.slow
def test_real_workers_warm_every_key_before_the_command_times_it(manifest, tmp_path, fake_gpu, monkeypatch, capsys):
    """Two spawned workers; the warm-up of one key raises and another's kills its worker: every key is still
    tuned, each after its warm-up ended, none while a worker runs, and no worker outlives the command."""
    log = tmp_path / "events"
    monkeypatch.setattr(tuning, "pool_for", lambda jobs, device: WarmPool(
        jobs, functools.partial(warmup_fakes.record_warm, log=str(log))))

    def tune_key(key, **kwargs):
        warmup_fakes.record(str(log), "time-start", key.m, os.getpid())
        time.sleep(0.1)
        warmup_fakes.record(str(log), "time-end", key.m, os.getpid())
        return fake_entry(key)

    monkeypatch.setattr(tuning, "tune_key", tune_key)
    path = tmp_path / "t.json"
    argv = ["tune", str(manifest), "--effort", "sweep", "--jobs", "2", "--num-tokens", "1,2,4,8,16", "--table",
            str(path)]
    assert main(argv) == 0
    assert [e["m"] for e in json.loads(path.read_text())["entries"]] == [1, 2, 4, 8, 16]

    events = read_events(log)
    workers = {pid for what, _, pid in events if what.startswith("warm")}
    assert len(workers) == 2 and os.getpid() not in workers
    assert not any(p.is_alive() for p in multiprocessing.active_children())
    at_work: set[int] = set()  # the keys a worker is warming
    warmed: list[int] = []
    for what, m, _ in events:
        if what == "warm-start":
            assert m not in warmed, f"M={m} warmed twice"
            warmed.append(m)
            at_work.add(m)
        elif what.startswith("warm-"):
            at_work.remove(m)
        elif what == "time-start":
            assert m in warmed and not at_work, (m, at_work)
    assert sorted(warmed) == [1, 2, 4, 8, 16]
    err = capsys.readouterr().err
    assert "[1/5] compiling the next 4 key(s) in parallel" in err and "[5/5] compiling the next 1 key(s)" in err
    assert err.count("(1 not warmed: they compile when timed)") == 2  # M = 2 raised, M = 16 crashed
    assert "0 failed" in err


@pytest.mark.slow
def test_real_workers_time_out_and_stop_at_once_on_ctrl_c(tmp_path, request):
    """A worker stuck on a key past the timeout (counted from the end of its imports) is stopped and the key
    reported; Ctrl-C while a worker is at a key terminates it rather than waiting for it."""
    # Python's own Ctrl-C handler, as the tune command runs under: the simulated Ctrl-C below does nothing where
    # the handler is another (in one full run of the suite on a loaded machine, it did not raise).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    log = tmp_path / "events"
    pool = WarmPool(2, functools.partial(warmup_fakes.record_warm, log=str(log)), key_timeout_s=2.0)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), pool:
        failures = pool.warm([key(1), key(HANG_M)])
        assert failures == [f"{key(HANG_M)}: not warmed (its worker took over 2s and was stopped, exit code -15)"]
        assert pool.started == 2 and len(pool._workers) == 1
        (worker,) = pool._workers
        threading.Timer(0.5, _thread.interrupt_main).start()  # Ctrl-C while the worker is at a key
        pool.warm([key(HANG_M)])
    assert not worker.process.is_alive() and worker.process.exitcode == -15  # terminated, not waited for
    assert time.monotonic() - start < 40
    events = [(what, m) for what, m, _ in read_events(log)]
    assert events.count(("warm-start", HANG_M)) == 2 and ("warm-end", HANG_M) not in events
    assert ("warm-end", 1) in events
