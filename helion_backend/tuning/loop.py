"""``python -m helion_backend tune MANIFEST``: tune the Helion sites a deployment compiled, per num_tokens.

Compiles record the sites they send to Helion in a manifest (:mod:`.manifest`). The tuner expands it into
keys (kernel family, dtype, K, N, M): every static M of a site and, for a site compiled with a dynamic M,
each ``--num-tokens`` value up to the site's Helion limit. Every family the backend runs on Helion is
tuned: ``gemm``, the gated MLP (``gemm_glu``), the shared launch of q, k and v (``gemm_multi``) and the
quantized ones. For each key, with the key's :class:`~.tuning_problems.Problem`, it

1. finds candidates, as ``--effort`` says:

   - ``sweep``: the family's fixed candidate configs at the key's M and N (:mod:`.tuning_candidates`), no
     search: about 5-10 s a key on an H200, cheap enough to cover every key of the shipped tables
     (``benchmarks/sweep_gemm_configs.py --write-manifest`` lists them);
   - ``quick`` and ``full`` (Helion's presets): Helion's autotuner on the family's GEMM kernel, once per
     value of the family's config keys that a search cannot explore (``split_k``, and ours: ``prequantize``,
     ``paired_loads``, ``gemv``, ``swap_ab``; see :mod:`.tuning_problems`), seeded with the config
     the backend runs today; the searches share the key's ``--budget-per-key`` (30-300 s a key);
2. runs each candidate, and today's config (so that no key ends slower than it was), end to end through
   the family's wrapper (split-K finishing pass and config adaptation included) against the reference and
   drops any beyond the tolerance (the autotuner only compares candidates with its seed, and may return
   one it never ran when the budget ends first);
3. times the survivors and the fallback (``torch.compile`` default of the unfused computation) under
   CUDA-graph replay, rotating weight copies so that the weight streams from HBM as in a model;
4. writes the fastest, its time, the fallback's, whether Helion won, the effort and the seconds the key took,
   to the user table ``<cache_dir>/configs/<gpu>.json`` or ``--table`` (the shipped table's format) before
   the next key starts.

With ``--jobs N`` the sweep compiles ahead: worker processes run the next keys' candidates and fallback once
(:mod:`.tuning_warmup`), then this process times those keys one by one on an idle GPU, finding the compiles
in the caches the processes share.

Keys already in the table are skipped unless ``--force``, so an interrupted run resumes where it
stopped. Like the shipped table, the table is keyed by shape, not by prologue or epilogue: where sites of
one shape differ, the one with the fused RMSNorm, then the longest epilogue, is tuned.

The option ``autotune_missing`` runs the same loop for one compiled graph (:func:`tune_missing`): the keys of
its Helion sites that no table holds exactly, into the user table, before the graph first runs.

The tuner, the timer and the problem are parameters of :func:`tune_key`, and the per-key work is a
parameter of :func:`tune_all`, so the loop and the selection are tested without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

import helion
import torch
from torch.utils._pytree import tree_leaves

from helion_backend import tables
from helion_backend.jsonfile import write_json_atomic
from helion_backend.kernels import configs
from helion_backend.manifest import ManifestError, ManifestSite, read_manifest
from helion_backend.options import (
    DEFAULT_NUM_TOKENS,
    DEFAULT_TUNE_BUDGET_S,
    DEFAULT_TUNE_EFFORT,
    HELION_TUNE_EFFORTS,
    MAX_DEFAULT_TUNE_JOBS,
    SWEEP_EFFORT,
    TUNE_EFFORTS,
    BackendOptions,
    default_tune_jobs,
)
from helion_backend.policy import TableKey
from helion_backend.tuning.candidates import sweep_configs
from helion_backend.tuning.problems import (
    TOLERANCE,
    Output,
    Problem,
    Search,
    TuneError,
    TuneKey,
    build_problem,
)
from helion_backend.tuning.timing import Step, TimingConfig, relative_error, run_metadata, time_callable_us
from helion_backend.tuning.warmup import pool_for
from helion_backend.vocabulary import DEFAULT_KERNEL_FAMILY

log = logging.getLogger(__name__)

# The sweep of the shipped table times with it too, so that user and shipped entries compare.
TIMING = TimingConfig(warmup_calls=2, calls_per_graph=20, warmup_replays=3, replays=15)

__all__ = ["DEFAULT_NUM_TOKENS", "TuneError", "TuneKey"]  # defined in .options and .tuning_problems


def _rank(key: TuneKey) -> tuple[int, int]:
    """Which of a shape's sites to tune: a fused norm changes the kernel more than a longer epilogue."""
    return (len(key.prologue), len(key.epilogue))


def expand_keys(sites: Sequence[ManifestSite], num_tokens: Sequence[int]) -> list[TuneKey]:
    """The keys of a manifest: static Ms, and ``num_tokens`` up to the limit of each dynamic site; one key
    per table key (of a shape's sites, the one with a prologue, then the longest epilogue), sorted."""
    keys: dict[TableKey, TuneKey] = {}
    for site in sites:
        ms = set(site.static_m)
        if site.max_helion_m is not None:
            ms.update(m for m in num_tokens if m <= site.max_helion_m)
        for m in ms:
            key = TuneKey(site.kernel, site.epilogue, site.dtype, site.k, site.n, m, site.widths, site.prologue)
            known = keys.get(key.table_key)
            if known is None or _rank(key) > _rank(known):
                keys[key.table_key] = key
    return [keys[table_key] for table_key in sorted(keys)]


# ---------------------------------------------------------------------------------------------------
# The user table


def _entry_key(entry: Mapping[str, Any]) -> TableKey:
    return TableKey(entry.get("kernel", DEFAULT_KERNEL_FAMILY), entry["dtype"], int(entry["k"]), int(entry["n"]),
                    int(entry["m"]))


@dataclasses.dataclass
class ConfigTable:
    """A config table of one GPU (the user's, or the shipped one the sweep writes), rewritten whole
    (atomically) after every key."""

    path: Path
    entries: dict[TableKey, dict[str, Any]]
    commands: list[str]  # every command that wrote to the table, as the shipped table records them

    @classmethod
    def load(cls, path: Path, command: str) -> ConfigTable:
        """The table at ``path`` (empty when there is none), with ``command`` added to its history.
        Raises ``TuneError`` for a corrupt table rather than overwrite what it may still hold."""
        if not path.exists():
            return cls(path, {}, [command])
        try:
            data = json.loads(path.read_text())
            entries = {_entry_key(e): e for e in data["entries"]}
            commands = list(data.get("metadata", {}).get("commands", []))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise TuneError(f"cannot read the config table {path} ({e}); move it away or fix it") from e
        if commands[-1:] != [command]:
            commands.append(command)
        return cls(path, entries, commands)

    def __contains__(self, key: TuneKey) -> bool:
        return key.table_key in self.entries

    def put(self, entry: dict[str, Any], metadata: Mapping[str, Any]) -> None:
        """Add ``entry`` (replacing its key's) and write the table."""
        self.entries[_entry_key(entry)] = entry
        table = {"metadata": {**metadata, "commands": self.commands},
                 "entries": [self.entries[key] for key in sorted(self.entries)]}
        write_json_atomic(self.path, table)


def table_metadata(device: torch.device) -> dict[str, Any]:
    """The shipped table's metadata: versions, device and date (the command history is the table's)."""
    metadata = run_metadata(device)
    metadata.pop("command")
    return {**metadata, "tool": "python -m helion_backend tune"}


# ---------------------------------------------------------------------------------------------------
# One key


class Tuner(Protocol):
    def __call__(self, search: Search, effort: str, budget_s: int | None) -> helion.Config:
        """The best config found for ``search`` within ``budget_s``, in the searched kernel's layout."""
        ...


Timer = Callable[[Step], float]  # microseconds of one call of ``step``


def assert_tensors_close(actual: object, expected: object) -> None:
    """Helion's accuracy check (its default tolerances) on the tensors alone: the kernels' arguments also
    hold epilogue callables, which ``torch.testing.assert_close`` refuses to compare. One-byte tensors (the
    quantized kernels' fp8/int8 inputs, which no kernel writes) must match bitwise: ``assert_close`` takes
    no tolerance for fp8."""
    actual_tensors = [t for t in tree_leaves(actual) if isinstance(t, torch.Tensor)]
    expected_tensors = [t for t in tree_leaves(expected) if isinstance(t, torch.Tensor)]
    assert len(actual_tensors) == len(expected_tensors), (len(actual_tensors), len(expected_tensors))
    for a, e in zip(actual_tensors, expected_tensors):
        tolerance = 0 if a.element_size() == 1 else 1e-2
        torch.testing.assert_close(a, e, atol=tolerance, rtol=tolerance)


def helion_autotune(search: Search, effort: str, budget_s: int | None) -> helion.Config:
    """Helion's autotuner (``BoundKernel.autotune``) on the GEMM launch of ``search``'s seed, its fixed
    Helion tunables held by overrides.

    The seed is the config the backend runs today at the search's fixed keys (so a short budget still
    explores around a good point), and candidates are checked against it: Helion's own baseline, its
    default config, may write another layout (a split candidate's workspace). The kernel is a copy with
    tuning settings, leaving the production one untouched.
    """
    kernel, args, start = search.launch()
    settings = dataclasses.replace(
        kernel.settings,
        autotune_effort=effort,
        autotune_budget_seconds=budget_s,
        autotune_config_overrides=search.overrides,
        autotune_seed_configs=[start],
        autotune_baseline_fn=kernel.bind(args).compile_config(start),
        autotune_baseline_accuracy_check_fn=assert_tensors_close,
    )
    tuning_kernel = helion.Kernel(kernel.fn, settings=settings)
    return tuning_kernel.bind(args).autotune(args, force=True)


@dataclasses.dataclass(frozen=True)
class Measured:
    config: helion.Config
    us: float
    error: float  # relative error against the reference


def fastest_valid(
    candidates: Sequence[helion.Config],
    run: Callable[[helion.Config, int], Output],
    reference: Output,
    timer: Timer,
    tolerance: float = TOLERANCE,
) -> Measured | None:
    """The fastest of ``candidates`` whose result (``run(config, 0)``) is within ``tolerance`` of
    ``reference``; each is timed as ``timer(lambda i: run(config, i))``, in the given order."""
    measured = []
    for config in dict.fromkeys(candidates):  # two searches may agree
        try:
            error = relative_error(run(config, 0), reference)
        except Exception as e:  # a config that fails to compile or launch end to end is no candidate
            log.warning("helion_inductor tune: %s fails end to end (%s: %s)", config, type(e).__name__, e)
            continue
        if not error <= tolerance:  # NaN fails too
            log.warning("helion_inductor tune: %s is off by %.2e (> %.0e); dropped", config, error, tolerance)
            continue
        measured.append(Measured(config, timer(functools.partial(run, config)), error))
        log.info("helion_inductor tune: %s: %.2f us (error %.1e)", dict(config), measured[-1].us, error)
    return min(measured, key=lambda m: m.us, default=None)


def table_entry(key: TuneKey, problem: Problem, best: Measured, candidates: int, timer: Timer) -> dict[str, Any]:
    """The table entry of ``key``: its fields, the fastest config, its time and error, the time of the
    fallback and of the problem's other timings (the sweep's entries and the tuner's share this)."""
    fields = {"kernel": key.kernel} if key.kernel != DEFAULT_KERNEL_FAMILY else {}
    fields.update(dtype=key.dtype, k=key.k, n=key.n, m=key.m)
    if key.widths:
        fields["widths"] = list(key.widths)
    if key.prologue:
        fields["prologue"] = list(key.prologue)
    fallback_us = timer(problem.fallback())
    return {
        **fields,
        "config": dict(best.config),
        "us": round(best.us, 2),
        "fallback_us": round(fallback_us, 2),
        "helion_wins": best.us < fallback_us,
        **{name: round(timer(step), 2) for name, step in problem.extra_timings.items()},
        "epilogue": list(problem.epilogue),
        "error": float(f"{best.error:.2e}"),
        "candidates": candidates,
    }


def search_budget(effort: str, budget_s: int | None) -> int | None:
    """The seconds of search per key: none for the sweep, which times a fixed list."""
    return None if effort == SWEEP_EFFORT else budget_s


def describe_effort(effort: str, budget_s: int | None) -> str:
    """``effort quick, 300s per key``, or ``effort sweep`` (no search, no budget), for progress lines."""
    budget = search_budget(effort, budget_s)
    return f"effort {effort}" + ("" if budget is None else f", {budget}s per key")


def _searched(key: TuneKey, problem: Problem, tuner: Tuner, effort: str,
              budget_s: int | None) -> tuple[list[helion.Config], list[str]]:
    """What Helion's autotuner finds in each of the problem's searches (sharing ``budget_s``), in the table's
    layout, and the searches that failed, said."""
    searches = problem.searches()
    share = None if budget_s is None else max(1, budget_s // len(searches))
    found: list[helion.Config] = []
    failures: list[str] = []
    for search in searches:
        try:
            found.append(problem.table_config(tuner(search, effort, share), search))
        except Exception as e:  # a search Helion cannot run must not cost the others
            failures.append(f"{search}: {type(e).__name__}: {e}")
            log.warning("helion_inductor tune: %s: autotuning at %s failed (%s)", key, search, e)
    return found, failures


def tune_key(
    key: TuneKey,
    device: torch.device,
    *,
    effort: str,
    budget_s: int | None,
    tuner: Tuner = helion_autotune,
    timer: Timer | None = None,
    problem_of: Callable[[TuneKey, torch.device], Problem] = build_problem,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Tune one key (see the module docstring) and return its table entry; raises ``TuneError`` when no
    candidate is valid, the key's problem cannot be rebuilt or ``effort`` is unknown. ``timer`` defaults to
    CUDA-graph replay on ``device``; the ``sweep`` effort never calls ``tuner`` and has no use for ``budget_s``."""
    if effort not in TUNE_EFFORTS:
        raise TuneError(f"unknown effort {effort!r}; one of {list(TUNE_EFFORTS)}")
    start = clock()
    timer = timer or functools.partial(time_callable_us, config=TIMING, device=device)
    problem = problem_of(key, device)
    # Today's config competes too, so neither a short budget nor a fixed list leaves a key slower than it was.
    if effort == SWEEP_EFFORT:
        candidates, failures = sweep_configs(key, problem.current), []
    else:
        candidates, failures = _searched(key, problem, tuner, effort, budget_s)
        candidates.append(problem.current)
    best = fastest_valid(candidates, problem.run, problem.reference, timer, problem.tolerance)
    if best is None:
        raise TuneError(f"no valid config among {len(candidates)} ({'; '.join(failures) or 'all off'})")
    entry = table_entry(key, problem, best, len(set(candidates)), timer)
    return {**entry, "effort": effort, "seconds": round(clock() - start, 1)}


# ---------------------------------------------------------------------------------------------------
# Every key


@dataclasses.dataclass
class Summary:
    tuned: int = 0
    skipped: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)


def format_duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta(durations: Sequence[float], keys_left: int, budget_s: int | None) -> str:
    """Time left for ``keys_left`` keys: their mean so far, or the budget before the first one ends."""
    if durations:
        return format_duration(statistics.mean(durations) * keys_left)
    if budget_s is not None:
        return f"~{format_duration(budget_s * keys_left)} (budget)"
    return "unknown"


# Compiles what timing keys will run, ahead of it; returns the keys it could not warm, each with the reason.
Warm = Callable[[Sequence[TuneKey]], Sequence[str]]


def tune_all(
    keys: Sequence[TuneKey],
    table: ConfigTable,
    tune_one: Callable[[TuneKey], dict[str, Any]],
    metadata: Callable[[], Mapping[str, Any]],
    *,
    force: bool = False,
    budget_s: int | None = None,
    progress: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
    warm: Warm | None = None,
    batch_size: int = 1,
    bar: bool = False,
) -> Summary:
    """Tune every key not in ``table`` (every key with ``force``), writing each entry as soon as it is done.
    A key that fails is reported and skipped; one line per key goes to ``progress`` (default: stderr).

    With ``warm`` (the sweep's compile workers, :mod:`.tuning_warmup`), the keys to tune go in batches of
    ``batch_size``: ``warm`` compiles a batch's keys and returns, then they are tuned one by one, so that no
    compile competes with a timing. A key's time in the ETA includes its share of its batch's warm-up. With
    ``bar`` (a terminal), a progress bar with the ETA stays below the lines."""
    progress = progress or sys.stderr  # looked up now, not at import: callers (and pytest) may swap it
    with _progress_display(len(keys), progress, bar) as display:
        return _tune_all(keys, table, tune_one, metadata, display, force, budget_s, clock, warm, batch_size)


def _tune_all(keys: Sequence[TuneKey], table: ConfigTable, tune_one: Callable[[TuneKey], dict[str, Any]],
              metadata: Callable[[], Mapping[str, Any]], display: _Display, force: bool, budget_s: int | None,
              clock: Callable[[], float], warm: Warm | None, batch_size: int) -> Summary:
    summary = Summary()
    todo = [key for key in keys if force or key not in table]
    keys_left = len(todo)
    durations: list[float] = []
    warm_share: dict[TuneKey, float] = {}  # seconds of warm-up per key, of the keys warmed so far

    def say(i: int, key: TuneKey | None, what: str, *, done: bool = False, eta_text: str | None = None) -> None:
        display.say(f"[{i}/{len(keys)}] {'' if key is None else f'{key}: '}{what}", done=done, eta=eta_text)

    for i, key in enumerate(keys, 1):
        if not force and key in table:
            summary.skipped += 1
            say(i, key, "in the table already, skipped (--force retunes)", done=True)
            continue
        if warm is not None and key not in warm_share:
            batch = todo[len(todo) - keys_left:][:batch_size]
            warm_share.update(_warm_batch(batch, warm, clock, functools.partial(say, i, None)))
        time_left = eta(durations, keys_left, budget_s)
        say(i, key, f"tuning; ETA {time_left}", eta_text=time_left)
        start = clock()
        try:
            entry = tune_one(key)
        except Exception as e:  # one key's failure (a Helion error, out of memory) must not cost the rest
            summary.failed.append(f"{key}: {e}")
            say(i, key, f"FAILED ({type(e).__name__}: {e})", done=True)
        else:
            if key in warm_share:  # its share of the batch's parallel compile, which its own seconds lack
                entry = {**entry, "warm_seconds": round(warm_share[key], 1)}
            table.put(entry, metadata())
            summary.tuned += 1
            verdict = "Helion wins" if entry["helion_wins"] else "torch.compile wins"
            say(i, key, f"{entry['us']} us, torch.compile {entry['fallback_us']} us ({verdict}); "
                        f"{format_duration(clock() - start)}, saved", done=True)
        durations.append(clock() - start + warm_share.get(key, 0.0))
        keys_left -= 1
    return summary


class _Display:
    """:func:`tune_all`'s progress as lines on a stream: one per event (a log, a file, a pipe)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def say(self, line: str, *, done: bool, eta: str | None) -> None:
        print(line, file=self.stream, flush=True)


class _BarDisplay(_Display):
    """The same lines above a progress bar (keys done of all, elapsed time, the ETA) on a terminal, drawn with
    rich, which Helion depends on (its autotuner draws its own bars with it)."""

    def __init__(self, stream: TextIO, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TextColumn("ETA {task.fields[eta]}"), console=Console(file=stream, force_terminal=True))
        self.task = self.bar.add_task("tune", total=total, eta="unknown")

    def say(self, line: str, *, done: bool, eta: str | None) -> None:
        self.bar.console.print(line, markup=False, highlight=False)
        self.bar.update(self.task, advance=1 if done else 0, **({"eta": eta} if eta is not None else {}))


@contextlib.contextmanager
def _progress_display(total: int, stream: TextIO, bar: bool) -> Iterator[_Display]:
    """A :class:`_BarDisplay` where ``bar`` asks for one and rich imports, else lines."""
    if bar:
        try:
            display = _BarDisplay(stream, total)
        except ImportError:
            bar = False
    if not bar:
        yield _Display(stream)
        return
    with display.bar:
        yield display


def _warm_batch(batch: Sequence[TuneKey], warm: Warm, clock: Callable[[], float],
                say: Callable[[str], None]) -> dict[TuneKey, float]:
    """Warm ``batch`` (never failing: warming only saves the timing phase its compiles) and return each key's
    share of the seconds it took."""
    say(f"compiling the next {len(batch)} key(s) in parallel")
    start = clock()
    try:
        failures = list(warm(batch))
    except Exception as e:
        failures = [f"the batch: {type(e).__name__}: {e}"]
    seconds = clock() - start
    for failure in failures:
        log.warning("helion_inductor tune: not warmed: %s", failure)
    not_warmed = f" ({len(failures)} not warmed: they compile when timed)" if failures else ""
    say(f"compiled in {format_duration(seconds)}{not_warmed}")
    return dict.fromkeys(batch, seconds / len(batch))


# ---------------------------------------------------------------------------------------------------
# At compile time (option autotune_missing)

COMPILE_COMMAND = "torch.compile(backend='helion_inductor', options={'autotune_missing': True})"


def missing_keys(sites: Sequence[ManifestSite], device: torch.device, config_dir: str) -> list[TuneKey]:
    """The keys of ``sites`` (dynamic M: :data:`DEFAULT_NUM_TOKENS` up to the limit) that neither the shipped
    nor the user table of ``device`` holds exactly; a neighbouring M's entry does not count."""
    return [key for key in expand_keys(sites, DEFAULT_NUM_TOKENS)
            if not tables.has_entry(*key.table_key, device, config_dir or None)]


class _LogLines(io.TextIOBase):
    """A text stream that logs each line written to it at WARNING: :func:`tune_all`'s progress, in the compile's
    log, where a first call that tunes for minutes should not be silent."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                log.warning("helion_inductor autotune_missing: %s", line)
        return len(text)


def expected_time(effort: str, budget_s: int | None, keys: int) -> str:
    """How long tuning ``keys`` keys should take, for the warning that announces it."""
    budget = search_budget(effort, budget_s)
    if budget is None:
        return f"seconds to a minute a key ({keys} key(s): the sweep times a fixed list of candidate configs)"
    return f"up to about {format_duration(budget * keys)} ({budget}s of search a key, plus validation and timing)"


def tune_missing(sites: Sequence[ManifestSite], options: BackendOptions, device: torch.device) -> dict[TableKey, str]:
    """Autotune the :func:`missing_keys` of a compile's ``sites`` into the user table of ``device``, as the
    command does (resumable: each entry is written when done), and make this process's config lookups see
    them. Returns what became of each key, by table key. Never raises: a key that fails costs a warning and
    its sites keep the config they had; a table that cannot be written, one warning."""
    keys = missing_keys(sites, device, options.config_dir)
    if not keys:
        return {}
    outcomes: dict[TableKey, str] = {}
    budget_s = search_budget(options.autotune_effort, options.autotune_budget_s)

    def tune_one(key: TuneKey) -> dict[str, Any]:
        start = time.monotonic()
        try:
            entry = tune_key(key, device, effort=options.autotune_effort, budget_s=budget_s)
        except Exception as e:
            outcomes[key.table_key] = f"{key}: failed ({type(e).__name__}: {e}); keeps its config"
            log.warning("helion_inductor: autotune_missing: %s", outcomes[key.table_key])
            raise
        outcomes[key.table_key] = (f"{key}: tuned in {format_duration(time.monotonic() - start)}, {entry['us']} us "
                                   f"(torch.compile {entry['fallback_us']} us)")
        return {**entry, tables.CALIBRATED: True}  # the site report's evidence "calibrated"

    start = time.monotonic()
    log.warning("helion_inductor: autotune_missing: autotuning %d key(s) no config table holds (%s) before the "
                "graph's first run: %s. Each key is saved to the user table in %s when done, so this happens once; "
                "`python -m helion_backend tune` does it ahead of time", len(keys),
                describe_effort(options.autotune_effort, options.autotune_budget_s),
                expected_time(options.autotune_effort, options.autotune_budget_s, len(keys)), options.config_dir)
    try:
        path = user_table(options.config_dir, device)
        table = ConfigTable.load(path, COMPILE_COMMAND)
        summary = tune_all(keys, table, tune_one, functools.partial(table_metadata, device),
                           budget_s=budget_s, progress=_LogLines())
    except Exception as e:  # the table, not a key: nothing more can be saved, and the compile must not fail
        log.warning("helion_inductor: autotune_missing stopped (%s: %s); the sites keep their configs",
                    type(e).__name__, e)
        for key in keys:
            outcomes.setdefault(key.table_key, f"{key}: not tuned ({type(e).__name__}: {e})")
        return outcomes
    finally:  # whatever was written (an interrupt keeps the keys done) is seen from now on
        configs.forget_tables()
    log.info("helion_inductor: autotuned %d key(s) in %s (%d failed) -> %s", summary.tuned,
             format_duration(time.monotonic() - start), len(summary.failed), path)
    return outcomes


# ---------------------------------------------------------------------------------------------------
# Command line

DESCRIPTION = """\
Tune the Helion kernels of the sites listed in a compile manifest, for each token count (M), and save
the best config per key to the user's config table, which later compiles use.

Compiles with backend="helion_inductor" on CUDA record the sites they send to Helion in
<cache_dir>/manifest.json. For every (kernel family, dtype, K, N, M) of it (static M as compiled; dynamic
M for each --num-tokens value up to the site's Helion limit) this finds candidate configs for the
family's kernel (gemm, gemm_glu, gemm_multi, gemm_fp8, gemm_int8, gemm_weight_only, gemm_int4,
gemm_fp8_block and the quantized gemm_glu_*/gemm_multi_*), as --effort says:

  sweep   the family's fixed list of candidate configs (helion_backend/tuning/candidates.py), no search:
          about 5-10 s a key on an H200, mostly compiling, which --jobs worker processes do in parallel
          ahead of the timing; how the shipped tables are made (their keys' manifest:
          python benchmarks/sweep_gemm_configs.py --kernel all --write-manifest PATH)
  quick   Helion's autotuner (its quick preset), seeded with today's config, within --budget-per-key
  full    the same with Helion's full preset

It checks each candidate and today's config against a reference, times them and torch.compile's
fallback under CUDA-graph replay, and writes the fastest to <cache_dir>/configs/<gpu>.json (or --table)
right away, with the effort and the seconds the key took. Keys already there are skipped, so a stopped
run resumes.
"""

WARM_BATCH_PER_JOB = 2  # keys compiled per worker before their timing: fewer waits on the slowest worker

EPILOG = ("exit status: 0 done, 1 some keys failed (see the log), 2 usage error or no CUDA device, "
          "130 interrupted (what was done is saved)")


def parse_num_tokens(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; argparse shows the error with the option's name."""
    try:
        values = sorted({int(part) for part in text.split(",")})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of positive integers such as 1,2,4,8, got {text!r}"
        )
    return tuple(values)


def positive_int(what: str) -> Callable[[str], int]:
    """An argparse type: a positive integer, or an error that says it is a number of ``what``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a positive number of {what}, got {text!r}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", type=Path, help="the manifest compiles wrote (<cache_dir>/manifest.json)")
    parser.add_argument("--effort", choices=TUNE_EFFORTS, default=DEFAULT_TUNE_EFFORT,
                        help=f"{SWEEP_EFFORT}: time the family's fixed candidate configs (seconds a key); "
                             f"{' or '.join(HELION_TUNE_EFFORTS)}: Helion's autotuning "
                             f"preset (minutes a key) (default: {DEFAULT_TUNE_EFFORT})")
    parser.add_argument("--num-tokens", type=parse_num_tokens, default=DEFAULT_NUM_TOKENS, metavar="M,M,...",
                        help="token counts to tune for sites compiled with a dynamic M, capped at each "
                             f"site's Helion limit (default: {','.join(map(str, DEFAULT_NUM_TOKENS))})")
    parser.add_argument("--budget-per-key", type=positive_int("seconds"), default=DEFAULT_TUNE_BUDGET_S,
                        metavar="SECONDS",
                        help="autotuning time per key, shared by its split-K searches; validation and timing "
                             f"add a little; --effort {SWEEP_EFFORT} does not search and ignores it "
                             f"(default: {DEFAULT_TUNE_BUDGET_S})")
    parser.add_argument("--jobs", type=positive_int("worker processes"), default=default_tune_jobs(), metavar="N",
                        help=f"--effort {SWEEP_EFFORT}: N worker processes compile the candidate configs and "
                             f"fallback of the next {WARM_BATCH_PER_JOB}N keys in parallel, into Triton's and "
                             "Inductor's on-disk caches, then this process times those keys one by one on an "
                             "otherwise idle GPU; 1 compiles each key in this process as it is timed; "
                             f"{' and '.join(HELION_TUNE_EFFORTS)} ignore it (Helion's autotuner compiles in "
                             f"parallel itself) (default: half the CPUs, at most {MAX_DEFAULT_TUNE_JOBS}: "
                             f"{default_tune_jobs()} here)")
    parser.add_argument("--force", action="store_true", help="retune keys already in the table")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", type=Path,
                       help="write the table to CACHE_DIR/configs/<gpu>.json (default: the manifest's folder)")
    where.add_argument("--table", type=Path, metavar="PATH",
                       help="write the entries to this table file instead (e.g. the shipped "
                            "helion_backend/kernels/tuned/<gpu>.json), in the same format")


def _writable_table(path: Path) -> Path:
    """``path``, whose folder is created and checked now rather than after the first key's minutes of tuning."""
    if path.is_dir():
        raise TuneError(f"the config table {path} is a folder; name a file such as {path / 'nvidia_h200.json'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TuneError(f"cannot create the folder of the config table {path} ({e})") from e
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise TuneError(f"cannot write the config table {path} (no write permission)")
    return path


def table_path(args: argparse.Namespace, device: torch.device) -> Path:
    """``--table``, else the user table of ``device`` under ``--cache-dir`` (default: the manifest's folder)."""
    if args.table is not None:
        return _writable_table(args.table)
    return user_table(BackendOptions(cache_dir=str(args.cache_dir or args.manifest.parent)).config_dir, device)


def user_table(config_dir: str, device: torch.device) -> Path:
    """The user table of ``device`` in ``config_dir``, its folder created (the one lookups read first)."""
    return _writable_table(Path(config_dir) / f"{tables.gpu_key(device)}.json")


def run_command(args: argparse.Namespace) -> int:
    """``python -m helion_backend tune``: the exit status."""
    try:
        return _tune(args)
    except (TuneError, ManifestError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the keys finished so far are saved; run the command again to resume",
              file=sys.stderr)
        return 130


def _tune(args: argparse.Namespace) -> int:
    keys = expand_keys(read_manifest(args.manifest), args.num_tokens)
    if not keys:
        print(f"nothing to tune: {args.manifest} lists no site with M in --num-tokens", file=sys.stderr)
        return 0
    if not torch.cuda.is_available():
        raise TuneError("no CUDA device: tuning runs the kernels on the GPU whose table it writes")
    device = torch.device("cuda", torch.cuda.current_device())
    path = table_path(args, device)
    table = ConfigTable.load(path, shlex.join(sys.orig_argv))
    jobs = args.jobs if args.effort == SWEEP_EFFORT else 1
    workers = f", {jobs} compile workers" if jobs > 1 else ""
    print(f"{len(keys)} key(s) from {args.manifest} -> {path} "
          f"({describe_effort(args.effort, args.budget_per_key)}{workers})", file=sys.stderr)
    budget_s = search_budget(args.effort, args.budget_per_key)
    tune_one = functools.partial(tune_key, device=device, effort=args.effort, budget_s=budget_s)
    with pool_for(jobs, device) if jobs > 1 else contextlib.nullcontext() as pool:
        summary = tune_all(keys, table, tune_one, functools.partial(table_metadata, device),
                           force=args.force, budget_s=budget_s, warm=pool.warm if pool else None,
                           batch_size=WARM_BATCH_PER_JOB * jobs, bar=sys.stderr.isatty())
    print(f"{summary.tuned} tuned, {summary.skipped} skipped, {len(summary.failed)} failed -> {path}",
          file=sys.stderr)
    for failure in summary.failed:
        print(f"  failed: {failure}", file=sys.stderr)
    return 1 if summary.failed else 0
