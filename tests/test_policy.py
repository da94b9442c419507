"""The placement policy for keys without an exact entry, replayed on the shipped H200 table: a shape or key
held out is sent to Helion only where the table measured Helion faster there (benchmarks/policy_loo.py)."""

import json
import re
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import policy_loo  # noqa: E402
from helion_backend import policy  # noqa: E402


@pytest.fixture(scope="module")
def shipped() -> policy.Tables:
    return policy_loo.load_tables(policy_loo.SHIPPED)


@pytest.mark.parametrize("held_out", [policy.leave_one_shape_out, policy.leave_one_key_out])
def test_held_out_keys_go_to_helion_only_where_helion_won(shipped, held_out):
    outcomes = held_out(shipped)
    summary = policy.summarize(outcomes)
    assert summary.keys == sum(len(entries) for shapes in shipped.values() for entries in shapes.values())
    wrong = [(o.family, o.k, o.n, o.m, round(o.lead, 2), o.decision.source) for o in outcomes if o.wrong_helion]
    assert wrong == []
    # Not by sending nothing to Helion: the policy finds a share of the wins it was not told about.
    assert summary.helion >= summary.helion_won // 4 and summary.geomean_speedup > 1.1, summary.line()


def test_a_looser_policy_would_have_picked_losses(shipped):
    """The margins are what keeps the held-out shapes right: without them the same replay picks losses."""
    with mock.patch.object(policy, "PREDICTED_MARGIN", 1.0):
        loose = policy.summarize(policy.leave_one_shape_out(shipped))
    assert loose.wrong_helion > 0 and loose.worst_wrong_lead < 0.9


def test_the_report_names_every_family(shipped, capsys):
    policy_loo.main([])
    out = capsys.readouterr().out
    assert re.match(r"leave one shape out: \d+ keys: Helion at \d+ of the \d+ Helion won, 0 where it lost", out)
    assert all(f"  {family} {dtype}: " in out for family, dtype in shipped)
    assert "Helion where it lost" not in out


def test_the_placement_cost_decides_every_decoder_key_at_every_decode_m():
    """``policy_loo.py --cost`` (what the policy adds to a first compile) decides each of the Llama-3.1-8B
    decoder's keys at M = 1 ... 32 in bf16 and fp8, on evidence the shipped table holds for some of them."""
    line = policy_loo.placement_cost(policy_loo.SHIPPED, repeats=1)
    decisions = int(re.search(r"(\d+) decisions", line).group(1))
    assert decisions == 2 * len(policy_loo.LLAMA_3_1_8B_KEYS) * 32, line
    assert re.search(r"exact [1-9]", line), line


COMMITTED_RESULTS = (ROOT / "benchmarks/results/popular/nvidia_h200_bf16.json",
                     ROOT / "benchmarks/results/held_out/leave_one_family_out/nvidia_h200_bf16.json")


@pytest.mark.parametrize("results", COMMITTED_RESULTS, ids=lambda p: p.parent.name)
def test_the_committed_results_ran_where_the_shipped_table_places_them(results):
    """The committed bf16 results (tuned, and each family held out) still stand for the shipped table and
    policy: replaying the placement moves none of their rows. A change of either that moves a row must
    re-run the benchmark."""
    lines = policy_loo.replay(policy_loo.SHIPPED, results)
    assert re.search(r": [1-9]\d* rows .* 0 placed elsewhere", lines[0]), "\n".join(lines)


def test_the_replay_names_a_row_that_ran_elsewhere(tmp_path):
    """A row recorded as run by Inductor where the table now places Helion is listed, with its evidence."""
    results = json.loads(COMMITTED_RESULTS[0].read_text())
    row = next(r for r in results["rows"] if r["helion_sites"].startswith("helion") and r["m"] == 1)
    row["helion_sites"] = "inductor (as if an older table had placed it there)"
    edited = tmp_path / "results.json"
    edited.write_text(json.dumps(results))
    lines = policy_loo.replay(policy_loo.SHIPPED, edited)
    assert " 1 placed elsewhere" in lines[0], lines
    assert lines[1].startswith(f"  {row['suite']} {row['name']} M=1: ran Inductor, now Helion (exact)"), lines
