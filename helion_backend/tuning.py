"""``python -m helion_backend tune MANIFEST``: autotune the GEMM sites a deployment compiled, per num_tokens.

Compiles record the sites they send to Helion in a manifest (:mod:`.manifest`). The tuner expands it into
keys (dtype, K, N, M): every static M of a site and, for a site compiled with a dynamic M, each
``--num-tokens`` value up to the site's Helion limit. For each key it

1. runs Helion's autotuner on :func:`~.kernels.gemm.gemm_kernel` once per split-K factor worth trying.
   ``split_k`` is one of the kernel's tunables, but a split writes fp32 partial sums to a workspace of
   another shape and needs a finishing pass the autotuner never sees, so each split is searched on its
   own, with ``split_k`` fixed, and the searches share the key's time budget;
2. runs each search's winner, and the config the backend runs today, end to end
   (:func:`~.kernels.gemm.gemm_epilogue_helion`, finishing pass included) against a float64 reference
   and drops any beyond :data:`TOLERANCE` (the autotuner only compares candidates with a baseline
   config, and may return one it never ran when the budget ends first);
3. times the survivors and the fallback (``torch.compile`` default of the unfused computation) under
   CUDA-graph replay, rotating weight copies so that the weight streams from HBM as in a model;
4. writes the fastest, its time, the fallback's and whether Helion won, to the user table
   ``<cache_dir>/configs/<gpu>.json`` (the shipped table's format) before the next key starts.

Keys already in the user table are skipped unless ``--force``, so an interrupted run resumes where it
stopped. Like the shipped table, the user table is keyed by shape, not by epilogue: where sites of one
shape differ in epilogue, the longest epilogue is tuned.

The tuner, the timer and the kernel are parameters of :func:`tune_key`, and the per-key work is a
parameter of :func:`tune_all`, so the loop and the selection are tested without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

import helion
import torch
from torch.utils._pytree import tree_leaves

from . import dispatch
from .epilogue import apply_epilogue, num_scalars, operand_kinds
from .jsonfile import write_json_atomic
from .kernels import configs, gemm
from .kernels.gemm import gemm_epilogue_helion, gemm_kernel
from .manifest import ManifestError, ManifestSite, read_manifest
from .options import BackendOptions
from .timing import Step, TimingConfig, copies_to_defeat_l2, relative_error, run_metadata, time_callable_us
from .vocabulary import DEFAULT_KERNEL_FAMILY, SUPPORTED_DTYPES, Operand

log = logging.getLogger(__name__)

EFFORTS = ("quick", "full")  # Helion's autotune_effort presets that search ("none" does not)
DEFAULT_NUM_TOKENS = (1, 2, 4, 8, 16, 24, 32)
DEFAULT_BUDGET_S = 300
# Largest relative Frobenius error against float64 for a config to count: bf16 rounding of the output
# alone is about 3e-3.
TOLERANCE = 1e-2
# The sweep of the shipped table times with it too, so that user and shipped entries compare.
TIMING = TimingConfig(warmup_calls=2, calls_per_graph=20, warmup_replays=3, replays=15)

TableKey = tuple[str, str, int, int, int]  # (kernel, dtype, K, N, M): what a table entry is keyed by


class TuneError(Exception):
    """What stops the command (exit status 2) or fails one key, said for the user."""


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """One shape and token count to tune, with the epilogue it is tuned under."""

    kernel: str
    epilogue: tuple[str, ...]
    dtype: str
    k: int
    n: int
    m: int

    @property
    def table_key(self) -> TableKey:
        return (self.kernel, self.dtype, self.k, self.n, self.m)

    def __str__(self) -> str:
        return f"{self.dtype} K={self.k} N={self.n} M={self.m} [{','.join(self.epilogue) or 'no epilogue'}]"


def expand_keys(sites: Sequence[ManifestSite], num_tokens: Sequence[int]) -> list[TuneKey]:
    """The keys of a manifest: static Ms, and ``num_tokens`` up to the limit of each dynamic site; one key
    per table key (the longest epilogue of a shape wins), sorted."""
    keys: dict[TableKey, TuneKey] = {}
    for site in sites:
        ms = set(site.static_m)
        if site.dynamic_m_limit is not None:
            ms.update(m for m in num_tokens if m <= site.dynamic_m_limit)
        for m in ms:
            key = TuneKey(site.kernel, site.epilogue, site.dtype, site.k, site.n, m)
            known = keys.get(key.table_key)
            if known is None or len(key.epilogue) > len(known.epilogue):
                keys[key.table_key] = key
    return [keys[table_key] for table_key in sorted(keys)]


# ---------------------------------------------------------------------------------------------------
# The user table


def _entry_key(entry: Mapping[str, Any]) -> TableKey:
    return (entry.get("kernel", DEFAULT_KERNEL_FAMILY), entry["dtype"], int(entry["k"]), int(entry["n"]), int(entry["m"]))


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
            raise TuneError(f"cannot read the user config table {path} ({e}); move it away or fix it") from e
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


@dataclasses.dataclass(frozen=True)
class GemmInputs:
    """Random operands of one key in ``copies`` sets, rotated by call number so that each call reads a
    weight that is not in the L2 (see :func:`~helion_backend.timing.copies_to_defeat_l2`)."""

    steps: tuple[str, ...]
    xs: list[torch.Tensor]
    weights: list[torch.Tensor]  # nn.Linear layout [N, K]; the kernels read ``weight.t()``
    operands: list[list[torch.Tensor]]
    scalars: list[float]
    out_dtype: torch.dtype

    def args(self, i: int) -> tuple[Any, ...]:
        """``(x, w_kn, steps, operands, scalars, out_dtype)`` of copy ``i``, as the fused op passes them."""
        j = i % len(self.xs)
        return (self.xs[j], self.weights[j].t(), self.steps, self.operands[j], self.scalars, self.out_dtype)


def make_inputs(key: TuneKey, device: torch.device, copies: int = 1, seed: int = 0) -> GemmInputs:
    """Fresh random inputs for ``key``; the weight is scaled by 1/sqrt(K) so the accumulator is O(1),
    where the activations are neither linear nor saturated. The output keeps the input dtype."""
    dtype = SUPPORTED_DTYPES[key.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    shapes = {Operand.ROW: (key.n,), Operand.COL: (key.m, 1), Operand.ELEMENT: (1,), Operand.FULL: (key.m, key.n)}
    kinds = operand_kinds(key.epilogue)

    def operands() -> list[torch.Tensor]:  # as the fused op receives them, flattened as the kernels read them
        return dispatch.flatten_operands([randn(*shapes[kind]) for kind in kinds], key.epilogue, key.n)

    return GemmInputs(
        steps=key.epilogue,
        xs=[randn(key.m, key.k) for _ in range(copies)],
        weights=[randn(key.n, key.k) * key.k**-0.5 for _ in range(copies)],
        operands=[operands() for _ in range(copies)],
        scalars=[0.5] * num_scalars(key.epilogue),
        out_dtype=dtype,
    )


def reference_f64(inputs: GemmInputs) -> torch.Tensor:
    """The exact result of copy 0, in float64."""
    x, w_kn, steps, operands, scalars, _ = inputs.args(0)
    operands = [op.double() for op in operands]
    return apply_epilogue(x.double() @ w_kn.double(), steps, operands.__getitem__, scalars)


class Tuner(Protocol):
    def __call__(self, inputs: GemmInputs, split_k: int, effort: str, budget_s: int | None) -> helion.Config:
        """The best config found for copy 0 of ``inputs`` with ``split_k`` fixed, within ``budget_s``."""
        ...


Timer = Callable[[Step], float]  # microseconds of one call of ``step``
KernelFn = Callable[..., torch.Tensor]  # gemm_epilogue_helion's signature


def gemm_kernel_args(inputs: GemmInputs, split_k: int) -> tuple[Any, ...]:
    """``gemm_kernel``'s arguments for copy 0 at this split, as :func:`gemm_epilogue_helion` passes them."""
    x, w_kn, steps, operands, scalars, out_dtype = inputs.args(0)
    out = torch.empty((x.shape[0], w_kn.shape[1]), dtype=out_dtype, device=x.device)
    return gemm.gemm_kernel_args(x, w_kn, out, list(operands), list(scalars), gemm.tile_epilogue(steps), split_k)


def assert_tensors_close(actual: object, expected: object) -> None:
    """Helion's accuracy check (its default tolerances) on the tensors alone: ``gemm_kernel``'s arguments
    also hold the epilogue callable, which ``torch.testing.assert_close`` refuses to compare."""
    actual_tensors = [t for t in tree_leaves(actual) if isinstance(t, torch.Tensor)]
    expected_tensors = [t for t in tree_leaves(expected) if isinstance(t, torch.Tensor)]
    assert len(actual_tensors) == len(expected_tensors), (len(actual_tensors), len(expected_tensors))
    for a, e in zip(actual_tensors, expected_tensors):
        torch.testing.assert_close(a, e, atol=1e-2, rtol=1e-2)


def helion_autotune(inputs: GemmInputs, split_k: int, effort: str, budget_s: int | None) -> helion.Config:
    """Helion's autotuner (``BoundKernel.autotune``) on ``gemm_kernel``, ``split_k`` fixed by an override.

    The search starts from the config the backend runs today, at this split (a seed, so a short budget
    still explores around a good point), and checks candidates against it: Helion's own baseline, its
    default config with ``split_k`` 1, writes another layout than a split candidate. The kernel is a copy
    of ``gemm_kernel`` with tuning settings, leaving the production one untouched.
    """
    args = gemm_kernel_args(inputs, split_k)
    x, w_kn = args[0], args[1]
    (m, k), n = x.shape, w_kn.shape[1]
    current = configs.config_for(m, k, n, x.dtype, x.device)
    start = helion.Config(**{**dict(current), "split_k": split_k})
    settings = dataclasses.replace(
        gemm_kernel.settings,
        autotune_effort=effort,
        autotune_budget_seconds=budget_s,
        autotune_config_overrides={"split_k": split_k},
        autotune_seed_configs=[start],
        autotune_baseline_fn=gemm_kernel.bind(args).compile_config(start),
        autotune_baseline_accuracy_check_fn=assert_tensors_close,
    )
    tuning_kernel = helion.Kernel(gemm_kernel.fn, settings=settings)
    return tuning_kernel.bind(args).autotune(args, force=True)


@dataclasses.dataclass(frozen=True)
class Measured:
    config: helion.Config
    us: float
    error: float  # relative error against float64


def fastest_valid(
    candidates: Sequence[helion.Config],
    run: Callable[[helion.Config, int], torch.Tensor],
    reference: torch.Tensor,
    timer: Timer,
    tolerance: float = TOLERANCE,
) -> Measured | None:
    """The fastest of ``candidates`` whose result (``run(config, 0)``) is within ``tolerance`` of
    ``reference``; each is timed as ``timer(lambda i: run(config, i))``, in the given order."""
    measured = []
    for config in dict.fromkeys(candidates):  # the searches of two splits may agree
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


def compiled_fallback(inputs: GemmInputs) -> Step:
    """What the site runs without Helion: ``torch.compile`` default of the unfused computation (cuBLAS,
    then Inductor's fused epilogue), as :func:`~helion_backend.dispatch.reference` defines it."""
    # Dynamo caches compiled code per code object and stops compiling after a few shapes; start afresh
    # for every key so the fallback of the tenth shape is compiled too.
    torch._dynamo.reset()
    compiled = torch.compile(dispatch.reference, dynamic=False)
    return lambda i: compiled(*inputs.args(i))


def tune_key(
    key: TuneKey,
    device: torch.device,
    *,
    effort: str,
    budget_s: int | None,
    tuner: Tuner = helion_autotune,
    timer: Timer | None = None,
    kernel: KernelFn = gemm_epilogue_helion,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Tune one key (see the module docstring) and return its table entry; raises ``TuneError`` when no
    split yields a valid config. ``timer`` defaults to CUDA-graph replay on ``device``."""
    if key.kernel != DEFAULT_KERNEL_FAMILY:
        raise TuneError(f"the tune command autotunes the {DEFAULT_KERNEL_FAMILY} family only; {key.kernel} keys "
                        "keep the shipped or default configs (benchmarks/sweep_gemm_configs.py --kernel sweeps the "
                        "other families)")
    start = clock()
    timer = timer or functools.partial(time_callable_us, config=TIMING, device=device)
    itemsize = SUPPORTED_DTYPES[key.dtype].itemsize
    inputs = make_inputs(key, device, copies=copies_to_defeat_l2(key.k * key.n * itemsize, device))
    splits = configs.split_k_choices(key.k)
    share = None if budget_s is None else max(1, budget_s // len(splits))
    candidates: list[helion.Config] = []
    failures: list[str] = []
    for split_k in splits:
        try:
            candidates.append(tuner(inputs, split_k, effort, share))
        except Exception as e:  # a split Helion cannot tune must not cost the others
            failures.append(f"split_k={split_k}: {type(e).__name__}: {e}")
            log.warning("helion_inductor tune: %s: autotuning at split_k=%d failed (%s)", key, split_k, e)
    # The config the backend runs today (shipped table, else the hand-picked default) competes too, so a
    # short budget never leaves a key slower than it was.
    candidates.append(configs.config_for(key.m, key.k, key.n, SUPPORTED_DTYPES[key.dtype], device))

    def run(config: helion.Config, i: int) -> torch.Tensor:
        return kernel(*inputs.args(i), config=config)

    best = fastest_valid(candidates, run, reference_f64(inputs), timer)
    if best is None:
        raise TuneError(f"no valid config among {len(candidates)} ({'; '.join(failures) or 'all off'})")
    fallback_us = timer(compiled_fallback(inputs))
    return {
        "dtype": key.dtype, "k": key.k, "n": key.n, "m": key.m,
        "config": dict(best.config),
        "us": round(best.us, 2),
        "fallback_us": round(fallback_us, 2),
        "helion_wins": best.us < fallback_us,
        "epilogue": list(key.epilogue),
        "error": float(f"{best.error:.2e}"),
        "candidates": len(set(candidates)),
        "effort": effort,
        "seconds": round(clock() - start, 1),
    }


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
) -> Summary:
    """Tune every key not in ``table`` (every key with ``force``), writing each entry as soon as it is done.
    A key that fails is reported and skipped; one line per key goes to ``progress`` (default: stderr)."""
    progress = progress or sys.stderr  # looked up now, not at import: callers (and pytest) may swap it
    summary = Summary()
    keys_left = sum(force or key not in table for key in keys)
    durations: list[float] = []

    def say(i: int, key: TuneKey, what: str) -> None:
        print(f"[{i}/{len(keys)}] {key}: {what}", file=progress, flush=True)

    for i, key in enumerate(keys, 1):
        if not force and key in table:
            summary.skipped += 1
            say(i, key, "in the table already, skipped (--force retunes)")
            continue
        say(i, key, f"tuning; ETA {eta(durations, keys_left, budget_s)}")
        start = clock()
        try:
            entry = tune_one(key)
        except Exception as e:  # one key's failure (a Helion error, out of memory) must not cost the rest
            summary.failed.append(f"{key}: {e}")
            say(i, key, f"FAILED ({type(e).__name__}: {e})")
        else:
            table.put(entry, metadata())
            summary.tuned += 1
            verdict = "Helion wins" if entry["helion_wins"] else "torch.compile wins"
            say(i, key, f"{entry['us']} us, torch.compile {entry['fallback_us']} us ({verdict}); "
                        f"{format_duration(clock() - start)}, saved")
        durations.append(clock() - start)
        keys_left -= 1
    return summary


# ---------------------------------------------------------------------------------------------------
# Command line

DESCRIPTION = """\
Autotune the Helion GEMM kernels of the sites listed in a compile manifest, for each token count (M),
and save the best config per key to the user's config table, which later compiles use.

Compiles with backend="helion_inductor" on CUDA record the sites they send to Helion in
<cache_dir>/manifest.json. For every (dtype, K, N, M) of it (static M as compiled; dynamic M for each
--num-tokens value up to the site's Helion limit) this runs Helion's autotuner, checks the result
against float64, times it and torch.compile's fallback under CUDA-graph replay, and writes the entry to
<cache_dir>/configs/<gpu>.json right away. Keys already there are skipped, so a stopped run resumes.
"""

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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest", type=Path, help="the manifest compiles wrote (<cache_dir>/manifest.json)")
    parser.add_argument("--effort", choices=EFFORTS, default="quick",
                        help="Helion's autotuning effort preset (default: quick)")
    parser.add_argument("--num-tokens", type=parse_num_tokens, default=DEFAULT_NUM_TOKENS, metavar="M,M,...",
                        help="token counts to tune for sites compiled with a dynamic M, capped at each "
                             f"site's Helion limit (default: {','.join(map(str, DEFAULT_NUM_TOKENS))})")
    parser.add_argument("--budget-per-key", type=_positive_int, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help="autotuning time per key, shared by its split-K searches; validation and timing "
                             f"add a little (default: {DEFAULT_BUDGET_S})")
    parser.add_argument("--force", action="store_true", help="retune keys already in the user table")
    parser.add_argument("--cache-dir", type=Path,
                        help="write the table to CACHE_DIR/configs/ (default: the manifest's folder)")


def _writable_table(cache_dir: Path, device: torch.device) -> Path:
    """The user table of ``device`` under ``cache_dir``, whose folder is created and checked now rather
    than after the first key's minutes of tuning."""
    config_dir = Path(BackendOptions(cache_dir=str(cache_dir)).config_dir)
    try:
        config_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TuneError(f"cannot create the user config folder {config_dir} ({e})") from e
    if not os.access(config_dir, os.W_OK):
        raise TuneError(f"cannot write the user config table in {config_dir} (no write permission)")
    return config_dir / f"{configs.gpu_key(device)}.json"


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
    path = _writable_table(args.cache_dir or args.manifest.parent, device)
    table = ConfigTable.load(path, shlex.join(sys.orig_argv))
    print(f"{len(keys)} key(s) from {args.manifest} -> {path} (effort {args.effort}, "
          f"{args.budget_per_key}s per key)", file=sys.stderr)
    tune_one = functools.partial(tune_key, device=device, effort=args.effort, budget_s=args.budget_per_key)
    summary = tune_all(keys, table, tune_one, functools.partial(table_metadata, device),
                       force=args.force, budget_s=args.budget_per_key)
    print(f"{summary.tuned} tuned, {summary.skipped} skipped, {len(summary.failed)} failed -> {path}",
          file=sys.stderr)
    for failure in summary.failed:
        print(f"  failed: {failure}", file=sys.stderr)
    return 1 if summary.failed else 0
