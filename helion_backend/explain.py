"""``python -m helion_backend explain script.py [args...]`` (or ``explain pkg.module:function [args...]``): run a
script's compiles with the dumps on, then say what the backend did: each graph's report, why the GEMMs it did
not fuse were not, and where the dumps are.

A script runs in this process as ``__main__`` (its ``if __name__ == "__main__":`` block too); a
``module:function`` target imports the module (from the current folder too, as ``python -m`` would) and calls
the function with no arguments, as a console-script entry point is called (``sys.argv`` holds the arguments).
Either way ``$HELION_INDUCTOR_DEBUG_DIR`` points at the dump folder and Inductor's and AOTAutograd's caches are
off, so that every graph goes through the backend's passes (a cache hit skips them, and leaves no dump).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import runpy
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from .options import DEBUG_DIR_ENV
from .report import GraphReport, clear_reports, get_reports

DESCRIPTION = __doc__.split("\n\n", 1)[0]
# ``pkg.module:function`` (or ``:object.method``), as entry points name a callable; anything else is a script path.
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_CALLABLE_TARGET = re.compile(f"{_DOTTED}:{_DOTTED}")


class TargetError(Exception):
    """The target to explain cannot be run: no such script, a module that does not import, no such function."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug-dir", help="where the per-graph dumps go (default: a new temporary folder); "
                                            "before the script, as every argument after it is the script's")
    parser.add_argument("script", metavar="script.py|module:function",
                        help="the Python script, or the function of an importable module, whose torch.compile "
                             "calls to explain")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's (or function's sys.argv) own arguments")


def run_command(args: argparse.Namespace) -> int:
    """Run the target, print the explanation; the exit status is the target's (0 when it returns), 2 when it
    cannot be run."""
    debug_dir = Path(args.debug_dir or tempfile.mkdtemp(prefix="helion_inductor_explain_"))
    try:
        status = run_target(args.script, list(args.args), debug_dir)
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(explain(get_reports(), debug_dir))
    return status


def run_target(target: str, argv: list[str], debug_dir: Path) -> int:
    """Run ``target`` (a script path or ``module:function``) with ``argv`` and the dumps going to ``debug_dir``;
    its exit status. Raises :class:`TargetError` when there is nothing to run."""
    script = Path(target)
    if script.is_file() or not _CALLABLE_TARGET.fullmatch(target):
        if not script.is_file():
            raise TargetError(f"{script}: no such script (nor a module:function)")
        with _explaining([str(script), *argv], debug_dir, script.resolve().parent):
            return _exit_status(lambda: runpy.run_path(str(script), run_name="__main__"))
    module_name, _, attr = target.partition(":")
    with _explaining([target, *argv], debug_dir, Path.cwd()):
        function = _resolve(_import(module_name, target), attr, target)
        return _exit_status(function)


@contextlib.contextmanager
def _explaining(argv: list[str], debug_dir: Path, import_root: Path) -> Iterator[None]:
    """Fresh reports, ``sys.argv``, the dump folder, ``import_root`` first on ``sys.path`` and the compile caches
    off, for the duration; everything but the reports restored afterwards."""
    clear_reports()
    saved_argv, saved_env = sys.argv, os.environ.get(DEBUG_DIR_ENV)
    sys.argv, os.environ[DEBUG_DIR_ENV] = argv, str(debug_dir)
    sys.path.insert(0, str(import_root))
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        sys.argv = saved_argv
        sys.path.remove(str(import_root))
        if saved_env is None:
            os.environ.pop(DEBUG_DIR_ENV, None)
        else:
            os.environ[DEBUG_DIR_ENV] = saved_env


def _exit_status(run: Callable[[], object]) -> int:
    """Run ``run``; its ``SystemExit`` code, or the int it returns (as ``sys.exit(main())`` would), else 0."""
    try:
        result = run()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def _import(module_name: str, target: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing is not None and (module_name == missing or module_name.startswith(f"{missing}.")):
            raise TargetError(f"{target}: no module named {missing!r} (looked in {os.getcwd()} and sys.path)") from None
        traceback.print_exc()  # the module's own error, where it is
        raise TargetError(f"{target}: module {module_name!r} does not import: {type(e).__name__}: {e}") from None


def _resolve(module: ModuleType, attr: str, target: str) -> Callable[[], object]:
    """``module``'s attribute ``attr`` (dotted), which must be callable."""
    found: object = module
    for depth, part in enumerate(attr.split("."), 1):
        if not hasattr(found, part):
            path = getattr(module, "__file__", None)
            where = f"module {module.__name__!r}" + (f" ({path})" if path else "")
            raise TargetError(f"{target}: {where} has no function {'.'.join(attr.split('.')[:depth])!r}")
        found = getattr(found, part)
    if not callable(found):
        raise TargetError(f"{target}: {attr!r} of module {module.__name__!r} is a {type(found).__name__}, "
                          "not a function")
    return found


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
