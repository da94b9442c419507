"""The names of the ``helion_inductor`` backend in PyTorch's logging: ``TORCH_LOGS`` and its artifacts.

The backend itself is the package :mod:`helion_backend`. This module is separate and imports nothing at
the top, because PyTorch reads ``TORCH_LOGS`` while ``import torch`` runs, before any backend package can
be imported:

- torch versions that load ``torch.backends`` entry points before reading ``TORCH_LOGS`` (2.13) call
  :func:`register_torch_logs` through the entry point this project installs, so every name below is valid;
- older ones (2.11) accept ``helion_inductor`` because a module of that name exists (this one), and
  :mod:`helion_backend` applies the setting to its own loggers when it is imported; the artifact names
  are set there with ``torch._logging.set_logs(modules={"helion_inductor_graphs": True})``.
"""

from __future__ import annotations

LOG = "helion_inductor"
"""``TORCH_LOGS="helion_inductor"``: sites and why others did not fuse at INFO; ``+helion_inductor`` adds the
placement decisions and the report as JSON (DEBUG)."""
REPORT_ARTIFACT = "helion_inductor_report"
"""Each compiled graph's report as JSON (also on with ``+helion_inductor``)."""
GRAPHS_ARTIFACT = "helion_inductor_graphs"
"""Each compiled graph before and after the rewrite (large: only when named)."""
LOGGER_NAMES = ("helion_backend", LOG)
"""The Python loggers the ``helion_inductor`` setting controls."""

_ARTIFACTS = {
    REPORT_ARTIFACT: ("The helion_inductor backend's report of each compiled graph, as JSON", False),
    GRAPHS_ARTIFACT: ("Each graph the helion_inductor backend compiled, before and after its rewrite", True),
}


def register_torch_logs() -> None:
    """Register :data:`LOG` and the artifacts with ``torch._logging`` (again is harmless). Never raises: it
    runs inside ``import torch`` as an entry point, where an exception would fail the import."""
    try:
        from torch._logging import _internal
    except Exception:  # a torch without the logging registry: nothing to register
        return
    try:
        _internal.register_log(LOG, list(LOGGER_NAMES))
        for name, (description, off_by_default) in _ARTIFACTS.items():
            _internal.register_artifact(name, description, off_by_default=off_by_default)
    except Exception:
        return
