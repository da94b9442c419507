"""``<cache_dir>/reports`` stays bounded: the newest reports by use are kept, old ones are deleted."""

from __future__ import annotations

import os
import time

import torch
from helpers import CPU_REWRITE, compile_run

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
