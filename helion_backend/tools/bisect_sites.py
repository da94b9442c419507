"""``python -m helion_backend bisect SCRIPT [ARGS...]``: which fused site changes a model's output.

Runs the script in this process, as ``python SCRIPT ARGS...`` would, with the option ``verify`` on
($HELION_INDUCTOR_VERIFY=1, the option's default), so that every fused site's first Helion run at each M is compared with its
unfused reference (:mod:`helion_backend.runtime.verify`). Then it names the first site that diverged, in the order
the checks ran: the earliest in the model, since a diverging site returns its reference's result and the
sites after it read correct inputs.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import Sequence

from helion_backend import report
from helion_backend.options import VERIFY_ENV
from helion_backend.report import SiteReport
from helion_backend.runtime import verify

HEADER = "helion_inductor bisect:"
DESCRIPTION = """\
Run SCRIPT (as `python SCRIPT ARGS...` would) with the backend's self-check on: every fused site's first
Helion run at each M is compared with its unfused reference. Then print the first site whose output diverged
(graph, anchor, module, rule, kernel, shapes, the error and the tolerance), or that none did. Each diverging
site runs its reference from then on, so the sites after it read correct inputs: the first one named is
the one to look at, and the model's output was the unfused model's."""
EPILOG = """\
exit status: 1 when a site diverged, else the script's own (0 when it ran to the end).
The script's own options win: one that passes options={"verify": False} is not checked."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", help="the Python script that runs the compiled model")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def run_command(args: argparse.Namespace) -> int:
    os.environ[VERIFY_ENV] = "1"
    status = run_script(Path(args.script), args.args)
    checks = verify.checks()
    print(summary(checks), flush=True)
    return 1 if any(not check.ok for check in checks) else status


def run_script(script: Path, args: Sequence[str]) -> int:
    """Run ``script`` as ``__main__`` with ``args`` as its ``sys.argv[1:]``; its exit status (1 where it
    raised, after printing the traceback)."""
    if not script.is_file():
        print(f"{HEADER} no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        return 1
    return 0


def summary(checks: Sequence[verify.Check]) -> str:
    """What the checks found: the first diverging site and what it is, or that none diverged."""
    diverged = [check for check in checks if not check.ok]
    sites = {check.site for check in checks}
    if not checks:
        return (f"{HEADER} no fused site ran a Helion kernel, so none was checked (on the CPU the sites run "
                "their reference; a compile with options={'verify': False} is not checked)")
    if not diverged:
        return (f"{HEADER} no fused site diverged from its reference ({len(checks)} check(s) of "
                f"{len(sites)} site(s))")
    first = diverged[0]
    lines = [f"{HEADER} the first fused site whose output diverges from its reference is {first.site}",
             *(f"  {line}" for line in describe(first)),
             "  From that run on the site ran its reference, so the script's output was the unfused model's;",
             "  options={'verify': True} keeps a model correct so until the kernel is fixed."]
    others = sorted({check.site for check in diverged[1:]} - {first.site})
    if others:
        lines.append(f"  {len(others)} other site(s) diverged too: {', '.join(others)}")
    lines.append(f"  ({len(checks)} check(s) of {len(sites)} site(s) in all)")
    return "\n".join(lines)


def describe(check: verify.Check) -> list[str]:
    """The site of ``check`` as its report has it: graph, anchor, module, rule, kernel and shape."""
    graph, _, anchor = check.site.partition(":")
    outcome = f"at M={check.m}: rel. error {check.error:.2e} > tolerance {check.tolerance:.1e}"
    entry = report.find_site(check.site)
    if entry is None:
        return [f"graph {graph}, anchor {anchor} (its report is not held)", outcome]
    module = f", module {entry.module}" if entry.module else ""
    if isinstance(entry, SiteReport):
        chain = " -> ".join([*entry.prologue, entry.anchor_op.split(".")[1], *entry.epilogue])
        return [f"graph {graph}, anchor {anchor} ({entry.anchor_op}){module}",
                f"rule {entry.rule}, kernel {entry.kernel}: {chain}",
                f"m={entry.m} k={entry.k} n={entry.n} {entry.dtype}; {outcome}"]
    return [f"graph {graph}, attention node {anchor} ({entry.op}){module}",
            f"kernel decode_attention: B={entry.batch} H={entry.heads} H_kv={entry.kv_heads} rows={entry.rows} "
            f"L={entry.kv_len} D={entry.head_dim} {entry.dtype} mask={entry.mask}",
            outcome]
