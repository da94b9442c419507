"""The backend in PyTorch's logging: ``TORCH_LOGS="helion_inductor"`` and its artifacts, ``TORCH_TRACE``.

Each test runs a compile in a fresh interpreter, as a user would: PyTorch reads ``TORCH_LOGS`` while it
imports."""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import compile_run

import helion_inductor

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    import helion_backend

    if sys.argv[1:] == ["set_logs"]:
        torch._logging.set_logs(modules={"helion_inductor": logging.INFO, "helion_inductor_graphs": True})

    class Up(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(32, 48)

        def forward(self, x):
            return torch.relu(self.proj(x))

    with torch.no_grad():
        torch.compile(Up(), backend="helion_inductor", options={"rewrite_on_cpu": True})(torch.randn(4, 32))
""")


def run_compile(tmp_path: Path, *args: str, **env: str) -> str:
    """Run the script's compile in a new interpreter with ``env`` added; its stderr (where logs go)."""
    script = tmp_path / "compile_one.py"
    script.write_text(SCRIPT)
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_LOGS", "TORCH_TRACE", "PYTHONPATH")}
    paths = [env.pop("PYTHONPATH", ""), str(REPO)]
    run_env = {**base, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
               "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend"), **env}
    done = subprocess.run([sys.executable, str(script), *args], env=run_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_torch_logs_debug_shows_sites_placement_and_report_and_torch_trace_gets_the_artifacts(tmp_path):
    trace_dir = tmp_path / "trace"
    err = run_compile(tmp_path, TORCH_LOGS="+helion_inductor", TORCH_TRACE=str(trace_dir))
    # INFO: the report, naming the module; DEBUG: each placement decision and the report as JSON.
    assert re.search(r"graph graph_\d+ \(inference\): 1 site\(s\) \(1 reference\), 0 unfused GEMM\(s\)", err), err
    assert "[gemm_activation] proj (addmm, compile_one.py:" in err
    assert "placement: proj m=4 k=32 n=48 float32 (rule gemm_activation, kernel gemm): reference up to M=32" in err
    (report_line,) = [line for line in err.splitlines() if "[__helion_inductor_report]" in line]
    report = json.loads(report_line.split("[__helion_inductor_report] ", 1)[1])
    assert [(s["module"], s["runs_on"]) for s in report["sites"]] == [("proj", "reference")]
    assert "__helion_inductor_graphs" not in err  # large: only when named

    (trace,) = trace_dir.glob("*.log")
    artifacts = _trace_artifacts(trace.read_text())
    assert set(artifacts) == {"helion_inductor_report", "helion_inductor_graph_before", "helion_inductor_graph_after"}
    assert all(meta.get("frame_id") == 0 for meta, _ in artifacts.values())  # tied to the compiled frame
    assert json.loads(artifacts["helion_inductor_report"][1])["sites"][0]["module"] == "proj"
    assert "aten.addmm.default" in artifacts["helion_inductor_graph_before"][1]
    after = artifacts["helion_inductor_graph_after"][1]
    assert "helion_inductor.gemm_epilogue" in after and "aten.addmm" not in after

    tlparse = shutil.which("tlparse")
    if tlparse is None:
        return  # the optional viewer is not installed; the trace records above are what it reads
    out = tmp_path / "tlparse"
    subprocess.run([tlparse, str(trace), "-o", str(out), "--no-browser"], check=True, capture_output=True)
    index = (out / "index.html").read_text()
    for name in artifacts:
        assert re.search(rf"{name}_\d+\.(json|txt)", index), name


@pytest.mark.skipif("TORCH_LOGS" in os.environ, reason="set_logs does nothing while TORCH_LOGS is set")
def test_set_logs_names_the_graphs_artifact_on_every_torch():
    """``torch._logging.set_logs`` reaches the names on every torch (2.11 reads ``TORCH_LOGS`` before any plugin
    can name them)."""
    records = _Records()
    backend_log = logging.getLogger("helion_backend")
    torch._logging.set_logs(modules={"helion_inductor": logging.INFO, "helion_inductor_graphs": True})
    backend_log.addHandler(records)
    try:
        with torch.no_grad():
            compile_run(torch.nn.Linear(32, 48).eval(), torch.randn(4, 32))
    finally:
        backend_log.removeHandler(records)
        torch._logging.set_logs()
    assert any(re.match(r"graph graph_\d+ \(inference\): 1 site\(s\) \(1 reference\)", m) for m in records.messages)
    assert any(re.match(r"helion_inductor graph_\d+ after the rewrite:\n.*gemm_epilogue", m, re.S)
               for m in records.messages)
    assert not any(m.startswith("placement:") for m in records.messages)  # INFO only


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _reads_torch_logs_after_loading_entry_points() -> bool:
    source = inspect.getsource(torch)
    autoload, init_logs = source.rfind("\n    _import_device_backends()"), source.rfind("\n_logging._init_logs()")
    return 0 <= autoload < init_logs


@pytest.mark.slow
@pytest.mark.skipif(not _reads_torch_logs_after_loading_entry_points(),
                    reason="this torch reads TORCH_LOGS before loading plugins: artifacts are named with set_logs")
def test_torch_logs_names_the_artifacts_through_the_entry_point(tmp_path):
    """What ``pip install`` provides: the ``torch.backends`` entry point registers the names before
    ``import torch`` reads ``TORCH_LOGS`` (a distribution made here declares it as setup.cfg does)."""
    dist = tmp_path / "site" / "helion_inductor_logs_probe-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: helion-inductor-logs-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        f"[torch.backends]\nhelion_inductor = helion_inductor:{helion_inductor.register_torch_logs.__name__}\n")
    err = run_compile(tmp_path, TORCH_LOGS="helion_inductor_graphs", PYTHONPATH=str(tmp_path / "site"))
    assert "[__helion_inductor_graphs] helion_inductor graph_000 after the rewrite:" in err
    assert not re.search(r"\] graph graph_000 \(inference\)", err)  # the report's INFO lines are not asked for


def _trace_artifacts(trace: str) -> dict[str, tuple[dict, str]]:
    """The trace's helion_inductor artifacts: name -> (record, payload). A record is one JSON line after the
    log prefix; its payload follows on lines that start with a tab."""
    found: dict[str, tuple[dict, str]] = {}
    lines = trace.splitlines()
    for i, line in enumerate(lines):
        start = line.find("{")
        if '"artifact"' not in line or start < 0:
            continue
        record = json.loads(line[start:])
        name = record["artifact"]["name"]
        if name.startswith("helion_inductor"):
            payload = []
            for more in lines[i + 1:]:
                if not more.startswith("\t"):
                    break
                payload.append(more[1:])
            found[name] = (record, "\n".join(payload))
    return found
