"""Import Helion without paying for scikit-learn in a process that only launches kernels.

``import helion`` imports scikit-learn (and with it scipy) for two surrogate-assisted searches of its
autotuner, ``LFBOPatternSearch`` and ``DESurrogateHybrid``: most of ``import helion``'s time, and the
largest part of the backend's first call over ``torch.compile``'s. Launching a compiled kernel never runs
a search. So the backend imports Helion with scikit-learn hidden (its import fails, which Helion handles),
then gives the two search modules back what their import would have bound, deferred: an estimator that
imports scikit-learn when a search first builds one. Autotuning, ours or a user's own Helion kernels', works as before and pays the
import when it first needs it.

The import runs on a thread of its own. Helion keeps the exception of a failed optional import, and an
exception's traceback holds every frame above it: imported from the caller's stack, that would keep the
caller's locals alive for good. The first fused op imports Helion inside the graph's first run, where, under
CUDA graph trees, those locals are tensors of the graph's memory pool that the trees then find untracked.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType

# Helion's modules that import a scikit-learn estimator at import time, and the estimator each binds.
SURROGATE_ESTIMATORS = {
    "helion.autotuner.surrogate_pattern_search": "RandomForestClassifier",
    "helion.autotuner.de_surrogate_hybrid": "RandomForestRegressor",
}


def import_helion() -> ModuleType:
    """``helion``, imported with scikit-learn deferred when this call is the first to import either."""
    if "helion" in sys.modules or "sklearn" in sys.modules:
        import helion

        return helion
    sys.modules["sklearn"] = None  # type: ignore[assignment]  # "import sklearn" now raises ImportError
    try:
        helion = _import_on_own_thread("helion")
    finally:
        if sys.modules.get("sklearn", 0) is None:
            del sys.modules["sklearn"]
    if importlib.util.find_spec("sklearn") is not None:
        _defer_estimators()
    return helion


def _import_on_own_thread(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with a stack of its own (see the module docstring); its error, if
    any, is raised here."""
    outcome: dict[str, ModuleType | BaseException] = {}

    def run() -> None:
        try:
            outcome["module"] = importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001  (re-raised on the caller's thread)
            outcome["error"] = error

    thread = threading.Thread(target=run, name=f"import {name}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["module"]  # type: ignore[return-value]


def _defer_estimators() -> None:
    """Bind what each surrogate module's failed import left unbound, so that its search runs as usual."""
    import numpy

    for module_name, estimator in SURROGATE_ESTIMATORS.items():
        module = sys.modules.get(module_name)
        if module is None or getattr(module, "HAS_ML_DEPS", True):
            continue  # not imported by this Helion, or it found scikit-learn after all
        module.np = numpy
        setattr(module, estimator, _deferred_estimator(estimator))
        module.HAS_ML_DEPS = True


def _deferred_estimator(name: str) -> Callable[..., object]:
    """A stand-in for ``sklearn.ensemble.<name>`` that imports scikit-learn when first called."""

    def build(*args: object, **kwargs: object) -> object:
        return getattr(importlib.import_module("sklearn.ensemble"), name)(*args, **kwargs)

    build.__name__ = build.__qualname__ = name
    return build


helion = import_helion()  # the package imports this module before any kernel module imports Helion
