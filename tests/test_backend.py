"""The backend as users reach it: entry point, options, mode, FX graph cache, debug output."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import compile_run, randn, rel_err, sites

import helion_backend
from helion_backend.compile import graph_drawing
from helion_backend.compile.manager import HelionPassManager
from helion_backend.environment import package_digest, source_digest
from helion_backend.options import BackendOptions
from helion_backend.report import GraphReport


def run_python(code: str, env: dict | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=300)


def test_entry_point_resolves_without_import_and_import_does_not_clash(tmp_path):
    result = run_python(
        """
        import sys, torch
        f = torch.compile(lambda x, w: torch.relu(x @ w), backend="helion_inductor",
                          options={"rewrite_on_cpu": True})
        x, w = torch.randn(4, 8), torch.randn(8, 16)
        torch.testing.assert_close(f(x, w), torch.relu(x @ w))
        assert "helion_backend" in sys.modules  # loaded by the entry point, not by us
        import helion_backend  # must not raise "duplicate name"
        print("sites", [s.rule for r in helion_backend.get_reports() for s in r.sites])
        """,
        cwd=str(tmp_path),  # not the checkout: the package must come from the installed entry point
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sites ['gemm_activation']" in result.stdout


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError) as info:
        BackendOptions.from_user({"max_helion_sise": 16})
    message = str(info.value)
    assert "max_helion_sise" in message and "max_helion_size" in message and "rewrite_on_cpu" in message
    with pytest.raises(Exception, match="unknown option.*'bogus'.*valid options are"):
        compile_run(lambda x: x @ x, randn(4, 4), options={"bogus": 1})


def test_option_types_are_checked():
    with pytest.raises(TypeError, match="max_helion_size"):
        BackendOptions.from_user({"max_helion_size": "32"})
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match=f"option 'fuse_activation_quant' must be bool, got {value!r}"):
            BackendOptions.from_user({"fuse_activation_quant": value})
    with pytest.raises(Exception, match="option 'fuse_activation_quant' must be bool"):
        compile_run(lambda x: x @ x, randn(4, 4), options={"fuse_activation_quant": "on"})
    assert BackendOptions.from_user({"fuse_activation_quant": True}).fuse_activation_quant is True
    assert BackendOptions().fuse_activation_quant is False


def test_mode_is_accepted_and_unknown_mode_refused():
    # torch.compile passes either mode= or options= to a backend, never both.
    x, w = randn(4, 8), randn(8, 16)
    import helion_backend

    compiled = torch.compile(lambda x, w: torch.relu(x @ w), backend="helion_inductor", mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(compiled(x, w), torch.relu(x @ w))
    (site,) = sites(helion_backend.get_reports())
    assert site.epilogue == ["relu"] and site.runs_on == "inductor"
    with pytest.raises(ValueError, match="unknown mode 'fastest'"):
        helion_backend.helion_inductor(torch.fx.symbolic_trace(lambda x: x + 1), [x], mode="fastest")


def test_source_digest_changes_with_any_source_file(tmp_path):
    """The uuid covers the package's code (an editable install keeps its version while its passes change)."""
    (tmp_path / "passes").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "passes" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    base = source_digest(tmp_path)
    assert source_digest(tmp_path) == base
    (tmp_path / "notes.txt").write_text("still not code")
    assert source_digest(tmp_path) == base
    (tmp_path / "passes" / "b.py").write_text("y = 3\n")
    assert source_digest(tmp_path) != base
    assert package_digest() == source_digest(Path(helion_backend.__file__).parent)


def test_uuid_covers_rules_options_and_version(tmp_path):
    rule = tmp_path / "r.toml"
    rule.write_text('[[rule]]\nname = "r"\nanchor = ["mm"]\nepilogue = ["relu"]\n')
    base = HelionPassManager(BackendOptions.from_user({"rules": [str(rule)]})).uuid()
    assert base == HelionPassManager(BackendOptions.from_user({"rules": [str(rule)]})).uuid()
    rule.write_text('[[rule]]\nname = "r"\nanchor = ["mm"]\nepilogue = ["relu?"]\n')
    assert HelionPassManager(BackendOptions.from_user({"rules": [str(rule)]})).uuid() != base
    other = HelionPassManager(BackendOptions.from_user({"rules": [str(rule)], "max_helion_size": 8}))
    assert other.uuid() != base
    # Where the activation quantization runs changes the graph a cached compile holds.
    quant_in_kernel = HelionPassManager(BackendOptions.from_user({"rules": [str(rule)], "fuse_activation_quant": True}))
    assert quant_in_kernel.uuid() != HelionPassManager(BackendOptions.from_user({"rules": [str(rule)]})).uuid()
    debug_only = HelionPassManager(BackendOptions.from_user({"rules": [str(rule)], "debug_dir": "/x"}))
    assert debug_only.uuid() == HelionPassManager(BackendOptions.from_user({"rules": [str(rule)]})).uuid()


def test_code_cache_follows_the_options_of_the_latest_compile_and_the_env_var(tmp_path, monkeypatch):
    """Kernels compile when they first run, so each compile points the code cache at its options'."""
    from helion_backend import code_cache

    try:
        helion_backend.helion_inductor(torch.fx.symbolic_trace(lambda x: x.t()), [randn(2, 2)],
                                       options={"cache_dir": str(tmp_path)})
        assert code_cache.directory() == tmp_path / "kernels"
        helion_backend.helion_inductor(torch.fx.symbolic_trace(lambda x: x.t()), [randn(2, 2)],
                                       options={"cache_dir": str(tmp_path), "code_cache": False})
        assert code_cache.directory() is None
    finally:
        code_cache.configure(BackendOptions())
    # Not part of the rewrite: the FX graph cache's key stays.
    assert HelionPassManager(BackendOptions(code_cache=False)).uuid() == HelionPassManager(BackendOptions()).uuid()
    with pytest.raises(TypeError, match="code_cache"):
        BackendOptions.from_user({"code_cache": "off"})
    monkeypatch.setenv("HELION_INDUCTOR_CODE_CACHE", "0")
    assert BackendOptions().code_cache_dir is None


CACHE_PROGRAM = """
import json, sys, torch, torch.nn.functional as F
import helion_backend
torch.manual_seed(0)
x, w, b = torch.randn(4, 32), torch.randn(48, 32), torch.randn(48)
fn = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")
rules = sys.argv[1:]
out = torch.compile(fn, backend="helion_inductor", options={"rewrite_on_cpu": True, "rules": rules})(x, w, b)
ref = fn(x.double(), w.double(), b.double())
err = ((out.double() - ref).norm() / ref.norm()).item()
from torch._dynamo.utils import counters
print(json.dumps({"err": err, "hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
                  "reports": [r.to_json() for r in helion_backend.get_reports()]}))
"""


@pytest.mark.slow
def test_fx_graph_cache_second_process_is_correct_and_rule_change_misses(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend")}
    script = tmp_path / "prog.py"
    script.write_text(CACHE_PROGRAM)

    def run(*rules):
        result = subprocess.run([sys.executable, str(script), *rules], capture_output=True, text=True,
                                env={**os.environ, **env}, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["hits"] == 0 and second["hits"] >= 1
    for result in (first, second):
        assert result["err"] < 1e-5
        (report,) = result["reports"]
        assert [s["epilogue"] for s in report["sites"]] == [["bias", "gelu_tanh"]]
    assert second["reports"][0]["from_cache"] is True

    # A user rule that takes the site changes the uuid: a miss, and the new rule shows in the report.
    rule = tmp_path / "mine.toml"
    rule.write_text('[[rule]]\nname = "mine"\nanchor = ["linear"]\nepilogue = ["bias"]\npriority = 99\n')
    third = run(str(rule))
    assert third["hits"] == 0 and third["err"] < 1e-5
    assert [s["rule"] for s in third["reports"][0]["sites"]] == ["mine"]


def test_a_graph_served_from_the_fx_graph_cache_is_dumped_to_debug_dir_too(tmp_path):
    """A cache hit skips the passes, so its dumps are replayed from the compile that rewrote the graph;
    a hit saved without dumps (debug_dir was off then) compiles once more, so debug_dir still gets them."""
    from torch._dynamo.utils import counters

    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
    options = {"rewrite_on_cpu": True, "cache_dir": str(tmp_path / "cache")}

    def compile_anew(debug_dir: Path | None) -> tuple[GraphReport, dict[str, str]]:
        torch._dynamo.reset()
        helion_backend.clear_reports()
        counters.clear()
        out = torch.compile(fn, backend="helion_inductor",
                            options={**options, "debug_dir": str(debug_dir) if debug_dir else None})(x, w, b)
        assert counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] >= 1
        assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5
        (report,) = helion_backend.get_reports()
        if debug_dir is None:
            return report, {}
        (graph_dir,) = [p for p in debug_dir.iterdir() if p.is_dir()]
        assert graph_dir.name == report.graph
        # The per-pass dumps are written where the passes ran: not on a hit.
        assert (graph_dir / "passes").is_dir() == (not report.from_cache)
        return report, {p.name: p.read_text() for p in graph_dir.iterdir() if p.is_file()}

    torch.compile(fn, backend="helion_inductor", options=options)(x, w, b)  # fills the caches, no dumps
    rewritten, first = compile_anew(tmp_path / "dumps_recompiled")
    served, second = compile_anew(tmp_path / "dumps_served")
    assert not rewritten.from_cache and served.from_cache

    assert set(first) == set(second) == {"before.py", "after.py", "summary.txt", "report.json"}
    assert second["before.py"] == first["before.py"] and "aten.addmm" in second["before.py"]
    assert second["after.py"] == first["after.py"] and "helion_inductor.gemm_epilogue" in second["after.py"]
    report = json.loads(second["report.json"])
    assert report["from_cache"] is True and json.loads(first["report.json"])["from_cache"] is False
    assert [(s["rule"], s["epilogue"]) for s in report["sites"]] == [("gemm_activation", ["bias", "gelu_tanh"])]
    assert "from FX graph cache" in second["summary.txt"] and "from FX graph cache" not in first["summary.txt"]
    assert "[gemm_activation]" in second["summary.txt"]

    # Without debug_dir a hit is served as saved: a compile again would report from_cache False.
    quiet, _ = compile_anew(None)
    assert quiet.from_cache


def test_a_saved_state_with_malformed_dumps_is_ignored_with_a_warning_naming_it(tmp_path, caplog):
    from helion_backend import backend

    path = tmp_path / "state.json"
    saved = {"reports": [GraphReport(graph="graph_000").to_json()], "dynamic_sites": [], "helion_sites": [[]]}
    path.write_text(json.dumps(saved))  # saved before dumps were kept: none to replay
    assert backend._load_state(path)["dumps"] == [None]
    path.write_text(json.dumps({**saved, "dumps": [["before", "after"]]}))
    assert backend._load_state(path)["dumps"] == [("before", "after")]
    for dumps in ([["before"]], [[1, 2]], [None, None], "before"):
        path.write_text(json.dumps({**saved, "dumps": dumps}))
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert backend._load_state(path) is None, dumps
        assert f"ignoring the corrupt saved report {path}" in caplog.text


def test_debug_dir_dumps(tmp_path):
    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.silu(F.linear(x, w, b))  # noqa: E731
    compile_run(fn, x, w, b, options={"rewrite_on_cpu": True, "debug_dir": str(tmp_path)})
    (graph_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    picture = {graph_drawing.PICTURE_FILE} if graph_drawing.drawing_available() else set()
    assert {p.name for p in graph_dir.iterdir()} == {"before.py", "after.py", "summary.txt", "report.json", "passes",
                                                     *picture}
    report = json.loads((graph_dir / "report.json").read_text())
    assert report["sites"][0]["epilogue"] == ["bias", "silu"]
    assert set(report["sites"][0]) >= {"rule", "anchor", "anchor_op", "prologue", "epilogue", "kernel",
                                       "runs_on", "why", "m", "k", "n", "dtype"}
    assert "helion_inductor.gemm_epilogue" in (graph_dir / "after.py").read_text()
    assert "aten.addmm" in (graph_dir / "before.py").read_text()
    assert "gemm_activation" in (graph_dir / "summary.txt").read_text()

    # One dump per pass, in pipeline order: the sites it saw and left, the graph's change where it made one.
    from helion_backend.compile.passes import ANALYSIS, TRANSFORMS

    dumps = sorted((graph_dir / "passes").iterdir())
    assert [p.name for p in dumps] == [f"{i:02d}_{s.name}.txt" for i, s in enumerate([*ANALYSIS, *TRANSFORMS])]
    text = {p.name.split("_", 1)[1].removesuffix(".txt"): p.read_text() for p in dumps}
    assert text["normalize"].startswith("pass normalize: ") and " ms\n" in text["normalize"]
    assert "# sites before\n(none)" in text["normalize"] and "addmm: rule=None" in text["normalize"]
    assert "addmm: rule=gemm_activation" in text["match"].split("# sites after", 1)[1]
    assert "runs_on=reference" in text["placement"].split("# sites after", 1)[1]
    assert all(text[s.name].endswith("# graph\nunchanged\n") for s in ANALYSIS)
    rewrite_diff = text["rewrite"].split("# graph\n", 1)[1]
    assert rewrite_diff.startswith("--- before") and "+" in rewrite_diff and "gemm_epilogue" in rewrite_diff


@pytest.mark.slow
def test_debug_env_vars(tmp_path):
    result = run_python(
        """
        import torch, torch.nn.functional as F
        f = torch.compile(lambda x, w: F.relu(x @ w), backend="helion_inductor")
        f(torch.randn(4, 8), torch.randn(8, 16))
        """,
        env={"HELION_INDUCTOR_DEBUG_DIR": str(tmp_path / "dumps"), "TORCH_COMPILE_DEBUG": "1",
             "TORCH_COMPILE_DEBUG_DIR": str(tmp_path / "tcd"),
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_cache")},
        cwd=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "dumps").glob("*/report.json"))
    inductor_copies = list((tmp_path / "tcd").rglob("helion_inductor/report.json"))
    assert inductor_copies, sorted(str(p) for p in Path(tmp_path / "tcd").rglob("*"))[:40]
    # The picture, or how to get it, in both folders.
    for report in [*inductor_copies, *(tmp_path / "dumps").glob("*/report.json")]:
        assert "  picture: " in report.with_name("summary.txt").read_text()


def test_a_failing_analysis_pass_leaves_the_graph_to_inductor(monkeypatch, caplog):
    from helion_backend.compile import selection

    def broken(value, n):
        raise RuntimeError("injected matcher bug")

    monkeypatch.setattr(selection, "next_step", broken)
    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
    with caplog.at_level("WARNING"):
        out, reports = compile_run(fn, x, w, b)
    torch.testing.assert_close(out, fn(x, w, b))
    (report,) = reports
    assert report.sites == [] and "injected matcher bug" in report.error
    assert "left to Inductor" in caplog.text


def test_cudagraphs_default_follows_the_device_and_mode():
    from helion_backend.backend import _inductor_config

    cpu = [torch.randn(2, 2)]
    assert _inductor_config(None, BackendOptions.from_user({}), cpu)["triton.cudagraphs"] is False
    assert _inductor_config(None, BackendOptions.from_user({"cudagraphs": True}), cpu)["triton.cudagraphs"] is True
    patches = _inductor_config("max-autotune", BackendOptions.from_user({"inductor_config": {"max_autotune": False}}),
                               cpu)
    assert patches["max_autotune"] is False  # the user's inductor_config wins over the mode's
