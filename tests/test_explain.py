"""``python -m helion_backend explain script.py``: runs the script's compiles with dumps on and prints the report,
the why-not list and where the dumps are."""

from __future__ import annotations

import textwrap

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
