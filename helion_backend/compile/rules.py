"""Declarative fusion rules: TOML files in ``rules/`` that users copy and edit.

A file holds ``[[rule]]`` tables::

    [[rule]]
    name = "gemm_activation"
    anchor = ["mm", "addmm", "linear"]
    epilogue = ["bias?", "gelu|gelu_tanh|silu|relu|sigmoid", "scale?", "residual?", "cast?"]
    dtypes = ["bfloat16", "float16"]
    where = ["k % 8 == 0"]
    priority = 30

``epilogue`` is an ordered list of step patterns: alternatives joined by ``|``, then ``?`` (optional)
or ``*`` (any number). A site takes the longest run of recognized steps the pattern accepts. ``where``
constraints are expressions over ``m``, ``k``, ``n``; they are parsed into a small AST and
interpreted, never evaluated as Python. Loading uses :mod:`tomllib`, which cannot run code.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import re
import reprlib
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from helion_backend.vocabulary import (
    CONSTRAINT_NAMES,
    DEFAULT_KERNEL_FAMILY,
    EPILOGUE_STEPS,
    KERNEL_FAMILIES,
    PROLOGUE_STEPS,
    RULE_DTYPES,
    Anchor,
)

# Package data (a link to the checkout's top-level ``rules/`` folder, copied into wheels and sdists), found
# through the package so an installed wheel has it; resolved so a checkout's messages name ``rules/``.
BUILTIN_RULES_DIR = (Path(__file__).parents[1] / "builtin_rules").resolve()

_KEYS = {
    "name": "rule name, unique across all loaded files",
    "description": "free text",
    "anchor": "list of GEMM forms",
    "prologue": "list of prologue step patterns",
    "epilogue": "list of epilogue step patterns",
    "dtypes": "list of input dtypes",
    "where": "list of constraint expressions over m, k, n",
    "priority": "integer; higher wins",
    "kernel": "kernel family",
}
_MAX_FILE_BYTES = 1 << 20
_MAX_LIST_ENTRIES = 32  # per list key (anchor, epilogue, where, ...)
_MAX_CONSTRAINT_CHARS = 200
_MAX_CONSTANT = 1 << 40


class _Quote(reprlib.Repr):
    """Values quoted in messages: bounded in length and depth (a value nested thousands deep has no
    repr), and no decimal conversion of huge integers (int() refuses more than 4300 digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 80

    def repr_int(self, x: int, level: int) -> str:
        return super().repr_int(x, level) if x.bit_length() <= 256 else f"<an integer of {x.bit_length()} bits>"


_QUOTE = _Quote()


class RuleError(ValueError):
    """A rule file is wrong; the message starts with ``path:line:`` (line 0: the file as a whole)."""


@dataclass(frozen=True)
class StepPattern:
    choices: frozenset[str]
    optional: bool
    repeat: bool

    def __str__(self) -> str:
        return "|".join(sorted(self.choices)) + ("*" if self.repeat else "?" if self.optional else "")


@dataclass(frozen=True)
class Constraint:
    text: str
    tree: ast.Expression

    def holds(self, values: dict[str, int | None]) -> bool | None:
        """True/False, or None when it reads a value that is not static (a dynamic ``m``)."""
        try:
            return bool(_interpret(self.tree.body, values))
        except _Unknown:
            return None


@dataclass(frozen=True)
class Rule:
    name: str
    source: str  # "path:line" of the rule's table
    anchors: frozenset[str]
    prologue: tuple[StepPattern, ...]
    epilogue: tuple[StepPattern, ...]
    dtypes: frozenset[torch.dtype]
    where: tuple[Constraint, ...]
    priority: int
    kernel: str
    description: str = ""

    def accepted_prefix(self, steps: Sequence[str]) -> int | None:
        """Length of the longest prefix of ``steps`` the epilogue pattern accepts, or None."""
        return _longest_accepted_prefix(self.epilogue, steps)

    def accepts_prologue(self, steps: Sequence[str]) -> bool:
        """Whether the prologue pattern accepts exactly ``steps`` (a site's prologue is never cut)."""
        return _longest_accepted_prefix(self.prologue, steps) == len(steps)


# --------------------------------------------------------------------------------------------------
# Loading


def builtin_rule_files() -> list[Path]:
    if not BUILTIN_RULES_DIR.is_dir():
        raise RuleError(
            f"{BUILTIN_RULES_DIR}: the shipped rules folder is missing from the installed package; "
            "reinstall helion-inductor, or pass options={'builtin_rules': False}"
        )
    return sorted(BUILTIN_RULES_DIR.glob("*.toml"))


def load_rules(paths: Iterable[str | Path]) -> list[Rule]:
    """Parse and validate every file; names must be unique across them. Raises :class:`RuleError`."""
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for path in paths:
        for rule in load_rule_file(path):
            if rule.name in seen:
                raise RuleError(
                    f"{rule.source}: rule name {rule.name!r} is already defined at {seen[rule.name]}"
                )
            seen[rule.name] = rule.source
            rules.append(rule)
    return rules


def load_rule_file(path: str | Path) -> list[Rule]:
    """Parse one file. Only a regular file of at most 1 MiB of UTF-8 is read: a FIFO or a device would
    block or never end, and a huge file would only exhaust memory."""
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise RuleError(f"{path}:0: not a regular file")
        with path.open("rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as e:
        raise RuleError(f"{path}:0: cannot read rule file: {e.strerror}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise RuleError(f"{path}:0: rule file is larger than {_MAX_FILE_BYTES} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise RuleError(f"{path}:{line}: not UTF-8 text: {e.reason}") from None
    return _parse_text(text, str(path))


def rules_digest(paths: Iterable[str | Path]) -> str:
    """Content hash of rule files, for the FX graph cache key."""
    h = hashlib.sha256()
    for path in paths:
        h.update(str(path).encode())
        h.update(Path(path).read_bytes())
    return h.hexdigest()


def _parse_text(text: str, path: str) -> list[Rule]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = re.search(r"line (\d+)", str(e))
        where = line.group(1) if line else max(1, len(text.splitlines()))
        raise RuleError(f"{path}:{where}: invalid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise RuleError(f"{path}:{_deepest_line(text)}: invalid TOML: values nested too deeply") from None
    except ValueError as e:  # int() refuses an integer literal of more than 4300 digits
        digits = re.search(r"[0-9A-Fa-f_]{4000,}", text)
        line = text.count("\n", 0, digits.start()) + 1 if digits else 1
        raise RuleError(f"{path}:{line}: invalid TOML: {e}") from None
    locate = _Locator(text, path)
    extra = sorted(set(doc) - {"rule"})
    if extra:
        raise RuleError(
            f"{locate.top(extra[0])}: unknown top-level key {_QUOTE.repr(extra[0])}; a file holds [[rule]] tables"
        )
    tables = doc.get("rule", [])
    if not isinstance(tables, list) or not tables:
        raise RuleError(f"{path}:1: no [[rule]] tables in the file")
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise RuleError(f"{locate.key(i, None)}: rule #{i + 1} must be a table, got {_QUOTE.repr(table)}")
    return [_parse_rule(table, i, locate) for i, table in enumerate(tables)]


def _deepest_line(text: str) -> int:
    """The line where brackets nest deepest (strings are not told apart: this only names a line)."""
    depth, deepest, line = 0, 0, 1
    for number, content in enumerate(text.splitlines(), 1):
        for char in content:
            depth += char in "[{"
            depth -= char in "]}"
            if depth > deepest:
                deepest, line = depth, number
    return line


def _parse_rule(table: dict[str, Any], index: int, locate: _Locator) -> Rule:
    def fail(key: str | None, message: str) -> RuleError:
        return RuleError(f"{locate.key(index, key)}: rule #{index + 1}: {message}")

    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise fail(unknown[0], f"unknown key {_QUOTE.repr(unknown[0])}; valid keys are {sorted(_KEYS)}")
    for required in ("name", "anchor"):
        if required not in table:
            raise fail(None, f"missing required key {required!r}")

    name = _typed(table, "name", str, fail)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
        raise fail("name", f"name {name!r} must be an identifier of at most 64 characters")
    anchors = _string_list(table, "anchor", fail)
    valid_anchors = sorted(a.value for a in Anchor)
    for a in anchors:
        if a not in valid_anchors:
            raise fail("anchor", f"unknown anchor {a!r}; valid anchors are {valid_anchors}")
    if not anchors:
        raise fail("anchor", "anchor list is empty")


    kernel = _typed(table, "kernel", str, fail) if "kernel" in table else DEFAULT_KERNEL_FAMILY
    if kernel not in KERNEL_FAMILIES:
        raise fail("kernel", f"unknown kernel family {kernel!r}; valid families are {list(KERNEL_FAMILIES)}")
    family = KERNEL_FAMILIES[kernel]
    dtype_names = _string_list(table, "dtypes", fail) if "dtypes" in table else list(family.dtypes)
    for d in dtype_names:
        if d not in RULE_DTYPES:
            raise fail("dtypes", f"unsupported dtype {d!r}; valid dtypes are {sorted(RULE_DTYPES)}")
    wrong_dtypes = [d for d in dtype_names if d not in family.dtypes]
    if wrong_dtypes:
        raise fail("dtypes", f"kernel family {kernel!r} multiplies {list(family.dtypes)}, not {wrong_dtypes}")
    prologue = _patterns(table, "prologue", PROLOGUE_STEPS, fail)
    wrong_steps = sorted({c for p in prologue for c in p.choices} - set(family.prologue))
    if wrong_steps:
        raise fail("prologue", f"kernel family {kernel!r} runs prologue steps {list(family.prologue) or 'none'}, "
                               f"not {wrong_steps}")
    epilogue = _patterns(table, "epilogue", EPILOGUE_STEPS, fail)
    foreign = sorted(c for p in epilogue for c in p.choices if EPILOGUE_STEPS[c].only_in
                     and kernel not in EPILOGUE_STEPS[c].only_in)
    if foreign:
        families = ", ".join(EPILOGUE_STEPS[foreign[0]].only_in)
        raise fail("epilogue", f"step {foreign[0]!r} needs a kernel of {families}")
    for needed in family.needs_steps:
        if not any(p.choices == {needed} and not (p.optional or p.repeat) for p in epilogue):
            raise fail("epilogue", f"kernel family {kernel!r} needs a required {needed!r} step in the epilogue")
    priority = _typed(table, "priority", int, fail) if "priority" in table else 0
    if abs(priority) > 1_000_000:
        raise fail("priority", f"priority {_QUOTE.repr(priority)} is out of range (|priority| <= 1000000)")

    return Rule(
        name=name,
        source=locate.key(index, None),
        anchors=frozenset(anchors),
        prologue=prologue,
        epilogue=epilogue,
        dtypes=frozenset(RULE_DTYPES[d] for d in dtype_names),
        where=_constraints(_string_list(table, "where", fail), fail),
        priority=priority,
        kernel=kernel,
        description=_typed(table, "description", str, fail) if "description" in table else "",
    )


def _typed(table: dict[str, Any], key: str, typ: type, fail) -> Any:
    value = table[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise fail(key, f"{key!r} must be a {typ.__name__}, got {_QUOTE.repr(value)}")
    return value


def _string_list(table: dict[str, Any], key: str, fail) -> list[str]:
    value = table.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(key, f"{key!r} must be a list of strings, got {_QUOTE.repr(value)}")
    if len(value) > _MAX_LIST_ENTRIES:
        raise fail(key, f"{key!r} has {len(value)} entries; at most {_MAX_LIST_ENTRIES} are allowed")
    return value


def _patterns(table: dict[str, Any], key: str, vocabulary: dict, fail) -> tuple[StepPattern, ...]:
    patterns = []
    for text in _string_list(table, key, fail):
        # Split by hand, not with a regular expression: one whose parts all match whitespace takes cubic
        # time to reject a long run of spaces.
        body = text.strip()
        suffix = body[-1:] if body.endswith(("?", "*")) else ""
        names = [c.strip() for c in body[: len(body) - len(suffix)].split("|")]
        if not all(re.fullmatch(r"[A-Za-z0-9_]+", c) for c in names):
            raise fail(key, f"cannot parse step pattern {_QUOTE.repr(text)}; write e.g. 'bias?' or 'gelu|silu'")
        unknown = sorted(c for c in names if c not in vocabulary)
        if unknown:
            valid = sorted(vocabulary) or "none yet"
            quoted = _QUOTE.repr(text)
            raise fail(key, f"unknown {key} step {_QUOTE.repr(unknown[0])} in {quoted}; valid steps are {valid}")
        patterns.append(StepPattern(frozenset(names), optional=suffix == "?", repeat=suffix == "*"))
    return tuple(patterns)


# --------------------------------------------------------------------------------------------------
# Epilogue patterns: a tiny NFA over step names (each pattern entry is one state).


def _closure(patterns: Sequence[StepPattern], states: set[int]) -> set[int]:
    out, todo = set(states), list(states)
    while todo:
        i = todo.pop()
        if i < len(patterns) and (patterns[i].optional or patterns[i].repeat) and i + 1 not in out:
            out.add(i + 1)
            todo.append(i + 1)
    return out


def _longest_accepted_prefix(patterns: Sequence[StepPattern], steps: Sequence[str]) -> int | None:
    states = _closure(patterns, {0})
    best = 0 if len(patterns) in states else None
    for length, step in enumerate(steps, start=1):
        moved = set()
        for i in states:
            if i < len(patterns) and step in patterns[i].choices:
                moved.add(i if patterns[i].repeat else i + 1)
        states = _closure(patterns, moved)
        if not states:
            break
        if len(patterns) in states:
            best = length
    return best


# --------------------------------------------------------------------------------------------------
# Constraints: parsed with ast, checked against a whitelist, interpreted by hand.

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
           ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


class _Unknown(Exception):
    pass


def _constraints(texts: list[str], fail) -> tuple[Constraint, ...]:
    """The rule's ``where`` list, refused where it can never hold: a rule that silently matches nothing is a
    mistake its author wants to hear about."""
    constraints = tuple(_constraint(t, fail) for t in texts)
    for constraint in constraints:
        problem = _never_holds(constraint.tree.body)
        if problem:
            raise fail("where", f"constraint {constraint.text!r} can never hold: {problem}")
    clash = _contradicting_bounds([c.tree.body for c in constraints])
    if clash:
        raise fail("where", f"constraints can never all hold: {clash}")
    return constraints


def _constraint(text: str, fail) -> Constraint:
    if len(text) > _MAX_CONSTRAINT_CHARS:
        raise fail("where", f"constraint is longer than {_MAX_CONSTRAINT_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise fail("where", f"cannot parse constraint {text!r}: {e.msg}") from None
    for node in ast.walk(tree):
        problem = _forbidden(node)
        if problem:
            raise fail("where", f"constraint {text!r}: {problem}")
    return Constraint(text, tree)


def _forbidden(node: ast.AST) -> str | None:
    allowed = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
               ast.BinOp, ast.Compare, ast.Name, ast.Load, ast.Constant,
               *_BINOPS, *_CMPOPS)
    if not isinstance(node, allowed):
        return f"{type(node).__name__} is not allowed (use integers, m/k/n, + - * // %, comparisons, and/or/not)"
    if isinstance(node, ast.Name) and node.id not in CONSTRAINT_NAMES:
        return f"unknown name {node.id!r}; constraints may use {list(CONSTRAINT_NAMES)}"
    if isinstance(node, ast.Constant) and (
        type(node.value) is not int or abs(node.value) > _MAX_CONSTANT
    ):
        return f"constant {node.value!r} must be an integer with |value| <= 2**40"
    return None


def _interpret(node: ast.AST, values: dict[str, int | None]) -> int | bool:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        value = values.get(node.id)
        if value is None:
            raise _Unknown(node.id)
        return value
    if isinstance(node, ast.BoolOp):
        results = [_interpret(v, values) for v in node.values]
        return all(results) if isinstance(node.op, ast.And) else any(results)
    if isinstance(node, ast.UnaryOp):
        value = _interpret(node.operand, values)
        return (not value) if isinstance(node.op, ast.Not) else -value
    if isinstance(node, ast.BinOp):
        left, right = _interpret(node.left, values), _interpret(node.right, values)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            return False
        return _BINOPS[type(node.op)](left, right)
    assert isinstance(node, ast.Compare)
    left = _interpret(node.left, values)
    for op, comparator in zip(node.ops, node.comparators):
        right = _interpret(comparator, values)
        if not _CMPOPS[type(op)](left, right):
            return False
        left = right
    return True


# --------------------------------------------------------------------------------------------------
# Constraints that can never hold: interval arithmetic over m, k, n (sizes, so >= 0), and the bounds that
# comparisons with constants put on each name. Sound, not complete: what it refuses is never true.

_INF = float("inf")
_SIZE = (0, _INF)
_FALSE, _TRUE, _EITHER = (0, 0), (1, 1), (0, 1)


class _DividesByZero(Exception):
    pass


def _never_holds(node: ast.AST) -> str | None:
    """Why the constraint rooted at ``node`` is false for every m, k, n, if it is provably so."""
    try:
        value = _range(node)
    except _DividesByZero as e:
        return f"{e} divides by zero"
    return "it is false for every m, k and n" if value == _FALSE else None


def _range(node: ast.AST) -> tuple[float, float]:
    """The values ``node`` can take (booleans as 0 and 1)."""
    if isinstance(node, ast.Constant):
        return (node.value, node.value)
    if isinstance(node, ast.Name):
        return _SIZE
    if isinstance(node, ast.UnaryOp):
        lo, hi = _range(node.operand)
        if isinstance(node.op, ast.Not):
            return _truth(lo > 0 or hi < 0, lo == hi == 0)
        return (-hi, -lo)
    if isinstance(node, ast.BoolOp):
        values = [_range(v) for v in node.values]
        truths = [_FALSE if v == _FALSE else _TRUE if not (v[0] <= 0 <= v[1]) else _EITHER for v in values]
        if isinstance(node.op, ast.And):
            return _truth(_FALSE in truths, all(t == _TRUE for t in truths))
        return _truth(all(t == _FALSE for t in truths), _TRUE in truths)
    if isinstance(node, ast.BinOp):
        return _binop_range(node)
    assert isinstance(node, ast.Compare)
    left, truths = _range(node.left), []
    for op, comparator in zip(node.ops, node.comparators):
        right = _range(comparator)
        truths.append(_compare_range(op, left, right))
        left = right
    return _truth(_FALSE in truths, all(t == _TRUE for t in truths))


def _truth(false: bool, true: bool) -> tuple[int, int]:
    return _FALSE if false else _TRUE if true else _EITHER


def _binop_range(node: ast.BinOp) -> tuple[float, float]:
    (a, b), (c, d) = _range(node.left), _range(node.right)
    if isinstance(node.op, ast.Add):
        return (a + c, b + d)
    if isinstance(node.op, ast.Sub):
        return (a - d, b - c)
    if isinstance(node.op, ast.Mult):
        products = [x * y if x and y else 0 for x in (a, b) for y in (c, d)]
        return (min(products), max(products))
    if (c, d) == (0, 0):
        raise _DividesByZero(repr(ast.unparse(node)))
    if c > 0 and c == d:  # a positive constant divisor
        if isinstance(node.op, ast.Mod):
            return (0, c - 1)
        return (a // c if a != -_INF else -_INF, b // c if b != _INF else _INF)
    return (-_INF, _INF)


def _compare_range(op: ast.cmpop, left: tuple[float, float], right: tuple[float, float]) -> tuple[int, int]:
    (a, b), (c, d) = left, right
    if isinstance(op, ast.Eq):
        return _truth(b < c or d < a, a == b == c == d)
    if isinstance(op, ast.NotEq):
        return _truth(a == b == c == d, b < c or d < a)
    if isinstance(op, ast.Lt):
        return _truth(a >= d, b < c)
    if isinstance(op, ast.LtE):
        return _truth(a > d, b <= c)
    if isinstance(op, ast.Gt):
        return _truth(b <= c, a > d)
    return _truth(b < c, a >= d)  # GtE


_FLIPPED = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Eq: ast.Eq}


def _contradicting_bounds(conjuncts: list[ast.AST]) -> str | None:
    """The comparisons of one name with constants, all required (the ``where`` list, ``and``, chains), that
    leave it no value, described; None when every name keeps one."""
    bounds: dict[str, list[float]] = {}
    said: dict[str, list[str]] = {}
    for name, op, value, text in _name_bounds(conjuncts):
        lo, hi = bounds.setdefault(name, [0, _INF])
        lo, hi = {ast.Lt: (lo, min(hi, value - 1)), ast.LtE: (lo, min(hi, value)),
                  ast.Gt: (max(lo, value + 1), hi), ast.GtE: (max(lo, value), hi),
                  ast.Eq: (max(lo, value), min(hi, value))}[op]
        bounds[name] = [lo, hi]
        said.setdefault(name, []).append(text)
        if lo > hi:
            return f"no {name} satisfies {' and '.join(said[name])}"
    return None


def _name_bounds(conjuncts: list[ast.AST]):
    """``(name, op, constant, text)`` of each comparison of a name with a constant in ``conjuncts``, read as
    ``name op constant``."""
    for node in conjuncts:
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            yield from _name_bounds(node.values)
            continue
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            if type(op) not in _FLIPPED:
                continue
            text = ast.unparse(ast.Compare(left=left, ops=[op], comparators=[right]))
            if isinstance(left, ast.Name) and isinstance(right, ast.Constant):
                yield left.id, type(op), right.value, text
            elif isinstance(right, ast.Name) and isinstance(left, ast.Constant):
                yield right.id, _FLIPPED[type(op)], left.value, text


# --------------------------------------------------------------------------------------------------
# Line numbers: tomllib does not keep them, so find the table and key in the text.


class _Locator:
    def __init__(self, text: str, path: str) -> None:
        self.path = path
        self.lines = text.splitlines()
        self.tables = [i for i, line in enumerate(self.lines, 1) if re.match(r"\s*\[\[\s*rule\s*\]\]", line)]

    def top(self, key: str) -> str:
        for i, line in enumerate(self.lines, 1):
            if re.match(rf"\s*\[*\s*\"?{re.escape(key)}\b", line):
                return f"{self.path}:{i}"
        return f"{self.path}:1"

    def key(self, index: int, key: str | None) -> str:
        if index >= len(self.tables):  # inline array-of-tables form: no [[rule]] headers
            return f"{self.path}:1"
        start = self.tables[index]
        if key is None:
            return f"{self.path}:{start}"
        end = self.tables[index + 1] if index + 1 < len(self.tables) else len(self.lines) + 1
        for i in range(start, end):
            if re.match(rf"\s*\"?{re.escape(key)}\"?\s*=", self.lines[i - 1]):
                return f"{self.path}:{i}"
        return f"{self.path}:{start}"
