"""``python -m helion_backend explain script.py`` (or ``module:function``): runs the script's compiles with dumps on
and prints the report, the why-not list and where the dumps are."""

from __future__ import annotations

import sys
import textwrap

import pytest

from helion_backend.__main__ import main

SCRIPT = textwrap.dedent("""
    import sys
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(32, 64)
            self.down = torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)).double().float() * x.sum())

    if __name__ == "__main__":
        torch.manual_seed(0)
        model, x = Block().eval(), torch.randn(4, 32)
        with torch.no_grad():
            out = torch.compile(model, backend="helion_inductor", options={"rewrite_on_cpu": True})(x)
            torch.testing.assert_close(out, model(x))
        print("script ran with", sys.argv[1:])
""")


def test_explain_runs_the_script_and_says_what_fused_why_not_and_where_the_dumps_are(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text(SCRIPT)
    dumps = tmp_path / "dumps"
    assert main(["explain", "--debug-dir", str(dumps), str(script), "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "script ran with ['--batch', '4']" in out
    assert "helion_inductor explain: 1 graph(s)" in out
    assert "graph graph_" in out and "site(s) (2 reference)" in out
    assert "[gemm_activation] up (addmm, model.py:12): addmm -> bias -> relu" in out
    why_not = out.split("why not (", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert any("up (addmm, model.py:12): reference: no Helion kernel on cpu" in line for line in why_not), why_not
    (graph,) = [p for p in dumps.iterdir() if p.is_dir()]
    assert f"  {graph}" in out.splitlines()
    assert "helion_inductor.gemm_epilogue" in (graph / "after.py").read_text()


def test_explain_says_when_nothing_was_compiled(tmp_path, capsys):
    script = tmp_path / "nothing.py"
    script.write_text("print('no compile here')\n")
    assert main(["explain", str(script)]) == 0
    assert "compiled no graph with backend='helion_inductor'" in capsys.readouterr().out


def test_explain_returns_the_scripts_exit_status(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert main(["explain", str(script)]) == 3
    assert main(["explain", str(tmp_path / "missing.py")]) == 2


MODULE = textwrap.dedent("""
    import sys
    import torch

    LIMIT = 3

    class Up(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(32, 64)

        def forward(self, x):
            return torch.relu(self.up(x))

    def main():
        torch.manual_seed(0)
        model, x = Up().eval(), torch.randn(4, 32)
        with torch.no_grad():
            out = torch.compile(model, backend="helion_inductor", options={"rewrite_on_cpu": True})(x)
            torch.testing.assert_close(out, model(x))
        print("main ran with", sys.argv[1:])
        return int(sys.argv[-1])
""")


@pytest.fixture
def user_package(tmp_path, monkeypatch):
    """A package ``explained_pkg`` in the current folder: ``demo`` compiles, ``broken`` imports what is missing."""
    package = tmp_path / "explained_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "demo.py").write_text(MODULE)
    (package / "broken.py").write_text("import a_dependency_not_installed\n")
    monkeypatch.chdir(tmp_path)
    yield package
    for name in [m for m in sys.modules if m.split(".")[0] == "explained_pkg"]:
        del sys.modules[name]


def test_explain_calls_a_function_of_a_module_and_returns_its_status(user_package, capsys):
    dumps = user_package.parent / "dumps"
    assert main(["explain", "--debug-dir", str(dumps), "explained_pkg.demo:main", "--batch", "4", "5"]) == 5
    out = capsys.readouterr().out
    assert "main ran with ['--batch', '4', '5']" in out
    assert "helion_inductor explain: 1 graph(s)" in out
    assert "[gemm_activation] up (addmm, demo.py:13): addmm -> bias -> relu" in out
    assert any(" up (addmm, demo.py:13): reference: no Helion kernel on cpu" in line for line in out.splitlines())
    (graph,) = [p for p in dumps.iterdir() if p.is_dir()]
    assert f"  {graph}" in out.splitlines()


@pytest.mark.parametrize("target, error", [
    ("no_such_pkg.demo:main", "no_such_pkg.demo:main: no module named 'no_such_pkg'"),
    ("explained_pkg.nothing:main", "explained_pkg.nothing:main: no module named 'explained_pkg.nothing'"),
    ("explained_pkg.broken:main", "explained_pkg.broken:main: module 'explained_pkg.broken' does not import: "
                                  "ModuleNotFoundError: No module named 'a_dependency_not_installed'"),
    ("explained_pkg.demo:mian", "explained_pkg.demo:mian: module 'explained_pkg.demo' ({demo}) has no function 'mian'"),
    ("explained_pkg.demo:main.inner", "explained_pkg.demo:main.inner: module 'explained_pkg.demo' ({demo}) has no "
                                      "function 'main.inner'"),
    ("explained_pkg.demo:LIMIT", "explained_pkg.demo:LIMIT: 'LIMIT' of module 'explained_pkg.demo' is a int, not a "
                                 "function"),
])
def test_explain_names_the_module_or_function_it_cannot_run(user_package, capsys, target, error):
    assert main(["explain", target]) == 2
    err = capsys.readouterr().err
    assert f"error: {error.format(demo=user_package / 'demo.py')}" in err, err
