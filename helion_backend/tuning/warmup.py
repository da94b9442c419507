"""Compiling ahead of the tune command's sweep in worker processes (``tune --effort sweep --jobs N``).

A sweep key costs 7-15 s on an H200, nearly all of it compilation: Helion's tracing and Triton's compile of
each candidate config (~0.5 s each, 12-22 a key) and ``torch.compile`` of the key's fallback. Timing must
happen one key at a time on a quiet GPU, compiling need not: before the main process times a batch of keys,
workers run what :func:`~.tuning.tune_key` will run at each (:func:`warm_key`), and the main process then finds
every compile in caches that the processes of one machine share on disk:

- Helion's generated code: this package's code cache (:mod:`.code_cache`, ``<cache_dir>/kernels``), keyed by
  kernel, signature, config and environment; the main process loads the worker's source text as is;
- Triton's binaries: keyed by that source, the argument specialization, the launch options and the target,
  in ``TRITON_CACHE_DIR``. That folder is whichever of Helion's (``<inductor cache>/helion/triton/<device>``)
  and Inductor's (``<inductor cache>/triton/<device>``) choices a process makes first, so it is pinned before
  the workers start (:func:`share_triton_cache`);
- the fallback's graph: Inductor's FX graph cache and AOTAutograd's, in ``TORCHINDUCTOR_CACHE_DIR``
  (``/tmp/torchinductor_$USER`` by default); the workers' ``compile_threads`` is not part of their keys.

Workers are spawned (CUDA cannot run in a forked child), import torch and Helion once (~5 s) and live for the
whole command (:class:`WarmPool`). Warming is only an optimisation: a key a worker fails on, or dies or hangs
on, is compiled by the main process when it times it, as without workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import signal
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import TracebackType

import helion
import torch

from helion_backend.tuning.candidates import sweep_configs
from helion_backend.tuning.problems import Problem, TuneKey, build_problem

log = logging.getLogger(__name__)

WarmFn = Callable[[TuneKey], None]  # compiles what timing a key will run; picklable (it is sent to workers)
KEY_TIMEOUT_S = 600.0  # a worker this long on one key is stopped (a sweep key compiles in about 15 s)
START_TIMEOUT_S = 300.0  # ... or this long importing torch and Helion (about 5 s)
POLL_S = 1.0  # how often a wait for outcomes looks at the clock, for the timeouts
CLOSE_TIMEOUT_S = 10.0  # how long an idle worker may take to leave when told to
READY = "ready"  # a worker's first message, once it has imported what it needs; then one (DONE, error) a key
DONE = "done"


# ---------------------------------------------------------------------------------------------------
# What a worker runs


def warm_key(key: TuneKey, device: torch.device,
             problem_of: Callable[[TuneKey, torch.device], Problem] = build_problem) -> None:
    """Run once what the sweep times at ``key`` (each candidate, today's config, the extra timings, the
    fallback), discarding the results: the point is the compiles they leave in the caches. A step that fails
    is the timing phase's to report; what building the problem raises is raised. Returns with the GPU idle,
    so that no launch of it overlaps a timing."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    try:
        problem = problem_of(key, device)
        _run_once(problem, sweep_configs(key, problem.current))
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # an idle worker keeps its CUDA context, not the key's tensors


def _run_once(problem: Problem, configs: Sequence[helion.Config]) -> None:
    for config in configs:
        _attempt(functools.partial(problem.run, config, 0))
    for step in problem.extra_timings.values():
        _attempt(functools.partial(step, 0))
    _attempt(lambda: problem.fallback()(0))


def _attempt(step: Callable[[], object]) -> None:
    try:
        step()
    except Exception as e:  # a config that does not compile or run: timing drops it, and says so
        log.debug("helion_inductor tune: warming: %s: %s", type(e).__name__, e)


def share_triton_cache(device: torch.device) -> None:
    """Pin ``TRITON_CACHE_DIR`` (where unset) to the folder Helion's Triton backend sets at its first compile,
    before any worker starts: workers inherit it, and a process whose first compile is Inductor's (which would
    set its own folder) still finds the binaries of the others. The main process's Helion kernels already
    compile there today, as they compile before its fallback."""
    from helion._compiler.backend_registry import get_backend_class

    get_backend_class("triton")().setup_compile_cache_dir(device.index or 0)


def _serve(warm: WarmFn, keys: Connection, outcomes: Connection) -> None:
    """A worker: say it is ready, then warm each key it receives and send back its error (``None``: none),
    until it receives ``None`` or the main process is gone (its end of ``keys`` closed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it stops the workers
    import torch._inductor.config as inductor_config

    # Inductor compiles in this process: a pool of compile processes per worker would start jobs x CPUs of them.
    inductor_config.compile_threads = 1
    logging.disable(logging.WARNING)  # what fails here is timed, and reported, by the main process
    warnings.simplefilter("ignore")
    outcomes.send((READY, None))
    while True:
        try:
            key = keys.recv()
        except EOFError:
            return
        if key is None:
            return
        try:
            warm(key)
        except Exception as e:
            outcomes.send((DONE, f"{type(e).__name__}: {e}"))
        else:
            outcomes.send((DONE, None))


# ---------------------------------------------------------------------------------------------------
# The pool


@dataclasses.dataclass
class _Worker:
    process: BaseProcess
    keys: Connection  # to the worker
    outcomes: Connection  # from the worker
    key: TuneKey | None = None  # the key it is warming
    ready: bool = False  # done importing
    since: float = 0.0  # when it started, or started its key

    def stop(self, terminate: bool) -> None:
        """Tell the worker to leave (``terminate``: make it leave now), and wait until it has."""
        if terminate:
            self.process.terminate()
        else:
            with contextlib.suppress(OSError):
                self.keys.send(None)
        self.process.join(None if terminate else CLOSE_TIMEOUT_S)
        if self.process.exitcode is None:
            self.process.terminate()
            self.process.join()
        self.keys.close()
        self.outcomes.close()


class WarmPool:
    """Up to ``jobs`` spawned worker processes that run ``warm`` on keys, one key at a time each. They start
    at the first :meth:`warm` that has keys and stay until the pool is left; one that dies, or takes longer than
    ``key_timeout_s`` on a key, is replaced (at most ``jobs`` times in all, so that a machine where workers
    cannot live does not start them forever). Use it as a context manager: leaving it normally tells the
    workers to leave and waits for them, leaving it on an exception (Ctrl-C included) terminates them.
    They are not daemonic, so that what they run may start processes of its own."""

    def __init__(self, jobs: int, warm: WarmFn, *, key_timeout_s: float = KEY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if jobs < 1:
            raise ValueError(f"jobs must be >= 1, got {jobs}")
        self.jobs, self._warm, self._key_timeout_s, self._clock = jobs, warm, key_timeout_s, clock
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._starts_left = 2 * jobs
        self.started = 0  # worker processes started so far

    def warm(self, keys: Sequence[TuneKey]) -> list[str]:
        """Warm ``keys``, each on the next free worker, and return once none is at work; returns the keys that
        could not be warmed, each with the reason."""
        failures: list[str] = []
        pending = deque(keys)
        while pending or self._busy():
            self._drop_dead_idle()
            self._start_workers(min(self.jobs, len(pending) + len(self._busy())))
            if not self._workers:
                failures += [f"{key}: not warmed (no worker could be started)" for key in pending]
                break
            for worker in self._idle():
                if pending:
                    self._give(worker, pending.popleft())
            self._collect(failures)
        return failures

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop(terminate=exc_type is not None)

    def _busy(self) -> list[_Worker]:
        return [worker for worker in self._workers if worker.key is not None]

    def _idle(self) -> list[_Worker]:
        return [worker for worker in self._workers if worker.key is None]

    def _drop_dead_idle(self) -> None:
        """Forget the idle workers that died (killed for memory, say): :meth:`_start_workers` replaces them."""
        for worker in self._idle():
            if not worker.process.is_alive():
                worker.stop(terminate=True)
                self._workers.remove(worker)

    def _start_workers(self, wanted: int) -> None:
        while len(self._workers) < wanted and self._starts_left > 0:
            self._starts_left -= 1
            try:
                self._workers.append(self._start())
            except Exception as e:  # (no processes or memory left): the main process compiles alone
                log.warning("helion_inductor tune: cannot start a compile worker (%s: %s)", type(e).__name__, e)
                self._starts_left = 0

    def _start(self) -> _Worker:
        keys_out, keys_in = self._context.Pipe(duplex=False)
        outcomes_in, outcomes_out = self._context.Pipe(duplex=False)
        process = self._context.Process(target=_serve, args=(self._warm, keys_out, outcomes_out),
                                        name=f"helion_inductor-tune-worker-{self.started}")
        with _sigint_ignored():  # inherited by the child, until it ignores Ctrl-C itself (after its imports)
            process.start()
        self.started += 1
        keys_out.close()  # the worker's ends: closed here, so that each side sees the other leave
        outcomes_out.close()
        return _Worker(process, keys_in, outcomes_in, since=self._clock())

    def _give(self, worker: _Worker, key: TuneKey) -> None:
        worker.key = key
        if worker.ready:
            worker.since = self._clock()
        try:
            worker.keys.send(key)
        except OSError:  # it died idle: the wait below finds it gone
            pass

    def _collect(self, failures: list[str]) -> None:
        """Wait (up to :data:`POLL_S`) for messages or deaths of the busy workers; note both, and stop a worker
        past its timeout."""
        busy = self._busy()
        wait([conn for worker in busy for conn in (worker.outcomes, worker.process.sentinel)], POLL_S)
        for worker in busy:
            try:
                while worker.key is not None and worker.outcomes.poll():  # sent before it can die: read first
                    self._receive(worker, *worker.outcomes.recv(), failures)
            except (EOFError, OSError):
                self._lose(worker, "exited", failures)
                continue
            if worker.key is not None:
                self._check(worker, failures)

    def _check(self, worker: _Worker, failures: list[str]) -> None:
        """Lose ``worker`` (at a key) if it has died or is past its timeout."""
        limit = self._key_timeout_s if worker.ready else START_TIMEOUT_S
        if not worker.process.is_alive():
            self._lose(worker, "exited", failures)
        elif self._clock() - worker.since > limit:
            self._lose(worker, f"took over {limit:.0f}s and was stopped", failures)

    def _receive(self, worker: _Worker, message: str, error: str | None, failures: list[str]) -> None:
        if message == READY:
            worker.ready, worker.since = True, self._clock()  # its key, if it has one, starts now
            return
        if error is not None:
            failures.append(f"{worker.key}: {error}")
        worker.key = None

    def _lose(self, worker: _Worker, what: str, failures: list[str]) -> None:
        worker.stop(terminate=True)
        failures.append(f"{worker.key}: not warmed (its worker {what}, exit code {worker.process.exitcode})")
        self._workers.remove(worker)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored inside the block (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def pool_for(jobs: int, device: torch.device) -> WarmPool:
    """The tune command's pool: ``jobs`` workers running :func:`warm_key` on ``device``, whose Triton cache
    folder is pinned first so that they and this process share it."""
    share_triton_cache(device)
    return WarmPool(jobs, functools.partial(warm_key, device=device))

