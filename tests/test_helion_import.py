"""The kernels import Helion without scikit-learn, and Helion's surrogate searches still get their estimators."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SURROGATES = """
import importlib
from helion_backend.kernels.helion_import import SURROGATE_ESTIMATORS
state = {"sklearn_after_import": "sklearn" in sys.modules}
modules = {name: importlib.import_module(name) for name in SURROGATE_ESTIMATORS}
state["has_ml_deps"] = {name: module.HAS_ML_DEPS for name, module in modules.items()}
built = {name: type(getattr(module, SURROGATE_ESTIMATORS[name])(n_estimators=2)).__module__
         for name, module in modules.items()}
state["estimator_modules"] = built
state["sklearn_after_build"] = "sklearn" in sys.modules
print(json.dumps(state))
"""


def _run(prelude: str) -> dict:
    code = f"import json, sys\n{prelude}\nimport helion_backend.kernels.gemm\n{SURROGATES}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kernels_import_helion_without_sklearn_and_searches_still_build_estimators():
    state = _run("")
    assert state["sklearn_after_import"] is False
    assert all(state["has_ml_deps"].values()), state
    assert all(module.startswith("sklearn.ensemble") for module in state["estimator_modules"].values()), state
    assert state["sklearn_after_build"] is True


CALLER_FRAMES = """
import gc, sys, weakref

class Activation:  # stands for a tensor the first fused op's caller holds (under CUDA graphs: in the pool)
    pass

def first_kernel_call():
    activation = Activation()
    import helion_backend.kernels.helion_import  # Helion's first import, as inside a graph's first run
    return weakref.ref(activation)

alive = first_kernel_call()
gc.collect()
print(json.dumps({"helion_imported": "helion" in sys.modules, "caller_local_alive": alive() is not None}))
"""


def test_helion_import_keeps_no_caller_frame_alive():
    """Helion keeps a failed optional import's exception; imported on the caller's stack, its traceback would
    keep the caller's locals (under CUDA graph trees, tensors of the graph's pool) alive after the call."""
    done = subprocess.run([sys.executable, "-c", f"import json\n{CALLER_FRAMES}"], capture_output=True, text=True,
                          check=True)
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state == {"helion_imported": True, "caller_local_alive": False}


@pytest.mark.slow
def test_sklearn_imported_first_leaves_helion_import_alone():
    state = _run("import sklearn.ensemble")
    assert state["sklearn_after_import"] is True
    assert all(state["has_ml_deps"].values()), state
    assert all(module.startswith("sklearn.ensemble") for module in state["estimator_modules"].values()), state


@pytest.mark.slow
def test_helion_imported_first_is_not_imported_again():
    state = _run("import helion")
    assert state["sklearn_after_import"] is True  # Helion's own import brought it
    assert all(state["has_ml_deps"].values()), state
