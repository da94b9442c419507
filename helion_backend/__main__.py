"""Command line: ``python -m helion_backend check-rules PATH...``, ``... tune MANIFEST``, ``... bisect SCRIPT``
and ``... explain SCRIPT|MODULE:FUNCTION``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import bisect_sites, explain, tuning
from .rules import RuleError, builtin_rule_files, load_rules


def _check_rules(args: argparse.Namespace) -> int:
    builtin = args.with_builtin or not args.paths
    try:
        rules = load_rules([*(builtin_rule_files() if builtin else []), *args.paths])
    except RuleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for rule in rules:
        steps = ", ".join(map(str, rule.epilogue)) or "-"
        prologue = f"  prologue=[{', '.join(map(str, rule.prologue))}]" if rule.prologue else ""
        print(f"ok  {rule.source}  {rule.name}  priority={rule.priority}  anchor={sorted(rule.anchors)}"
              f"{prologue}  epilogue=[{steps}]  kernel={rule.kernel}")
    print(f"{len(rules)} rule(s) valid")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helion_backend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-rules", help="validate rule files without compiling anything")
    check.add_argument("paths", nargs="*", help="rule files (default: the shipped ones)")
    check.add_argument("--with-builtin", action="store_true",
                       help="load the shipped rules too, to catch name clashes with them")
    check.set_defaults(func=_check_rules)
    tune = sub.add_parser("tune", help="tune the Helion sites of a manifest (candidate sweep or Helion's autotuner) into a config table",
                          description=tuning.DESCRIPTION, epilog=tuning.EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    tuning.add_arguments(tune)
    tune.set_defaults(func=tuning.run_command)
    bisect = sub.add_parser("bisect", help="run a script with the self-check on and name the first fused site "
                            "whose output diverges from its reference", description=bisect_sites.DESCRIPTION,
                            epilog=bisect_sites.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    bisect_sites.add_arguments(bisect)
    bisect.set_defaults(func=bisect_sites.run_command)
    explained = sub.add_parser("explain", help="run a script's (or a function's) compiles with dumps on and explain what fused and "
                                               "what did not", description=explain.DESCRIPTION)
    explain.add_arguments(explained)
    explained.set_defaults(func=explain.run_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
