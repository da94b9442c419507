"""The sweep's compile workers (:mod:`helion_backend.tuning_warmup`): the warm-up runs what the sweep times, and
the worker processes themselves (spawned for real, with the cheap warm-ups of tests/warmup_fakes.py)."""

import _thread
import functools
import os
import threading
import time

import helion
import pytest
import torch
import warmup_fakes
from test_tuning import key
from warmup_fakes import HANG_M

from helion_backend import tuning, tuning_warmup
from helion_backend.tuning import TuneError
from helion_backend.tuning_candidates import candidates_for
from helion_backend.tuning_problems import Problem
from helion_backend.tuning_warmup import WarmPool, warm_key

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


# --- real worker processes -------------------------------------------------------------------------


def read_events(log) -> list[tuple[str, int, int]]:
    return [(what, int(m), int(pid)) for what, m, pid in (line.split() for line in log.read_text().splitlines())]


def test_real_workers_time_out_and_stop_at_once_on_ctrl_c(tmp_path):
    """A worker stuck on a key past the timeout (counted from the end of its imports) is stopped and the key
    reported; Ctrl-C while a worker is at a key terminates it rather than waiting for it."""
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
