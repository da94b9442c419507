"""Rule files: a mistake is refused with its path, line and the offending key; users add their own."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_run, randn, sites

from helion_backend.compile.rules import RuleError, builtin_rule_files, load_rule_file, load_rules

GOOD = """\
# a user's rule
[[rule]]
name = "wide_gelu"
anchor = ["linear"]
epilogue = ["bias?", "gelu"]
dtypes = ["float32"]
where = ["n % 16 == 0 and k >= 32"]
priority = 100
"""


def write(tmp_path, text, name="rules.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    "body, line, needle",
    [
        ('epilogue = ["bias?", "geluu"]', 5, "unknown epilogue step 'geluu'"),
        ('anchor2 = ["mm"]', 5, "unknown key 'anchor2'"),
        ('where = ["__import__(\'os\').system(\'true\')"]', 5, "Call is not allowed"),
        ('where = ["x > 3"]', 5, "unknown name 'x'"),
        ('where = ["n >"]', 5, "cannot parse constraint"),
        ('dtypes = ["int4"]', 5, "unsupported dtype 'int4'"),
        ('priority = "high"', 5, "'priority' must be a int"),
        ('epilogue = ["bias!!"]', 5, "cannot parse step pattern"),
        ('prologue = ["quant"]', 5, "unknown prologue step 'quant'"),
        ('kernel = "cutlass"', 5, "unknown kernel family 'cutlass'"),
    ],
)
def test_mistakes_name_file_line_and_key(tmp_path, body, line, needle):
    path = write(tmp_path, f'# header\n\n[[rule]]\nname = "r"\n{body}\nanchor = ["mm"]\n')
    if body.startswith("anchor"):
        path = write(tmp_path, f'# header\n\n[[rule]]\nname = "r"\n{body}\n')
    with pytest.raises(RuleError) as info:
        load_rule_file(path)
    message = str(info.value)
    if body.startswith("anchor2"):  # the unknown key is found before the missing anchor
        line = 5
    assert message.startswith(f"{path}:{line}:"), message
    assert needle in message


def test_toml_syntax_error_has_line(tmp_path):
    path = write(tmp_path, '[[rule]]\nname = "r"\nanchor = ["mm"\nepilogue = []\n')
    with pytest.raises(RuleError, match=rf"{path}:\d+: invalid TOML"):
        load_rule_file(path)


def test_missing_anchor_and_duplicate_names(tmp_path):
    with pytest.raises(RuleError, match="missing required key 'anchor'"):
        load_rule_file(write(tmp_path, '[[rule]]\nname = "r"\n'))
    a = write(tmp_path, GOOD, "a.toml")
    b = write(tmp_path, GOOD, "b.toml")
    with pytest.raises(RuleError, match=r"b.toml:2: rule name 'wide_gelu' is already defined at .*a.toml:2"):
        load_rules([a, b])


def test_epilogue_patterns_take_the_longest_accepted_prefix():
    rule = next(r for r in load_rules(builtin_rule_files()) if r.name == "gemm_activation")
    assert rule.accepted_prefix(["bias", "gelu", "residual", "bias"]) == 3
    assert rule.accepted_prefix(["bias"]) is None  # the activation is required
    assert rule.accepted_prefix(["silu", "scale", "mul", "residual", "cast"]) == 5


def test_user_rule_wins_by_priority_and_constraints_apply(tmp_path):
    path = write(tmp_path, GOOD)
    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
    _, reports = compile_run(fn, x, w, b, options={"rewrite_on_cpu": True, "rules": [str(path)]})
    assert [s.rule for s in sites(reports)] == ["wide_gelu"]
    # n=40 breaks "n % 16 == 0": the shipped rule takes the site instead.
    w2, b2 = randn(40, 32), randn(40)
    torch._dynamo.reset()  # else Dynamo's automatic dynamic shapes would make N symbolic
    _, reports = compile_run(fn, x, w2, b2, options={"rewrite_on_cpu": True, "rules": [str(path)]})
    assert [s.rule for s in sites(reports)] == ["gemm_activation"]


def test_bad_rule_file_fails_the_compile_with_its_location(tmp_path):
    path = write(tmp_path, '[[rule]]\nname = "r"\nanchor = ["mm"]\nepilogue = ["gelu", "tanh"]\n')
    with pytest.raises(Exception, match=rf"{path}:4: rule #1: unknown epilogue step 'tanh'"):
        compile_run(lambda x: x @ x, randn(4, 4), options={"rules": [str(path)]})


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "helion_backend", *args], capture_output=True, text=True)


def run_in_process(capsys, *args) -> subprocess.CompletedProcess:
    """The command line's ``main`` in this process (no interpreter start-up), as :func:`run_cli` reports it."""
    from helion_backend.__main__ import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def test_check_rules_cli(tmp_path, capsys):
    ok = run_cli("check-rules", str(write(tmp_path, GOOD)), "--with-builtin")
    expected = len(load_rules(builtin_rule_files())) + 1
    assert ok.returncode == 0 and f"{expected} rule(s) valid" in ok.stdout, ok.stderr
    bad = write(tmp_path, '[[rule]]\nname = "r"\nanchor = ["matmul"]\n', "bad.toml")
    result = run_in_process(capsys, "check-rules", str(bad))
    assert result.returncode == 1
    assert f"{bad}:3: rule #1: unknown anchor 'matmul'" in result.stderr
    shipped = run_in_process(capsys, "check-rules")
    assert shipped.returncode == 0 and "gemm_activation" in shipped.stdout


@pytest.mark.parametrize("where, needle", [
    ('["n // 0 == 1"]', "constraint 'n // 0 == 1' can never hold: 'n // 0' divides by zero"),
    ('["k % (4 - 4) == 0"]', "'k % (4 - 4)' divides by zero"),
    ('["1 > 2"]', "constraint '1 > 2' can never hold: it is false for every m, k and n"),
    ('["n % 8 == 9"]', "constraint 'n % 8 == 9' can never hold"),
    ('["k < 0"]', "constraint 'k < 0' can never hold"),
    ('["not (n >= 0)"]', "can never hold"),
    ('["n > 8 and n < 4"]', "constraints can never all hold: no n satisfies n > 8 and n < 4"),
    ('["4096 <= n", "k > 1",\n  "n <= 1024"]', "no n satisfies 4096 <= n and n <= 1024"),
])
def test_a_constraint_that_can_never_hold_is_refused_at_its_line(tmp_path, capsys, where, needle):
    path = write(tmp_path, f'# header\n[[rule]]\nname = "r"\nanchor = ["mm"]\nwhere = {where}\n')
    with pytest.raises(RuleError) as info:
        load_rule_file(path)
    assert str(info.value).startswith(f"{path}:5: rule #1: "), info.value
    assert needle in str(info.value)
    result = run_in_process(capsys, "check-rules", str(path))
    assert result.returncode == 1 and needle in result.stderr, result.stderr


@pytest.mark.parametrize("where", ["k % 8 == 0", "n >= 1024", "m <= 32 or n == 5", "k // 128 >= 2",
                                   "n % 16 == 0 and k >= 32", "8 <= n <= 8", "n - n == 1"])
def test_constraints_that_can_hold_load(tmp_path, where):
    """Only what is provably false is refused (``n - n == 1`` is false too, but the check does not see it)."""
    path = write(tmp_path, f'[[rule]]\nname = "r"\nanchor = ["mm"]\nwhere = ["{where}"]\n')
    ((constraint,),) = [rule.where for rule in load_rule_file(path)]
    assert constraint.text == where
