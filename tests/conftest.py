import logging
import os
import tempfile

# Keep Inductor's and the backend's caches out of the user's home: one fresh folder per test run.
_CACHE_ROOT = tempfile.mkdtemp(prefix="helion_inductor_tests_")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "inductor"))
os.environ.setdefault("HELION_INDUCTOR_CACHE_DIR", os.path.join(_CACHE_ROOT, "backend"))

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Run the Helion kernels' generated Triton code on the CPU (tests/test_kernel_interpret.py); it
    # must be set before anything imports triton.language.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import helion_backend  # noqa: E402
from helion_backend.options import UNTUNED_HELION, UNTUNED_SITES_ENV  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the tests marked slow (long CPU runs)")


def _runs_slow(config) -> bool:
    """Slow tests run with --runslow, or when the -m expression names them (``-m slow``)."""
    return config.getoption("--runslow") or "slow" in (config.option.markexpr or "")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: run with --runslow or -m slow")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        elif "slow" in item.keywords and not _runs_slow(config):
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def backend_logs_reach_caplog():
    """The backend's loggers propagate to the root logger, where ``caplog`` listens: once torch's logging owns
    them (the ``helion_inductor`` TORCH_LOGS name, registered by the installed entry point or a ``set_logs``
    call), it stops their propagation, as it does for its own loggers."""
    backend_log = logging.getLogger("helion_backend")
    backend_log.propagate = True
    yield


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    helion_backend.clear_reports()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def untuned_sites_on_helion(request, monkeypatch):
    """GPU tests run the kernels at shapes no config table holds, which by default stay with Inductor: send
    them to Helion (option untuned_sites), unless a test checks the default placement (marker
    ``default_placement``)."""
    if request.node.get_closest_marker("gpu") and not request.node.get_closest_marker("default_placement"):
        monkeypatch.setenv(UNTUNED_SITES_ENV, UNTUNED_HELION)


@pytest.fixture(autouse=True)
def no_silent_fallback(request):
    """A GPU test fails where a Helion kernel fell back to the reference: the reference computes the same
    numbers, so a test that compares only numerics would pass on it (block fp8 at one row did)."""
    yield
    if request.node.get_closest_marker("gpu") is None or request.node.get_closest_marker("expects_fallback"):
        return
    fell_back = [(r.graph, s.anchor, s.fallbacks) for r in helion_backend.get_reports() for s in r.sites if s.fallbacks]
    fell_back += [(r.graph, a.node, a.fallbacks) for r in helion_backend.get_reports() for a in r.attention
                  if a.fallbacks]
    assert not fell_back, f"Helion kernels fell back to the reference: {fell_back}"


@pytest.fixture
def op_calls(monkeypatch):
    from helpers import OpCalls

    return OpCalls(monkeypatch)


@pytest.fixture
def no_compile_caches():
    """Inductor's and AOTAutograd's caches off, for tests whose patches the cache keys cannot see.

    Config ``patch`` contexts, not ``monkeypatch``: pytest >= 9.1 undoes a monkeypatched attribute that
    is not in the module's ``__dict__`` by deleting it, which hides a torch config entry for good.
    """
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
