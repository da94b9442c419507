"""Backend options: the one place their names, types and defaults live."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

DEBUG_DIR_ENV = "HELION_INDUCTOR_DEBUG_DIR"
CACHE_DIR_ENV = "HELION_INDUCTOR_CACHE_DIR"
CODE_CACHE_ENV = "HELION_INDUCTOR_CODE_CACHE"
VERIFY_ENV = "HELION_INDUCTOR_VERIFY"
UNTUNED_SITES_ENV = "HELION_INDUCTOR_UNTUNED_SITES"

# Where a site runs whose key no config table measured closely enough (evidence ``none``): with Inductor,
# at torch.compile's own speed, or on Helion with an untimed config (kernel tests, measuring untuned kernels).
UNTUNED_INDUCTOR = "inductor"
UNTUNED_HELION = "helion"
UNTUNED_SITES = (UNTUNED_INDUCTOR, UNTUNED_HELION)

# Who runs a graph's CUDA graphs where they are on: Inductor's cudagraph trees, or the backend's direct replay of
# the whole compiled graph (:mod:`helion_backend.runtime.direct_cuda_graph`), whose host path per call is shorter.
CUDAGRAPH_TREES = "trees"
CUDAGRAPH_DIRECT = "direct"
CUDAGRAPH_RUNNERS = (CUDAGRAPH_TREES, CUDAGRAPH_DIRECT)

# The token counts (M) the tables are tuned at: the tune command's --num-tokens default, and the Ms at which
# placement checks a dynamic-M site's evidence.
DEFAULT_NUM_TOKENS = (1, 2, 4, 8, 16, 24, 32)

# Autotuning defaults, shared by ``python -m helion_backend tune`` and the option ``autotune_missing``.
# ``sweep`` times the family's fixed candidate configs at the key (:mod:`helion_backend.tuning.candidates`),
# seconds a key; the others are Helion's autotune_effort presets that search ("none" does not), minutes a key.
SWEEP_EFFORT = "sweep"
HELION_TUNE_EFFORTS = ("quick", "full")
TUNE_EFFORTS = (SWEEP_EFFORT, *HELION_TUNE_EFFORTS)
DEFAULT_TUNE_EFFORT = "quick"
DEFAULT_TUNE_BUDGET_S = 300  # seconds of autotuning per key
# The sweep's compile workers (``tune --jobs``): half the CPUs, as each Triton compile takes one and the main
# process and the workers' Python want some too; at most 8, as each holds a CUDA context and torch in memory.
MAX_DEFAULT_TUNE_JOBS = 8


# ``<cache_dir>/reports`` keeps the report of each graph Inductor's caches may serve, one small file a graph:
# the newest SAVED_REPORTS_KEPT, none unused for SAVED_REPORTS_MAX_AGE_DAYS (a graph served again is used).
SAVED_REPORTS_KEPT = 1000
SAVED_REPORTS_MAX_AGE_DAYS = 30


def default_tune_jobs() -> int:
    """``tune --jobs`` by default: half this process's CPUs, between 1 and :data:`MAX_DEFAULT_TUNE_JOBS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_TUNE_JOBS, cpus // 2))


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _default_cache_dir() -> str:
    return os.environ.get(CACHE_DIR_ENV) or str(Path.home() / ".cache" / "helion_inductor")


@dataclass(frozen=True)
class BackendOptions:
    """Options given as ``torch.compile(..., backend="helion_inductor", options={...})``."""

    rules: tuple[str, ...] = ()
    """Extra rule files (TOML), loaded after the shipped ones."""
    builtin_rules: bool = True
    """Load the rule files shipped in ``rules/``."""
    max_helion_size: int = 32
    """Largest M (num_tokens) a site runs through Helion; larger M keeps cuBLAS and Inductor."""
    rmsnorm_prologue_max_m: int = 1
    """Largest static M whose GEMM takes an RMSNorm into its prologue. For one row the fused norm costs the
    kernel less than the norm's own launch; for more rows its first pass over x in every output tile costs
    more than that launch."""
    decode_attention_max_rows: int = 16
    """Largest static query length (rows per head) whose ``scaled_dot_product_attention`` runs as the Helion
    decode kernel, which splits the KV cache over the GPU; 0 keeps PyTorch's kernels everywhere. Longer
    queries (prefill) keep them: they are tiled for long queries, and win there."""
    fuse_activation_quant: bool = False
    """Quantize a quantized GEMM's activation per token (fp8 dynamic, W8A8 int8) inside the Helion kernel. Off:
    Inductor computes the quantization, fused into the kernel that produces the activation (the RMSNorm, the
    residual add), and the Helion kernel reads the quantized rows and multiplies by their scales in its
    epilogue; on: the kernel quantizes the float activation itself (as its config's ``prequantize`` says: in
    a launch of its own, or in every output tile). Off by default: that launch costs time that Inductor's
    fusion does not. Block fp8 and weight-only formats are not affected."""
    frozen_weights: bool = False
    """The model's weights never change in place after its first call, so a site may keep a weight in another
    layout beside it, made once: int4 weight-only sites then run tinygemm (``aten._weight_int4pack_mm``) at the
    Ms where the config table timed it faster than Helion's config (and than Inductor, at a key Inductor would
    have run), on a tiled copy of the weight. Off: every
    site reads the weights as they are at each call (a copy made at the first call would go stale under an
    in-place update, which CUDA-graph replays cannot see)."""
    merge_siblings: bool = True
    """Run GEMM sites that read the same activation (a decoder's q, k and v) in one Helion launch."""
    rewrite_on_cpu: bool = False
    """Rewrite CPU graphs too (they then run the reference implementation); for tests and inspection."""
    cudagraphs: bool | None = None
    """CUDA graphs through Inductor's cudagraph trees; None means on when the graph runs on CUDA, off elsewhere."""
    cudagraph_runner: str = CUDAGRAPH_TREES
    """Where CUDA graphs are on, who captures and replays them (one of :data:`CUDAGRAPH_RUNNERS`): ``trees``,
    Inductor's cudagraph trees, as ``mode="reduce-overhead"`` has them; or ``direct``, one CUDA graph of the whole
    compiled graph per input signature, replayed by the backend after copying in the inputs that are not static
    and returning copies of the outputs (:mod:`helion_backend.runtime.direct_cuda_graph`), for a shorter host path
    per call; a graph a replay could get wrong runs without CUDA graphs, and its report says why, and training
    graphs keep the trees. Experimental: not yet run on a GPU."""
    cudagraph_safe_ops: tuple[str, ...] = ()
    """Custom ops (``"namespace::name"``) or op namespaces (``"namespace"``) known to be safe to capture in a
    CUDA graph: no host reads of their inputs, no allocation that outlives the call. Custom ops outside
    PyTorch's namespaces and these run between the captured parts of a graph (:mod:`helion_backend.cuda_graphs`),
    and the report lists them."""
    debug_dir: str | None = field(default_factory=lambda: os.environ.get(DEBUG_DIR_ENV) or None)
    """Write per-graph dumps and ``report.json`` here (also set by $HELION_INDUCTOR_DEBUG_DIR)."""
    cache_dir: str = field(default_factory=_default_cache_dir)
    """What outlives a process: reports of cached graphs, the manifest of Helion sites, user-tuned configs,
    Helion's generated kernel code."""
    code_cache: bool = field(default_factory=lambda: os.environ.get(CODE_CACHE_ENV, "1") != "0")
    """Keep Helion's generated code in ``<cache_dir>/kernels``, so that a new process launches a kernel without
    tracing it again (0.3-0.5 s a kernel signature); $HELION_INDUCTOR_CODE_CACHE=0 turns it off. Kernels compile
    when they first run, so this and ``cache_dir`` apply process-wide: each compile sets them for the kernels
    launched after it (:mod:`helion_backend.code_cache`)."""
    verify: bool = field(default_factory=lambda: env_flag(VERIFY_ENV))
    """Self-check: the first run of each fused site at each M also runs the site's unfused reference on the same
    inputs and compares (relative error at a tolerance of the site's dtypes, :mod:`helion_backend.runtime.verify`); a
    site that diverges warns once, notes it in the report and runs its reference from then on. The check runs
    outside CUDA-graph capture (cudagraph trees' warm-up run). Also set by $HELION_INDUCTOR_VERIFY=1; off by
    default, as each first run costs a second computation."""
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``torch._inductor.config`` patches, applied after the ``mode``'s."""
    untuned_sites: str = field(default_factory=lambda: os.environ.get(UNTUNED_SITES_ENV) or UNTUNED_INDUCTOR)
    """Where a site runs on CUDA whose key (kernel family, dtype, K, N, M) no config table measured, nor a key
    close enough to borrow its verdict (the report's evidence ``none``, :mod:`helion_backend.policy`):
    ``inductor`` (cuBLAS + Inductor's epilogue: never slower than ``torch.compile``) or ``helion`` (the
    hand-picked default config, untimed). Also set by $HELION_INDUCTOR_UNTUNED_SITES. With ``autotune_missing``
    such sites run Helion with the config tuned for them before the first run."""
    autotune_missing: bool = False
    """Autotune, on CUDA, the Helion keys (kernel family, dtype, K, N, M) a compiled graph needs and no config
    table holds exactly, as ``python -m helion_backend tune`` would, into the user table in ``cache_dir``;
    before the graph's first run, never while a CUDA graph is being captured. Off by default: a key takes
    up to ``autotune_budget_s`` seconds, and a compile should not silently take minutes."""
    autotune_effort: str = DEFAULT_TUNE_EFFORT
    """The tune command's effort for ``autotune_missing`` (one of :data:`TUNE_EFFORTS`): ``sweep`` times a few
    fixed candidate configs (seconds a key), ``quick`` and ``full`` run Helion's autotuner (minutes a key)."""
    autotune_budget_s: int = DEFAULT_TUNE_BUDGET_S
    """Seconds of Helion's autotuning per key for ``autotune_missing`` (validation and timing add a little;
    the ``sweep`` effort does not search, so it has no use for it)."""

    @classmethod
    def from_user(cls, options: Mapping[str, Any] | None) -> BackendOptions:
        if options is not None and not isinstance(options, Mapping):
            raise TypeError(f"helion_inductor: options must be a dict of option names to values, got {options!r}")
        options = dict(options or {})
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(valid), key=str)
        if unknown:
            raise ValueError(f"helion_inductor: unknown option(s) {_unknown_names(unknown, valid)}; "
                             f"valid options are {sorted(valid)}")
        if "rules" in options:
            options["rules"] = _rule_paths(options["rules"])
        for name in ("cache_dir", "debug_dir"):
            if name in options:
                options[name] = _folder(name, options[name])
        if "inductor_config" in options:
            options["inductor_config"] = _inductor_config(options["inductor_config"])
        if "cudagraph_safe_ops" in options:
            options["cudagraph_safe_ops"] = _op_names(options["cudagraph_safe_ops"])
        made = cls(**options)
        made._check_types()
        return made

    def _check_types(self) -> None:
        expected = {
            "builtin_rules": bool,
            "code_cache": bool,
            "fuse_activation_quant": bool,
            "merge_siblings": bool,
            "rewrite_on_cpu": bool,
            "verify": bool,
            "max_helion_size": int,
            "rmsnorm_prologue_max_m": int,
            "decode_attention_max_rows": int,
            "untuned_sites": str,
            "cudagraph_runner": str,
            "autotune_missing": bool,
            "autotune_effort": str,
            "autotune_budget_s": int,
        }
        for name, typ in expected.items():
            value = getattr(self, name)
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise TypeError(f"helion_inductor: option {name!r} must be {typ.__name__}, got {value!r}")
        for name in ("max_helion_size", "decode_attention_max_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"helion_inductor: option {name!r} must be >= 0")
        if self.untuned_sites not in UNTUNED_SITES:
            raise ValueError(f"helion_inductor: option 'untuned_sites' must be one of {list(UNTUNED_SITES)}, "
                             f"got {self.untuned_sites!r}")
        if self.cudagraph_runner not in CUDAGRAPH_RUNNERS:
            raise ValueError(f"helion_inductor: option 'cudagraph_runner' must be one of {list(CUDAGRAPH_RUNNERS)}, "
                             f"got {self.cudagraph_runner!r}")
        if self.autotune_effort not in TUNE_EFFORTS:
            raise ValueError(f"helion_inductor: option 'autotune_effort' must be one of {list(TUNE_EFFORTS)}, "
                             f"got {self.autotune_effort!r}")
        if self.autotune_budget_s < 1:
            raise ValueError("helion_inductor: option 'autotune_budget_s' must be >= 1")
        if self.cudagraphs not in (None, True, False):
            raise TypeError(f"helion_inductor: option 'cudagraphs' must be a bool, got {self.cudagraphs!r}")

    @property
    def config_dir(self) -> str:
        """User-tuned config tables (``<gpu>.json``, the shipped format); they override the shipped ones."""
        return str(Path(self.cache_dir) / "configs")

    @property
    def manifest_path(self) -> str:
        """The sites compiles sent to Helion (``manifest.json``), for ``python -m helion_backend tune``."""
        return str(Path(self.cache_dir) / "manifest.json")

    @property
    def code_cache_dir(self) -> str | None:
        """Helion's generated code, one JSON file per kernel signature (:mod:`helion_backend.code_cache`);
        None when the code cache is off."""
        return str(Path(self.cache_dir) / "kernels") if self.code_cache else None

    def fingerprint(self) -> dict[str, Any]:
        """What of the options changes the rewrite (the folders, the code cache, how compile-time autotuning
        tunes and the run-time self-check do not: a graph served from the caches is tuned and checked from the
        sites saved with it; whether it tunes does, as it sends untuned sites to Helion)."""
        values = dataclasses.asdict(self)
        for name in ("debug_dir", "cache_dir", "code_cache", "autotune_effort", "autotune_budget_s", "verify"):
            values.pop(name)
        values["inductor_config"] = sorted((k, repr(v)) for k, v in self.inductor_config.items())
        return values


def _unknown_names(unknown: list[Any], valid: list[str]) -> str:
    """Each unknown name, with "(did you mean ...?)" where one valid name is close to it."""
    def described(name: Any) -> str:
        close = difflib.get_close_matches(name, valid, n=1) if isinstance(name, str) else []
        return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")

    return ", ".join(map(described, unknown))


def _rule_paths(value: Any) -> tuple[str, ...]:
    """The option ``rules``: one path or a list of paths (str or os.PathLike)."""
    paths = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(paths, (list, tuple)) or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise TypeError(f"helion_inductor: option 'rules' must be a path or a list of paths to rule files (TOML), "
                        f"got {value!r}")
    return tuple(str(Path(p)) for p in paths)


def _op_names(value: Any) -> tuple[str, ...]:
    """The option ``cudagraph_safe_ops``: one name or a list of names, each ``"namespace"`` or
    ``"namespace::name"``."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(
        isinstance(n, str) and re.fullmatch(r"\w+(::\w+)?", n) for n in names
    ):
        raise TypeError("helion_inductor: option 'cudagraph_safe_ops' must be a list of op namespaces "
                        f"(\"mylib\") or custom ops (\"mylib::my_op\"), got {value!r}")
    return tuple(names)


def _folder(name: str, value: Any) -> str | None:
    """The options ``cache_dir`` and ``debug_dir``: a path (str or os.PathLike); ``debug_dir`` may be None."""
    if value is None and name == "debug_dir":
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"helion_inductor: option {name!r} must be a path to a folder (str or os.PathLike), "
                        f"got {value!r}")
    return str(Path(value))


def _inductor_config(value: Any) -> dict[str, Any]:
    """The option ``inductor_config``: a dict of ``torch._inductor.config`` names to values."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"helion_inductor: option 'inductor_config' must be a dict of torch._inductor.config names "
                        f"to values, got {value!r}")
    return dict(value)
