"""What the backend tells PyTorch's logging about each graph: ``TORCH_LOGS`` lines and ``TORCH_TRACE`` artifacts.

``TORCH_LOGS="helion_inductor"`` logs each graph's report (its sites and why the others did not fuse) at
INFO; ``+helion_inductor`` adds the placement decisions and the report as JSON (the ``helion_inductor_report``
artifact); ``helion_inductor_graphs`` logs the graph before and after the rewrite. With ``TORCH_TRACE`` set,
each compiled graph's report and both graphs are artifacts in the trace, which tlparse lists under the graph's
compile id. The names live in the top-level module :mod:`helion_inductor` (see there why).
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
from torch._logging import _internal

from helion_backend.report import GraphReport
from helion_inductor import GRAPHS_ARTIFACT, LOG, REPORT_ARTIFACT, register_torch_logs

# Structured-trace artifact names (tlparse shows them by name, per compile id).
TRACE_REPORT = REPORT_ARTIFACT
TRACE_BEFORE = "helion_inductor_graph_before"
TRACE_AFTER = "helion_inductor_graph_after"

log = logging.getLogger(__name__)


def setup() -> None:
    """Register the names, and apply a ``TORCH_LOGS`` that named them before they were known (torch read it at
    import: as a module name on torch versions that read it before loading entry points)."""
    register_torch_logs()
    settings = os.environ.get(_internal.LOG_ENV_VAR, "")
    named = {re.sub(r"^[+-]", "", name.strip()) for name in settings.split(",")}
    if named & {LOG, REPORT_ARTIFACT, GRAPHS_ARTIFACT}:
        _internal._parse_log_settings.cache_clear()
        _internal._init_logs()


setup()
report_log = torch._logging.getArtifactLogger(__name__, REPORT_ARTIFACT)
graphs_log = torch._logging.getArtifactLogger(__name__, GRAPHS_ARTIFACT)


def wants_graph_text() -> bool:
    """Whether anything will read the graphs' text: the graphs artifact or a structured trace."""
    return graphs_log.isEnabledFor(logging.DEBUG) or _structured_trace_on()


def _structured_trace_on() -> bool:
    handler = getattr(_internal, "LOG_TRACE_HANDLER", None)
    if handler is None:
        return bool(_internal.trace_log.handlers)
    return getattr(handler, "root_dir", "") is not None


def publish(report: GraphReport, before: str, after: str) -> None:
    """Log ``report`` (INFO: the summary; DEBUG: its JSON), the graphs where asked, and put all three in the
    structured trace. ``before`` and ``after`` are "" where :func:`wants_graph_text` said no one reads them."""
    log.info("%s", report.summary())
    report_log.debug("%s", _LazyJson(report))
    if before or after:
        graphs_log.debug("helion_inductor %s before the rewrite:\n%s", report.graph, before)
        graphs_log.debug("helion_inductor %s after the rewrite:\n%s", report.graph, after)
    torch._logging.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": TRACE_REPORT, "encoding": "json"},
        payload_fn=lambda: json.dumps(report.to_json()),
    )
    for name, text in ((TRACE_BEFORE, before), (TRACE_AFTER, after)):
        if text:
            torch._logging.trace_structured(
                "artifact",
                metadata_fn=lambda name=name: {"name": name, "encoding": "string"},
                payload_fn=lambda text=text: text,
            )


class _LazyJson:
    """The report's JSON, made only when a handler formats the record."""

    def __init__(self, report: GraphReport) -> None:
        self.report = report

    def __str__(self) -> str:
        return json.dumps(self.report.to_json())
