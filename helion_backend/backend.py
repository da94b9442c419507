"""The ``helion_inductor`` backend: Inductor's ``compile_fx`` with the pass manager installed.

Everything not fused is compiled by Inductor exactly as ``torch.compile`` would; the backend only adds
its post-grad pass, CUDA graphs on by default for graphs on CUDA devices, and the report. With the option
``autotune_missing``, the compiled graph autotunes the Helion keys it needs that no config table holds, once,
before it first runs (:class:`AutotuneBeforeFirstRun`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

from . import BACKEND_NAME, code_cache, dispatch
from . import report as reports
from .manifest import ManifestSite
from .options import BackendOptions
from .passes.manager import HelionPassManager
from .token_routing import TokenRouter, make_token_counter

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
    patches = _inductor_config(mode, opts, example_inputs)
    pristine = _copy_graph_module(gm) if _has_symbolic_inputs(example_inputs) else None

    compiled = _compile(gm, example_inputs, manager, patches)
    state = _saved_state(manager, gm, example_inputs, opts)
    if state is None:
        # Inductor's cache knew this graph but the backend's did not (deleted, say): compile it once
        # more with the caches off, so the pipeline runs and its report and routing are not lost.
        log.info("helion_inductor: recompiling a graph served from Inductor's cache without its report")
        with torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = _compile(gm, example_inputs, manager, {**patches, "fx_graph_cache": False})
        state = _saved_state(manager, gm, example_inputs, opts)
    routed = _route_tokens(compiled, pristine, state, example_inputs, patches)
    return _with_autotuning(routed, state, opts, example_inputs)


def _route_tokens(compiled: Callable[..., Any], pristine: torch.fx.GraphModule | None, state: dict[str, Any] | None,
                  example_inputs: Sequence[Any], patches: dict[str, Any]) -> Callable[..., Any]:
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
    plain = compile_fx(pristine, example_inputs, config_patches=plain_patches)
    return TokenRouter(small=compiled, large=plain, site_ms=site_ms, limits=[limit for _, limit in dynamic_sites])


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
    if dispatch.helion_unavailable_reason() is not None:
        return None
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda), None)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
        if self._pending and not _capturing():
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
        from . import tuning  # imports Helion: only where a key may need tuning

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
             patches: dict[str, Any]) -> Callable[..., Any]:
    def inner_compile(gm: torch.fx.GraphModule, inputs: Sequence[Any], **kwargs: Any):
        manager.graph_kind = (
            "backward" if kwargs.get("is_backward") else
            "inference" if kwargs.get("is_inference") else "forward"
        )
        return compile_fx_inner(gm, inputs, **kwargs)

    return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                      config_patches={**patches, "post_grad_custom_pre_pass": manager})


def _inductor_config(mode: str | None, opts: BackendOptions, example_inputs: Sequence[Any]) -> dict[str, Any]:
    mode = mode or "default"
    if mode not in _MODES:
        raise ValueError(f"helion_inductor: unknown mode {mode!r}; valid modes are {list(_MODES)}")
    patches: dict[str, Any] = dict(torch._inductor.list_mode_options(mode) or {})
    on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)
    cudagraphs = opts.cudagraphs
    if cudagraphs is None:
        cudagraphs = on_cuda and mode != "max-autotune-no-cudagraphs"
    patches["triton.cudagraphs"] = bool(cudagraphs)
    patches.update(opts.inductor_config)
    return patches


def _saved_state(manager: HelionPassManager, gm: torch.fx.GraphModule,
                 example_inputs: Sequence[Any], opts: BackendOptions) -> dict[str, Any] | None:
    """Keep what the pipeline learned beside Inductor's caches, and replay it on a cache hit.

    A hit in Inductor's FX graph cache or AOTAutograd's cache skips the post-grad passes, so the
    pipeline never sees the graph; what it saved when it did (the reports, the symbolic M of the
    rewritten sites, as strings, and each graph's Helion sites, for ``autotune_missing``) is served
    instead. ``graphs`` pairs each report with its sites. None when there is nothing to serve.
    """
    path = Path(opts.cache_dir) / "reports" / f"{_graph_key(manager, gm, example_inputs)}.json"
    if manager.reports:
        state = {"reports": [r.to_json() for r in manager.reports],
                 "dynamic_sites": [[str(expr), limit] for expr, limit in manager.dynamic_sites],
                 "helion_sites": [[site.to_json() for site in sites] for sites in manager.helion_sites]}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(state))
        except OSError as e:
            log.warning("helion_inductor: cannot save the report to %s: %s", path, e)
        return {**state, "graphs": list(zip(manager.reports, manager.helion_sites))}
    try:
        state = json.loads(path.read_text())
        served = [reports.GraphReport.from_json(entry) for entry in state["reports"]]
        state["dynamic_sites"] = [(str(expr), int(limit)) for expr, limit in state["dynamic_sites"]]
        # Saved before compile-time autotuning existed: no sites, nothing to tune.
        saved_sites = state.get("helion_sites") or [[] for _ in served]
        state["graphs"] = list(zip(served, [[ManifestSite.from_json(s) for s in sites] for sites in saved_sites]))
    except OSError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        log.warning("helion_inductor: ignoring the corrupt saved report %s (%s)", path, e)
        return None
    for report in served:
        report.from_cache = True
        report.picture = None  # the pipeline drew nothing this time: the picture is in the filling compile's dumps
        reports.record(report)
    return state


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
