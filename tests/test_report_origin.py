"""The report leads back to the model: each site names its module and source line, the rewritten graph keeps
the model's stack trace, an unfused GEMM says in one line which rule came nearest and what stopped it, and the
headline counts sites by where they run."""

from __future__ import annotations

import inspect
import json

import torch
import torch.nn as nn
from helpers import CPU_REWRITE, compile_run, rel_err, sites

from helion_backend.report import GraphReport


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))  # the line the report must name


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


BLOCK_LINE = f"{__name__.rpartition('.')[2]}.py:{inspect.getsourcelines(Block.forward)[1] + 1}"


def test_sites_name_their_module_and_source_line(tmp_path, no_compile_caches):
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(8, 64)
    with torch.no_grad():
        out, reports = compile_run(model, x, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
        ref = model.double()(x.double())
    assert rel_err(out, ref) < 1e-4
    found = sites(reports)
    assert [s.module for s in found] == ["layers.0.up", "layers.0.down", "layers.1.up", "layers.1.down"]
    assert {s.source for s in found} == {BLOCK_LINE}
    (report,) = reports
    assert f"] layers.1.down ({found[3].anchor}, {BLOCK_LINE}): addmm -> bias -> residual" in report.summary()
    saved = json.loads((tmp_path / report.graph / "report.json").read_text())
    assert [s["module"] for s in saved["sites"]] == [s.module for s in found]


def test_the_fused_op_keeps_the_models_stack_trace(tmp_path, no_compile_caches):
    model, x = Model().eval(), torch.randn(4, 64)
    with torch.no_grad():
        _, (report,) = compile_run(model, x, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    after = (tmp_path / report.graph / "after.py").read_text().splitlines()
    fused = [i for i, line in enumerate(after) if "helion_inductor.gemm_epilogue" in line]
    assert len(fused) == 4
    for i in fused:  # print_readable puts the node's origin in a comment above it
        origin = next(line for line in reversed(after[:i]) if line.strip().startswith("#"))
        assert "No stacktrace found" not in origin and f"{__file__}:{BLOCK_LINE.rpartition(':')[2]}" in origin, origin


def test_the_headline_counts_sites_by_where_they_run():
    model, x = Block().eval(), torch.randn(4, 64)
    with torch.no_grad():
        _, (reference,) = compile_run(model, x)
        _, (inductor,) = compile_run(model, x, options={})
    assert reference.headline().endswith(": 2 site(s) (2 reference), 0 unfused GEMM(s)")
    assert inductor.headline().endswith(": 2 site(s) (2 inductor), 0 unfused GEMM(s)")


def test_an_unfused_gemm_names_the_nearest_rule_in_one_line(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "any_mm"\nanchor = ["mm"]\ndtypes = ["float16"]\n\n'
                     '[[rule]]\nname = "wide_only"\nanchor = ["mm"]\ndtypes = ["bfloat16"]\npriority = 5\n'
                     '[[rule]]\nname = "on_addmm"\nanchor = ["addmm"]\n')
    x, w = torch.randn(8, 32), torch.randn(32, 48)
    out, (report,) = compile_run(lambda x, w: torch.relu(x @ w), x, w,
                                 options={**CPU_REWRITE, "builtin_rules": False, "rules": [str(rules)]})
    torch.testing.assert_close(out, torch.relu(x @ w))
    (unfused,) = report.unfused_gemms
    assert unfused.reason.startswith("no rule applies: nearest rule wide_only (rules.toml:6): dtype torch.float32 "
                                     "not allowed")
    assert "\n" not in unfused.reason and len(unfused.reason) < 160, unfused.reason
    assert [o.split(":")[0] for o in unfused.rules_tried] == ["wide_only", "any_mm", "on_addmm"]


def test_the_nearest_rule_is_the_one_that_passed_most_checks(tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "wide_only"\nanchor = ["mm"]\nwhere = ["n % 1024 == 0"]\n'
                     'epilogue = ["relu?"]\npriority = 5\n\n'
                     '[[rule]]\nname = "on_addmm"\nanchor = ["addmm"]\npriority = 50\n')
    x, w = torch.randn(8, 32), torch.randn(32, 48)
    _, (report,) = compile_run(lambda x, w: torch.relu(x @ w), x, w,
                               options={**CPU_REWRITE, "builtin_rules": False, "rules": [str(rules)]})
    (unfused,) = report.unfused_gemms
    assert unfused.reason == ("no rule applies: nearest rule wide_only (rules.toml:1): 'n % 1024 == 0' is false "
                              "for m=8, k=32, n=48 (1 other rule(s) fit less)")
    assert unfused.rules_tried[1].startswith("on_addmm: anchor ['mm'] not in ['addmm']")
    assert f"unfused {unfused.node} (aten.mm.default, {unfused.source}): no rule applies: nearest rule wide_only" \
        in report.summary()


def test_a_report_saved_before_the_new_fields_still_loads():
    old = {"graph": "graph_007", "kind": "inference",
           "sites": [{"rule": "r", "anchor": "addmm", "anchor_op": "aten.addmm.default", "prologue": [],
                      "epilogue": ["bias"], "kernel": "gemm", "runs_on": "helion", "why": None, "m": 8, "k": 64,
                      "n": 64, "dtype": "bfloat16", "notes": [], "fallbacks": []}],
           "unfused_gemms": [{"node": "mm", "op": "aten.mm.default", "reason": "no rule applies (...)"}]}
    report = GraphReport.from_json(old)
    assert report.sites[0].module == "" and report.unfused_gemms[0].rules_tried == []
    assert report.summary().splitlines()[1].startswith("  [r] addmm: addmm -> bias")
