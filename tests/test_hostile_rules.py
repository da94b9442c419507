"""Hostile rule files: refused with ``path:line:``, never run, and never able to hang or exhaust the loader.

Rule files come from users and may come from anywhere. TOML is read with tomllib; ``where`` constraints
are parsed with ast and interpreted over a whitelist, never evaluated; sizes are bounded so loading and
matching stay fast. The rule format has no references between rules or files, so the only "cycles" it
can express are repeats in epilogue patterns, which the NFA consumes one step per transition.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helion_backend.compile.rules import RuleError, load_rule_file, load_rules

RULE_START = '[[rule]]\nname = "r"\n'
HEADER = RULE_START + 'anchor = ["mm"]\n'  # an offending key appended to it is on line 4


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM interrupts a blocking open() and the regex engine alike (where
    there is no SIGALRM, the code under test runs without a deadline)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def refused(path: Path, line: int, needle: str, seconds: float = 10.0) -> str:
    """Load ``path`` (within ``seconds``); it must raise a RuleError starting with ``path:line:``."""
    with deadline(seconds), pytest.raises(RuleError) as info:
        load_rule_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}:"), message
    assert needle in message, message
    return message


def write(tmp_path: Path, text: str | bytes, name: str = "hostile.toml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


HOSTILE_VALUES = {
    "unknown-key": ('anchor2 = ["mm"]', "unknown key 'anchor2'"),
    "unknown-step": ('epilogue = ["tanh"]', "unknown epilogue step 'tanh'"),
    "unknown-alternative": ('epilogue = ["gelu|softmax?"]', "unknown epilogue step 'softmax'"),
    "unknown-kernel": ('kernel = "exec"', "unknown kernel family 'exec'"),
    # Names a constraint cannot read.
    "unbound-x": ('where = ["x > 3"]', "unknown name 'x'"),
    "unbound-builtins": ('where = ["__builtins__ > 0"]', "unknown name '__builtins__'"),
    "unbound-case": ('where = ["N > 0"]', "unknown name 'N'"),
    # Anything but integers, m/k/n, + - * // %, comparisons and and/or/not.
    "method-call": ('where = ["n.bit_length() > 3"]', "is not allowed"),
    "attribute": ('where = ["n.real > 3"]', "Attribute is not allowed"),
    "call": ('where = ["abs(n) > 3"]', "Call is not allowed"),
    "import-call": ("where = [\"__import__('os').system('touch pwned') == 0\"]", "Call is not allowed"),
    "list-comprehension": ('where = ["[i for i in (1, 2)] == n"]', "ListComp is not allowed"),
    "generator": ('where = ["any(i for i in (n,))"]', "is not allowed"),
    "lambda-call": ('where = ["(lambda: 1)() == n"]', "is not allowed"),
    "lambda": ('where = ["(lambda: 1) == n"]', "Lambda is not allowed"),
    "subscript": ('where = ["(1, 2)[0] == n"]', "Subscript is not allowed"),
    "walrus": ('where = ["(n := 5) > 0"]', "NamedExpr is not allowed"),
    "if-expression": ('where = ["n if n else k"]', "IfExp is not allowed"),
    "f-string": ("where = [\"f'{n}' == '1'\"]", "JoinedStr is not allowed"),
    "in": ('where = ["n in (1, 2)"]', "is not allowed"),
    "true-division": ('where = ["n / 2 > 1"]', "Div is not allowed"),
    "shift": ('where = ["n << 40 > 1"]', "LShift is not allowed"),
    "float": ('where = ["n > 1.5"]', "must be an integer"),
    "bool": ('where = ["n > True"]', "must be an integer"),
    # Absurd sizes: exponentiation is not in the whitelist, constants are bounded.
    "pow": ('where = ["n ** 999999999 > 0"]', "Pow is not allowed"),
    "pow-tower": ('where = ["9**9**9**9 > n"]', "Pow is not allowed"),
    "constant-2**40+1": ('where = ["n < 1099511627777"]', "|value| <= 2**40"),
    "constant-150-digits": ('where = ["n < ' + "9" * 150 + '"]', "|value| <= 2**40"),
    "constant-5000-digits": ('where = ["n < ' + "9" * 5000 + '"]', "longer than 200 characters"),
    "10000-parentheses": ('where = ["' + "(" * 10000 + "n" + ")" * 10000 + '"]', "longer than 200 characters"),
    "null-byte": ('where = ["n\\u0000 > 1"]', "cannot parse constraint"),
    "1000-constraints": ('where = [' + ", ".join(['"n > 1"'] * 1000) + "]", "'where' has 1000 entries; at most 32"),
    "100000-steps": ('epilogue = [' + ", ".join(['"gelu*"'] * 100000) + "]", "'epilogue' has 100000 entries; at most 32"),
    "1000-anchors": ('anchor = [' + ", ".join(['"mm"'] * 1000) + "]", "'anchor' has 1000 entries; at most 32"),
    # Types TOML can express that the format does not take.
    "huge-priority": ("priority = 99999999999999999999999", "out of range"),
    # Past 4300 digits int() refuses a decimal literal; a hex one parses but has no decimal repr.
    "priority-5000-digits": ("priority = " + "9" * 5000, "invalid TOML: Exceeds the limit"),
    "priority-20000-bits": ("priority = 0x" + "f" * 5000, "priority <an integer of 20000 bits> is out of range"),
    "anchor-20000-bits": ("anchor = [0x" + "f" * 5000 + "]", "'anchor' must be a list of strings"),
    "float-priority": ("priority = inf", "'priority' must be a int"),
    "datetime-priority": ("priority = 1979-05-27T07:32:00Z", "'priority' must be a int"),
    "table-description": ("description = {a = 1}", "'description' must be a str"),
}


@pytest.mark.parametrize("body, needle", HOSTILE_VALUES.values(), ids=list(HOSTILE_VALUES))
def test_hostile_values_are_refused_at_their_line(tmp_path, body, needle):
    anchor = "" if body.startswith("anchor") else 'anchor = ["mm"]\n'
    refused(write(tmp_path, RULE_START + body + "\n" + anchor), 3, needle)
    assert not (Path.cwd() / "pwned").exists()


def test_constraints_are_interpreted_never_evaluated(tmp_path, monkeypatch):
    """Loading and checking constraints runs no Python code: eval/exec are never called and compile()
    is only asked for an AST."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a rule file made the loader evaluate code")

    real_compile = builtins.compile

    def ast_only(source, filename, mode, flags=0, *args, **kwargs):
        assert flags & ast.PyCF_ONLY_AST, "compile() asked for code, not an AST"
        return real_compile(source, filename, mode, flags, *args, **kwargs)

    path = write(tmp_path, HEADER + 'where = ["n % 16 == 0 and not k < 32 or m * 2 - 1 >= n // 3"]\n')
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    monkeypatch.setattr(builtins, "compile", ast_only)
    ((constraint,),) = [rule.where for rule in load_rule_file(path)]
    for m, k, n in [(1, 64, 64), (5, 16, 48), (100, 8, 7)]:
        expected = n % 16 == 0 and not k < 32 or m * 2 - 1 >= n // 3
        assert constraint.holds({"m": m, "k": k, "n": n}) is expected
    assert constraint.holds({"m": None, "k": 64, "n": 7}) is None  # a dynamic m reads as unknown


def test_largest_allowed_constraints_evaluate_fast(tmp_path):
    """The biggest value a 200-character constraint can build is a product of bounded constants."""
    text = "*".join(["1099511627776"] * 13) + " > m*k*n"
    assert len(text) <= 200
    ((constraint,),) = [rule.where for rule in load_rule_file(write(tmp_path, HEADER + f'where = ["{text}"]\n'))]
    with deadline(5):
        for _ in range(1000):
            assert constraint.holds({"m": 1 << 40, "k": 1 << 40, "n": 1 << 40})


MALFORMED_DOCUMENTS = {
    "rule-int": ("rule = [1]\n", 1, "rule #1 must be a table, got 1"),
    "rule-str": ('rule = ["name"]\n', 1, "rule #1 must be a table"),
    "rule-array": ("rule = [[]]\n", 1, "rule #1 must be a table"),
    "rule-not-array": ('rule = "mm"\n', 1, "no [[rule]] tables"),
    "arrays-10000-deep": ("x = " + "[" * 10000 + "]" * 10000 + "\n", 1, "nested too deeply"),
    "inline-tables-5000-deep": ("\n\nx = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n", 3, "nested too deeply"),
    "epilogue-2000-deep": (HEADER + "epilogue = " + "[" * 2000 + "]" * 2000 + "\n", 4, "nested too deeply"),
    # tomllib builds dotted keys without recursion, so the value is 5000 dicts deep.
    "dotted-key-5000-deep": ('[[rule]]\nname.' + ".".join(["a"] * 5000) + ' = 1\nanchor = ["mm"]\n', 1, "'name' must be a str"),
    "include-key": (HEADER + 'description = "ok"\n' + "include = 'other.toml'\n", 5, "unknown key 'include'"),
    "100k-character-key": ("x" * 100_000 + " = 1\n", 1, "unknown top-level key"),
}


@pytest.mark.parametrize("text, line, needle", MALFORMED_DOCUMENTS.values(), ids=list(MALFORMED_DOCUMENTS))
def test_malformed_documents_are_refused(tmp_path, text, line, needle):
    message = refused(write(tmp_path, text), line, needle)
    assert len(message) < 2000  # values are quoted briefly, however large or deep


def test_non_utf8_file_names_its_line(tmp_path):
    refused(write(tmp_path, HEADER.encode() + b'description = "caf\xe9"\n'), 4, "not UTF-8 text")


def test_enormous_file_is_refused_without_reading_it_all(tmp_path):
    path = write(tmp_path, HEADER + "# " + "x" * (2 << 20) + "\n")
    refused(path, 0, "larger than 1048576 bytes")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_special_files_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "rules.toml"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    refused(fifo, 0, "not a regular file", seconds=5)
    refused(Path("/dev/zero"), 0, "not a regular file", seconds=5)  # would never end
    refused(tmp_path, 0, "not a regular file")


def test_step_pattern_with_long_whitespace_is_rejected_in_linear_time(tmp_path):
    """Found here: the step-pattern regex took cubic time on a run of spaces (20000 spaces: hours)."""
    path = write(tmp_path, HEADER + 'epilogue = ["gelu' + " " * 20000 + '!"]\n')
    started = time.perf_counter()
    refused(path, 4, "cannot parse step pattern", seconds=10)
    assert time.perf_counter() - started < 2


# --------------------------------------------------------------------------------------------------
# Cycles: the format has no references, and pattern repeats cannot nest


@pytest.mark.parametrize("pattern", ["gelu**", "gelu*?", "gelu?*", "(gelu*)*", "(gelu|relu)*", "*", "?"])
def test_step_patterns_cannot_nest_repeats(tmp_path, pattern):
    refused(write(tmp_path, HEADER + f'epilogue = ["{pattern}"]\n'), 4, "cannot parse step pattern")


def test_epilogue_nfa_terminates_on_repeats_everywhere(tmp_path):
    """Every state optional or repeating: no epsilon cycle, one input step per transition."""
    path = write(tmp_path, HEADER + "epilogue = [" + ", ".join(['"gelu|relu*"', '"bias?"'] * 16) + "]\n")
    (rule,) = load_rule_file(path)
    with deadline(10):
        assert rule.accepted_prefix([]) == 0
        assert rule.accepted_prefix(["gelu"] * 10_000) == 10_000
        assert rule.accepted_prefix(["relu", "bias"] * 16 + ["bias"]) == 32
        assert rule.accepted_prefix(["silu"] * 10_000) == 0
    strict = write(tmp_path, HEADER + 'epilogue = ["bias?", "gelu*", "residual"]\n', "strict.toml")
    (rule,) = load_rule_file(strict)
    assert rule.accepted_prefix(["bias", "gelu", "gelu", "residual", "gelu"]) == 4
    assert rule.accepted_prefix(["gelu", "gelu"]) is None  # the residual is required


def test_rules_cannot_reach_other_rules_or_files(tmp_path):
    """No key names another rule or file; naming one file twice (or through a link) is refused as a
    redefinition, and a link loop cannot be read."""
    for key in ("extends", "include", "rules", "import"):
        refused(write(tmp_path, HEADER + f'{key} = "r"\n'), 4, f"unknown key '{key}'")
    path = write(tmp_path, HEADER, "a.toml")
    link = tmp_path / "b.toml"
    link.symlink_to(path)
    for paths in ([path, path], [path, link]):
        with pytest.raises(RuleError, match=r"^.*:1: rule name 'r' is already defined at .*a.toml:1"):
            load_rules(paths)
    loop = tmp_path / "loop.toml"
    loop.symlink_to(loop)
    refused(loop, 0, "cannot read rule file")


@pytest.mark.slow  # the refusals themselves are tested in this process above
@pytest.mark.parametrize("kind", ["nested", "fifo"])
def test_check_rules_cli_refuses_hostile_files(tmp_path, kind):
    """``check-rules`` exits non-zero with the ``path:line:`` message, and a FIFO does not block it."""
    if kind == "nested":
        path = write(tmp_path, HEADER + 'where = ["' + "(" * 10000 + "n" + ")" * 10000 + '"]\n')
        expected = f"{path}:4: rule #1: constraint is longer than 200 characters"
    elif hasattr(os, "mkfifo"):
        path = tmp_path / "fifo.toml"
        os.mkfifo(path)
        expected = f"{path}:0: not a regular file"
    else:
        pytest.skip("needs FIFOs")
    result = subprocess.run([sys.executable, "-m", "helion_backend", "check-rules", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert f"error: {expected}" in result.stderr, result.stderr
