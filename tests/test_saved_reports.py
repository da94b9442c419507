"""``<cache_dir>/reports`` stays bounded: the newest reports by use are kept, old ones are deleted; a report served
from it names its graph afresh."""

from __future__ import annotations

import os
import time

import torch
from helpers import CPU_REWRITE, compile_run

import helion_backend
from helion_backend.backend import prune_saved_reports
from helion_backend.options import SAVED_REPORTS_MAX_AGE_DAYS


def _aged(path, days: float):
    path.write_text("{}")
    then = time.time() - days * 86400
    os.utime(path, (then, then))
    return path


def test_prune_keeps_the_most_recently_used_and_drops_the_old(tmp_path):
    files = [_aged(tmp_path / f"{i}.json", days=i) for i in range(6)]  # 0.json is the newest
    assert sorted(prune_saved_reports(tmp_path, keep=4, max_age_days=3.5)) == sorted(files[4:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.json", "1.json", "2.json", "3.json"]
    assert sorted(prune_saved_reports(tmp_path, keep=2, max_age_days=100)) == sorted(files[2:4])


def test_a_compile_prunes_the_saved_reports(tmp_path, no_compile_caches):
    reports = tmp_path / "reports"
    reports.mkdir()
    old = [_aged(reports / f"old{i}.json", days=SAVED_REPORTS_MAX_AGE_DAYS + 1) for i in range(3)]
    recent = _aged(reports / "recent.json", days=1)
    x, w = torch.randn(4, 16), torch.randn(16, 8)
    out, _ = compile_run(lambda x, w: torch.relu(x @ w), x, w, options={**CPU_REWRITE, "cache_dir": str(tmp_path)})
    torch.testing.assert_close(out, torch.relu(x @ w))
    assert not any(p.exists() for p in old) and recent.exists()
    assert len(list(reports.glob("*.json"))) == 2  # the recent one and this compile's


def test_a_graph_served_from_the_fx_graph_cache_gets_a_name_of_its_own(tmp_path):
    """The served report would otherwise keep the name its graph had in the compile that filled the cache, which
    another graph of this process can have too (two ``graph_040`` in one report list, one dump folder)."""
    from torch._dynamo.utils import counters

    x, w = torch.randn(4, 16), torch.randn(16, 8)
    fn = lambda x, w: torch.relu(x @ w)  # noqa: E731
    options = {**CPU_REWRITE, "cache_dir": str(tmp_path / "cache"), "debug_dir": str(tmp_path / "dumps")}
    compile_run(fn, x, w, options=options)
    (rewritten,) = helion_backend.get_reports()
    torch._dynamo.reset()
    counters.clear()
    helion_backend.clear_reports()
    out, (served,) = compile_run(fn, x, w, options=options)
    assert counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"] >= 1
    torch.testing.assert_close(out, torch.relu(x @ w))
    assert served.from_cache and not rewritten.from_cache
    assert served.graph != rewritten.graph and served.cached_from == rewritten.graph
    assert served.headline().startswith(f"graph {served.graph} (inference, from FX graph cache: {rewritten.graph})")
    # Its fused op still names the site by the filling compile's graph: run-time events find the served report.
    assert helion_backend.report.find_site(f"{rewritten.graph}:{served.sites[0].anchor}") is served.sites[0]
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == sorted([rewritten.graph, served.graph])
