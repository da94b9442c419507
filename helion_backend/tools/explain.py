"""``python -m helion_backend explain script.py [args...]``: run a script's compiles with the dumps on, then
say what the backend did: each graph's report, why the GEMMs it did not fuse were not, and where the dumps are.

The script runs in this process as ``__main__`` (its ``if __name__ == "__main__":`` block too), with
``$HELION_INDUCTOR_DEBUG_DIR`` pointing at the dump folder and Inductor's and AOTAutograd's caches off, so that
every graph goes through the backend's passes (a cache hit skips them, and leaves no dump).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import tempfile
from pathlib import Path

import torch

from helion_backend.options import DEBUG_DIR_ENV
from helion_backend.report import GraphReport, clear_reports, get_reports

DESCRIPTION = __doc__.split("\n\n", 1)[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug-dir", help="where the per-graph dumps go (default: a new temporary folder); "
                                            "before the script, as every argument after it is the script's")
    parser.add_argument("script", help="the Python script whose torch.compile calls to explain")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run_command(args: argparse.Namespace) -> int:
    """Run the script, print the explanation; the exit status is the script's (0 when it returns)."""
    script = Path(args.script)
    if not script.is_file():
        print(f"error: {script}: no such script", file=sys.stderr)
        return 2
    debug_dir = Path(args.debug_dir or tempfile.mkdtemp(prefix="helion_inductor_explain_"))
    status = _run_script(script, list(args.args), debug_dir)
    print(explain(get_reports(), debug_dir))
    return status


def _run_script(script: Path, argv: list[str], debug_dir: Path) -> int:
    clear_reports()
    saved_argv, saved_env = sys.argv, os.environ.get(DEBUG_DIR_ENV)
    sys.argv, os.environ[DEBUG_DIR_ENV] = [str(script), *argv], str(debug_dir)
    sys.path.insert(0, str(script.resolve().parent))  # as `python script.py` would
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:  # the script's own exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved_argv
        sys.path.remove(str(script.resolve().parent))
        if saved_env is None:
            os.environ.pop(DEBUG_DIR_ENV, None)
        else:
            os.environ[DEBUG_DIR_ENV] = saved_env
    return 0


def explain(reports: list[GraphReport], debug_dir: Path) -> str:
    """The reports, the why-not list and the dump folders, as text."""
    if not reports:
        return ("helion_inductor explain: the script compiled no graph with backend='helion_inductor' "
                "(torch.compile(model, backend='helion_inductor') compiles at the first call)")
    lines = [f"helion_inductor explain: {len(reports)} graph(s)", ""]
    for report in reports:
        lines += [report.summary(), ""]
    why_not = _why_not(reports)
    lines.append(f"why not ({len(why_not)}):" if why_not else "why not: every GEMM site runs a Helion kernel")
    lines += [f"  {line}" for line in why_not]
    dumps = [debug_dir / r.graph for r in reports if (debug_dir / r.graph / "after.py").is_file()]
    lines += ["", f"dumps ({len(dumps)} graph(s), before.py / after.py / report.json / summary.txt each): {debug_dir}"]
    lines += [f"  {path}" for path in dumps]
    return "\n".join(lines)


def _why_not(reports: list[GraphReport]) -> list[str]:
    """One line per GEMM or attention node that does not run a Helion kernel, and why."""
    lines = []
    for r in reports:
        lines += [f"{r.graph} {s.label}: {s.runs_on}: {s.why}" for s in r.sites if s.runs_on != "helion"]
        lines += [f"{r.graph} {u.label}: not fused: {u.reason}" for u in r.unfused_gemms]
        lines += [f"{r.graph} {a.label}: attention: {a.runs_on}: {a.why}" for a in r.attention if a.runs_on != "helion"]
    return lines
