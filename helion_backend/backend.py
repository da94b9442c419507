"""The ``helion_inductor`` backend: Inductor's ``compile_fx`` with the pass manager installed.

Everything not fused is compiled by Inductor exactly as ``torch.compile`` would; the backend only adds
its post-grad pass, CUDA graphs on by default for graphs on CUDA devices (Inductor's cudagraph trees, or with the
option ``cudagraph_runner="direct"`` its own replay of a whole inference graph, :class:`DirectCudaGraph`), and the
report. With the option
``autotune_missing``, the compiled graph autotunes the Helion keys it needs that no config table holds, once,
before it first runs (:class:`AutotuneBeforeFirstRun`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

from helion_backend import code_cache, cuda_graphs, environment
from helion_backend import report as reports
from helion_backend.compile.manager import HelionPassManager
from helion_backend.manifest import ManifestSite
from helion_backend.options import (
    CUDAGRAPH_DIRECT,
    SAVED_REPORTS_KEPT,
    SAVED_REPORTS_MAX_AGE_DAYS,
    BackendOptions,
)
from helion_backend.runtime import ops, verify  # noqa: F401  (ops registers the custom ops the passes insert)
from helion_backend.runtime.direct_cuda_graph import DirectCudaGraph
from helion_backend.runtime.token_routing import TokenRouter, make_token_counter
from helion_backend.vocabulary import BACKEND_NAME

log = logging.getLogger(__name__)

_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def helion_inductor(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    mode: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
    """Compile a Dynamo graph: Inductor plus the GEMM-epilogue fusion pipeline."""
    opts = BackendOptions.from_user(options)
    code_cache.configure(opts)
    manager = HelionPassManager(opts)
    direct = (_cudagraphs_on(mode, opts, example_inputs) and opts.cudagraph_runner == CUDAGRAPH_DIRECT
              and not _needs_autograd(example_inputs))
    patches = _inductor_config(mode, opts, example_inputs, trees=not direct)
    pristine = _copy_graph_module(gm) if _has_symbolic_inputs(example_inputs) else None

    compiled = _compile(gm, example_inputs, manager, patches, direct)
    state = _saved_state(manager, gm, example_inputs, opts)
    if state is None:
        # Inductor's cache knew this graph but the backend's record of it is gone (deleted, say) or lacks
        # the dumps debug_dir asks for: compile it once more with the caches off, so the pipeline runs and
        # its report, dumps and routing are not lost.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = _compile(gm, example_inputs, manager, {**patches, "fx_graph_cache": False}, direct)
        state = _saved_state(manager, gm, example_inputs, opts)
    if opts.verify and state is not None:
        verify.watch(_op_sites(state))
    routed = _route_tokens(compiled, pristine, state, example_inputs, patches, opts, direct)
    if direct:
        routed = _with_direct_cuda_graph(routed, state)
    return _with_autotuning(routed, state, opts, example_inputs)


def _op_sites(state: dict[str, Any]) -> list[str]:
    """The ``site`` names of the fused ops in the graphs of ``state`` (a compile's, or one served from the
    caches): every site not left to Inductor, and every attention node sent to the decode kernel."""
    names = []
    for report, _ in state["graphs"]:
        names += [reports.site_id(report.op_graph, s.anchor) for s in report.sites if s.runs_on != "inductor"]
        names += [reports.site_id(report.op_graph, a.node) for a in report.attention if a.runs_on != "inductor"]
    return names


def _route_tokens(compiled: Callable[..., Any], pristine: torch.fx.GraphModule | None, state: dict[str, Any] | None,
                  example_inputs: Sequence[Any], patches: dict[str, Any], opts: BackendOptions,
                  direct: bool) -> Callable[..., Any]:
    """``compiled``, or with a dynamic M a router between it and a plain variant compiled from ``pristine``."""
    dynamic_sites = state["dynamic_sites"] if state else []
    if pristine is None or not dynamic_sites:
        return compiled
    site_ms = make_token_counter(pristine, [expr for expr, _ in dynamic_sites])
    if site_ms is None:
        log.warning("helion_inductor: cannot locate the token dimension in the inputs; every M runs "
                    "the rewritten graph")
        return compiled
    # Compiled now, inside Dynamo's tracing context, so the variant keeps the symbolic shapes.
    plain_patches = {k: v for k, v in patches.items() if k != "post_grad_custom_pre_pass"}
    plain = compile_fx(pristine, example_inputs, inner_compile=_inner_compile(opts, direct=direct),
                       config_patches=plain_patches)
    return TokenRouter(small=compiled, large=plain, site_ms=site_ms, limits=[limit for _, limit in dynamic_sites])


def _with_direct_cuda_graph(compiled: Callable[..., Any], state: dict[str, Any] | None) -> Callable[..., Any]:
    """``compiled`` replayed by :class:`DirectCudaGraph`, whose decisions go to its graphs' reports; as it is (no
    CUDA graphs) where a graph of it holds custom ops not known to be capture-safe."""
    graph_reports = [report for report, _ in (state or {}).get("graphs", [])]

    def on_event(text: str) -> None:
        for report in graph_reports:
            report.direct_cuda_graph.append(text)

    uncaptured = sorted({op for report in graph_reports for op in report.outside_cuda_graphs})
    if uncaptured:
        on_event(f"not replayed: it calls custom ops not known to be capture-safe ({', '.join(uncaptured)}; "
                 "option cudagraph_safe_ops vouches for them, cudagraph_runner='trees' runs the rest under CUDA "
                 "graphs)")
        log.info("helion_inductor: a graph runs without CUDA graphs: custom ops %s", uncaptured)
        return compiled
    return DirectCudaGraph(compiled, on_event)


def _needs_autograd(example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd makes a training graph of these inputs (the direct runner replays inference only)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _with_autotuning(compiled: Callable[..., Any], state: dict[str, Any] | None, opts: BackendOptions,
                     example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """``compiled``, first autotuning its graphs' missing keys where the option ``autotune_missing`` asks."""
    if not opts.autotune_missing:
        return compiled
    graphs = [(report, sites) for report, sites in (state or {}).get("graphs", []) if sites]
    device = _tuning_device(example_inputs)
    if device is None or not graphs:
        log.debug("helion_inductor: autotune_missing: nothing to tune (%s)",
                  "no Helion site" if device is not None else "not a CUDA graph, or Helion cannot run")
        return compiled
    return AutotuneBeforeFirstRun(compiled, graphs, opts, device)


def _tuning_device(example_inputs: Sequence[Any]) -> torch.device | None:
    """The CUDA device whose keys ``autotune_missing`` tunes; None off CUDA or where Helion cannot run (the CPU
    tests replace this, and nothing else, to run the loop with injected tuners)."""
    if environment.helion_unavailable_reason() is not None:
        return None
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda), None)


class AutotuneBeforeFirstRun:
    """Calls ``compiled``; the first call made outside CUDA-graph capture first autotunes the keys its graphs'
    Helion sites need and no table holds (:func:`.tuning.tune_missing`).

    Not in the backend call: there Dynamo's tracing context (and its fake mode) is active, while tuning compiles
    Helion kernels and ``torch.compile`` fallbacks and runs them on real tensors. Not in a capture: tuning
    synchronizes and captures graphs of its own; a call under a caller's ``torch.cuda.graph`` runs the
    configs it has and leaves tuning to the next call. Inductor's cudagraph trees capture inside ``compiled``,
    after the tuning. The fused ops look their configs up per call, so the first run already uses the new ones.
    """

    def __init__(self, compiled: Callable[..., Any], graphs: list[tuple[reports.GraphReport, list[ManifestSite]]],
                 opts: BackendOptions, device: torch.device) -> None:
        self.compiled = compiled
        self.graphs = graphs
        self.opts = opts
        self.device = device
        self._pending = True
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        if self._pending and not cuda_graphs.stream_capturing():
            with self._lock:
                if self._pending:
                    try:
                        self._tune()
                    except Exception as e:  # tune_missing does not raise; a bug here must not fail the run
                        log.warning("helion_inductor: autotune_missing failed (%s: %s); configs unchanged",
                                    type(e).__name__, e, exc_info=True)
                    finally:
                        self._pending = False
        return self.compiled(*args)

    def _tune(self) -> None:
        from helion_backend.tuning import loop as tuning  # imports Helion: only where a key may need tuning

        outcomes = tuning.tune_missing([site for _, sites in self.graphs for site in sites], self.opts, self.device)
        for report, sites in self.graphs:
            own = {key.table_key for key in tuning.expand_keys(sites, tuning.DEFAULT_NUM_TOKENS)}
            report.autotuned = [text for key, text in outcomes.items() if key in own]
            if report.autotuned and self.opts.debug_dir:
                try:
                    reports.write_report(Path(self.opts.debug_dir) / report.graph, report)
                except OSError as e:
                    log.warning("helion_inductor: cannot update the report in %s: %s", self.opts.debug_dir, e)


def _compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], manager: HelionPassManager,
             patches: dict[str, Any], direct: bool) -> Callable[..., Any]:
    return compile_fx(gm, example_inputs, inner_compile=_inner_compile(manager.options, manager, direct),
                      config_patches={**patches, "post_grad_custom_pre_pass": manager})


def _inner_compile(opts: BackendOptions, manager: HelionPassManager | None = None,
                   direct: bool = False) -> Callable[..., Any]:
    """Inductor's ``compile_fx_inner`` with the custom ops not known to be capture-safe kept out of CUDA graphs
    (:mod:`.cuda_graphs`); with ``manager``, which also learns the graph's kind and those ops, for its report.
    ``direct``: the direct CUDA-graph runner is to replay the graph (:func:`_with_direct_cuda_graph`), which such
    ops keep from it."""
    def inner_compile(gm: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        captured = torch._inductor.config.triton.cudagraphs or direct
        uncaptured = cuda_graphs.ops_outside_cuda_graphs(gm.graph, opts.cudagraph_safe_ops) if captured else []
        if manager is not None:
            manager.graph_kind = (
                "backward" if kwargs.get("is_backward") else
                "inference" if kwargs.get("is_inference") else "forward"
            )
            manager.outside_cuda_graphs = uncaptured
        with torch._inductor.config.patch(cuda_graphs.partition_patches(uncaptured)):
            return compile_fx_inner(gm, inputs, **kwargs)

    return inner_compile


def _cudagraphs_on(mode: str | None, opts: BackendOptions, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph runs under CUDA graphs: the option ``cudagraphs``, else on for a CUDA graph, except in
    ``max-autotune-no-cudagraphs``."""
    if opts.cudagraphs is not None:
        return opts.cudagraphs
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    return on_cuda and mode != "max-autotune-no-cudagraphs"


def _inductor_config(mode: str | None, opts: BackendOptions, example_inputs: Sequence[Any],
                     trees: bool = True) -> dict[str, Any]:
    """The ``torch._inductor.config`` patches of a compile; Inductor's CUDA graphs (its trees) only with ``trees``
    (else the direct runner replays the graph)."""
    mode = mode or "default"
    if mode not in _MODES:
        raise ValueError(f"helion_inductor: unknown mode {mode!r}; valid modes are {list(_MODES)}")
    patches: dict[str, Any] = dict(torch._inductor.list_mode_options(mode) or {})
    patches["triton.cudagraphs"] = _cudagraphs_on(mode, opts, example_inputs) and trees
    patches.update(opts.inductor_config)
    if opts.verify:  # the self-check runs in the first, uncaptured run: cudagraph trees' warm-up
        patches["triton.skip_cudagraph_warmup"] = False
    return patches


def _saved_state(manager: HelionPassManager, gm: torch.fx.GraphModule,
                 example_inputs: Sequence[Any], opts: BackendOptions) -> dict[str, Any] | None:
    """Keep what the pipeline learned beside Inductor's caches, and replay it on a cache hit.

    A hit in Inductor's FX graph cache or AOTAutograd's cache skips the post-grad passes, so the
    pipeline never sees the graph; what it saved when it did (the reports, the symbolic M of the
    rewritten sites, as strings, each graph's Helion sites, for ``autotune_missing``, and its
    before/after dumps where it wrote them) is served instead. ``graphs`` pairs each report with its
    sites. None when there is nothing to serve, or when ``debug_dir`` asks for dumps that were not saved.
    """
    path = Path(opts.cache_dir) / "reports" / f"{_graph_key(manager, gm, example_inputs)}.json"
    if manager.reports:
        return _save_state(manager, path)
    state = _load_state(path)
    if state is None:
        log.info("helion_inductor: recompiling a graph served from Inductor's cache without its report")
        return None
    if opts.debug_dir and None in state["dumps"]:
        log.info("helion_inductor: recompiling a graph served from Inductor's cache: its report was saved "
                 "without the dumps debug_dir asks for")
        return None
    for (report, _), dump in zip(state["graphs"], state["dumps"]):
        report.served_from_cache()
        report.picture = None  # the pipeline drew nothing this time: the picture is in the filling compile's dumps
        reports.record(report)
        if opts.debug_dir:
            _replay_dump(Path(opts.debug_dir) / report.graph, report, dump)
    return state


def _save_state(manager: HelionPassManager, path: Path) -> dict[str, Any]:
    state = {"reports": [r.to_json() for r in manager.reports],
             "dynamic_sites": [[str(expr), limit] for expr, limit in manager.dynamic_sites],
             "helion_sites": [[site.to_json() for site in sites] for sites in manager.helion_sites],
             "dumps": manager.dumps}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state))
        prune_saved_reports(path.parent)
    except OSError as e:
        log.warning("helion_inductor: cannot save the report to %s: %s", path, e)
    return {**state, "graphs": list(zip(manager.reports, manager.helion_sites))}


def _load_state(path: Path) -> dict[str, Any] | None:
    """The state :func:`_save_state` wrote, with its reports and sites parsed; None if absent or corrupt."""
    try:
        state = json.loads(path.read_text())
        _mark_used(path)
        served = [reports.GraphReport.from_json(entry) for entry in state["reports"]]
        state["dynamic_sites"] = [(str(expr), int(limit)) for expr, limit in state["dynamic_sites"]]
        # Saved before compile-time autotuning existed: no sites, nothing to tune.
        saved_sites = state.get("helion_sites") or [[] for _ in served]
        state["graphs"] = list(zip(served, [[ManifestSite.from_json(s) for s in sites] for sites in saved_sites]))
        # Saved without dumps (none were asked for, or before they were kept): None for each graph.
        state["dumps"] = [_dump_pair(d) for d in state.get("dumps") or [None for _ in served]]
        counts = (len(served), len(saved_sites), len(state["dumps"]))
        if len(set(counts)) != 1:
            raise ValueError("{} reports, {} site lists, {} dumps".format(*counts))
    except OSError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        log.warning("helion_inductor: ignoring the corrupt saved report %s (%s)", path, e)
        return None
    return state


def _dump_pair(saved: Any) -> tuple[str, str] | None:
    if saved is None:
        return None
    before, after = saved
    if not (isinstance(before, str) and isinstance(after, str)):
        raise TypeError("a saved dump is not two strings")
    return before, after


def _replay_dump(directory: Path, report: reports.GraphReport, dump: tuple[str, str]) -> None:
    """The dumps of a graph served from the cache, as the compile that rewrote it wrote them."""
    try:
        reports.write_dump(directory, report, *dump)
    except OSError as e:
        log.warning("helion_inductor: cannot write the dumps to %s: %s", directory, e)
def prune_saved_reports(folder: Path, keep: int = SAVED_REPORTS_KEPT,
                        max_age_days: float = SAVED_REPORTS_MAX_AGE_DAYS) -> list[Path]:
    """Delete the saved reports in ``folder`` beyond the ``keep`` most recently used and those unused for
    ``max_age_days``; the deleted paths. A graph whose report is gone is compiled once more when Inductor's
    cache serves it (:func:`helion_inductor`), so pruning costs time, never correctness."""
    now = time.time()
    used = []
    for path in folder.glob("*.json"):
        try:
            used.append((path.stat().st_mtime, path))
        except OSError:  # deleted by another process meanwhile
            continue
    used.sort(reverse=True)
    stale = [path for i, (mtime, path) in enumerate(used) if i >= keep or now - mtime > max_age_days * 86400]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _mark_used(path: Path) -> None:
    """Count a served report as recently used, so pruning keeps it."""
    try:
        os.utime(path)
    except OSError:
        pass


def _graph_key(manager: HelionPassManager, gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> str:
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return [str(x.dtype), str(x.device), [str(s) for s in x.shape], [str(s) for s in x.stride()],
                    x.requires_grad]
        return type(x).__name__
    payload = json.dumps([manager.uuid(), torch.__version__, gm.code, [describe(x) for x in inputs]])
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def register_backend() -> None:
    """Register the backend name unless the installed entry point already provides it."""
    from torch._dynamo.backends.registry import _BACKENDS
    from torch._dynamo.backends.registry import register_backend as register

    if BACKEND_NAME not in _BACKENDS:
        register(name=BACKEND_NAME)(helion_inductor)


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A second module over a copy of the graph, sharing parameters and buffers (no tensor is copied):
    compile_fx runs in-place pre-grad passes, and the plain variant must start from the original."""
    module = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    module.meta = dict(gm.meta)
    return module


def _has_symbolic_inputs(example_inputs: Sequence[Any]) -> bool:
    return any(
        isinstance(x, torch.SymInt)
        or (isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape))
        for x in example_inputs
    )
