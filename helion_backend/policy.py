"""Where a GEMM key runs, decided from what the config tables measured: the decision and its evidence.

A key is (kernel family, GEMM input dtype, K, N, M). At every key a table holds, the tuner timed the best
Helion config against the fallback (cuBLAS + Inductor's epilogue: ``torch.compile``'s own code), so the
entry says whether Helion won and by how much (its *lead*, fallback time over Helion time). A key without
an entry borrows a verdict only from keys close enough that, over the measured tables, the borrowed
verdict picked Helion only where Helion won (:func:`leave_one_shape_out`; ``benchmarks/policy_loo.py``
prints the numbers):

- ``exact`` (``calibrated`` where option ``autotune_missing`` measured it): the key's own entry;
- ``nearest``: the same (K, N) at the timed Ms on either side of M, both led by :data:`NEAREST_MARGIN`;
- ``predicted``: every other tuned (K, N) of the family whose K and N are both within :data:`CLOSE_RATIO`
  of the key's, and that was tuned at M or above, kept Helion ahead by :data:`PREDICTED_MARGIN` at every
  tuned M up to the first one >= M; Helion then runs the config of the closest such shape;
- ``none``: nothing close enough was measured, and the site stays with Inductor (``torch.compile``'s
  speed) until the tuner measures its key.

A verdict is never extrapolated to a larger M than a shape was tuned at: Helion's lead shrinks with M.

The decision works on plain entries (no device, no Helion call), so the evaluation over the shipped table
runs on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from helion_backend.vocabulary import (
    EVIDENCE_CALIBRATED,
    EVIDENCE_EXACT,
    EVIDENCE_NEAREST,
    EVIDENCE_NONE,
    EVIDENCE_PREDICTED,
)

# Borrowing a verdict across shapes: the closest ratio and the largest lead at which leaving one shape out of
# the shipped table sent no loss to Helion (``python benchmarks/policy_loo.py --grid`` replays the evaluation;
# benchmarks/NOTES.md has its numbers). The lead also covers the timing's run-to-run spread and the borrowed
# config not being tuned for the key.
CLOSE_RATIO = 1.5
PREDICTED_MARGIN = 1.2
# Borrowing a verdict across M at one shape (leave one key out): the smallest lead of both neighbours that
# sent no loss to Helion.
NEAREST_MARGIN = 1.03


class TableKey(NamedTuple):
    """What a config table entry is keyed by: the family, the GEMM's input dtype (as the tables name it), K, N
    and M."""

    kernel: str
    dtype: str
    k: int
    n: int
    m: int

    @property
    def shape(self) -> TableShape:
        """The key without its M: a table holds the entries of one shape sorted by M."""
        return TableShape(self.kernel, self.dtype, self.k, self.n)


class TableShape(NamedTuple):
    """A :class:`TableKey` without its M."""

    kernel: str
    dtype: str
    k: int
    n: int


class Entry(NamedTuple):
    """One measured key of a shape: its M, the config that won the sweep, and what the timing said."""

    m: int
    config: Any  # a helion.Config (opaque here)
    helion_wins: bool | None  # None: not timed against the fallback
    lead: float | None = None  # fallback time / Helion time; None where either was not recorded
    calibrated: bool = False  # written by option autotune_missing at a first run
    tinygemm_lead: float | None = None  # int4: the config's time / tinygemm's; None where tinygemm was not timed


Shapes = Mapping[tuple[int, int], Sequence[Entry]]  # (K, N) -> entries sorted by M, of one family and dtype


@dataclasses.dataclass(frozen=True)
class Decision:
    """Where a key runs and why: its evidence, whether Helion runs it, the config it would run with (None:
    the default config) and the (K, N, M) of the entry the verdict comes from."""

    evidence: str
    helion: bool
    config: Any = None
    source: tuple[int, int, int] | None = None
    lead: float | None = None

    def describe(self, k: int, n: int, m: int) -> str:
        """One phrase for the site report."""
        if self.evidence == EVIDENCE_NONE:
            return (f"no config table entry at or close to M={m}, K={k}, N={n} (evidence none): cuBLAS + "
                    "Inductor's epilogue, torch.compile's own speed; `python -m helion_backend tune "
                    "<cache_dir>/manifest.json` measures the key")
        winner = "Helion" if self.helion else "cuBLAS + Inductor's epilogue"
        sk, sn, sm = self.source
        lead = f", Helion {self.lead:.2f}x" if self.lead is not None else ""
        at = f"M={sm}" if (sk, sn) == (k, n) else f"M={sm}, K={sk}, N={sn}"
        return f"{winner} measured faster at {at} (evidence {self.evidence}{lead}, config table)"


NO_EVIDENCE = Decision(EVIDENCE_NONE, False)


def decide(shapes: Shapes, k: int, n: int, m: int) -> Decision:
    """Where the key (K, N, M) of one family and dtype runs, from the entries of that family and dtype."""
    own = shapes.get((k, n), ())
    return _exact(own, k, n, m) or _nearest(own, k, n, m) or _predicted(shapes, k, n, m) or NO_EVIDENCE


def _exact(own: Sequence[Entry], k: int, n: int, m: int) -> Decision | None:
    for entry in own:
        if entry.m == m and entry.helion_wins is not None:
            evidence = EVIDENCE_CALIBRATED if entry.calibrated else EVIDENCE_EXACT
            return Decision(evidence, entry.helion_wins, entry.config, (k, n, m), entry.lead)
    return None


def _nearest(own: Sequence[Entry], k: int, n: int, m: int) -> Decision | None:
    """The timed Ms on either side of ``m`` (only the one above where ``m`` is below every timed M); None
    where no timed M is above ``m``."""
    timed = [e for e in own if e.lead is not None]
    above = next((e for e in timed if e.m > m), None)
    below = next((e for e in reversed(timed) if e.m < m), None)
    if above is None:
        return None
    weakest = min((e for e in (above, below) if e is not None), key=lambda e: e.lead)
    return Decision(EVIDENCE_NEAREST, weakest.lead >= NEAREST_MARGIN, above.config, (k, n, weakest.m),
                    weakest.lead)


def _predicted(shapes: Shapes, k: int, n: int, m: int) -> Decision | None:
    """Helion where every close shape tuned at ``m`` or above kept its lead up to there; None without one."""
    close = sorted(((distance(k, n, sk, sn), (sk, sn)) for sk, sn in shapes
                    if (sk, sn) != (k, n) and distance(k, n, sk, sn) <= math.log(CLOSE_RATIO)
                    and any(e.m >= m for e in shapes[(sk, sn)])))
    if not close:
        return None
    verdicts = [(shape, _kept_lead(shapes[shape], m)) for _, shape in close]
    for (sk, sn), (kept, entry) in verdicts:
        if not kept:
            return Decision(EVIDENCE_PREDICTED, False, None, (sk, sn, entry.m), entry.lead)
    (sk, sn), (_, entry) = verdicts[0]  # the closest shape's config at its first tuned M >= m
    return Decision(EVIDENCE_PREDICTED, True, entry.config, (sk, sn, entry.m), entry.lead)


def _kept_lead(entries: Sequence[Entry], m: int) -> tuple[bool, Entry]:
    """Whether Helion led by :data:`PREDICTED_MARGIN` at every tuned M up to the first one >= ``m``; with the
    entry that broke the lead, or else that first entry."""
    for entry in entries:
        if entry.lead is None or entry.lead < PREDICTED_MARGIN:
            return False, entry
        if entry.m >= m:
            return True, entry
    raise ValueError(f"no entry at M >= {m}")  # the caller keeps only shapes tuned there


def distance(k: int, n: int, other_k: int, other_n: int) -> float:
    """How far two shapes are: the larger of their K and N ratios, as a log."""
    return max(abs(math.log(other_k / k)), abs(math.log(other_n / n)))


# ---------------------------------------------------------------------------------------------------
# How the policy does on the measured table itself


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One held-out key: what the policy decided from the other keys, and what the table measured there."""

    family: str
    dtype: str
    k: int
    n: int
    m: int
    decision: Decision
    lead: float  # measured at the key: > 1 where Helion won

    @property
    def wrong_helion(self) -> bool:
        """Helion picked where the fallback was measured faster: the one mistake the policy must not make."""
        return self.decision.helion and self.lead <= 1.0

    @property
    def speedup(self) -> float:
        """Against torch.compile, if the borrowed verdict's config were as fast as the key's own tuned one."""
        return self.lead if self.decision.helion else 1.0


Tables = Mapping[tuple[str, str], Shapes]  # (family, dtype) -> its shapes


def leave_one_shape_out(tables: Tables) -> list[Outcome]:
    """For every tuned shape, each of its timed Ms decided from the table without that shape (what a model
    whose shape nobody tuned gets)."""
    return _held_out(tables, lambda shapes, shape, entry: {s: e for s, e in shapes.items() if s != shape})


def leave_one_key_out(tables: Tables) -> list[Outcome]:
    """For every timed key, decided from the table without that key alone (an M nobody tuned)."""
    def without(shapes: Shapes, shape: tuple[int, int], entry: Entry) -> Shapes:
        return {**shapes, shape: [e for e in shapes[shape] if e is not entry]}

    return _held_out(tables, without)


def _held_out(tables: Tables, remove: Callable[[Shapes, tuple[int, int], Entry], Shapes]) -> list[Outcome]:
    outcomes = []
    for (family, dtype), shapes in sorted(tables.items()):
        for (k, n), entries in sorted(shapes.items()):
            for entry in entries:
                if entry.lead is not None:
                    decision = decide(remove(shapes, (k, n), entry), k, n, entry.m)
                    outcomes.append(Outcome(family, dtype, k, n, entry.m, decision, entry.lead))
    return outcomes


@dataclasses.dataclass(frozen=True)
class Summary:
    keys: int
    helion: int  # keys the policy sent to Helion
    wrong_helion: int  # of them, keys where the fallback was measured faster
    worst_wrong_lead: float | None  # the slowest of those, against torch.compile
    helion_won: int  # keys where Helion won (what a perfect policy would send to Helion)
    by_evidence: dict[str, int]
    geomean_speedup: float  # over every key, torch.compile counting 1.0 (see Outcome.speedup)

    def line(self) -> str:
        evidence = ", ".join(f"{name} {count}" for name, count in sorted(self.by_evidence.items()))
        worst = "" if self.worst_wrong_lead is None else f" (worst {self.worst_wrong_lead:.2f}x)"
        return (f"{self.keys} keys: Helion at {self.helion} of the {self.helion_won} Helion won, "
                f"{self.wrong_helion} where it lost{worst}; evidence: {evidence}; "
                f"geomean {self.geomean_speedup:.3f}x torch.compile")


def summarize(outcomes: Iterable[Outcome]) -> Summary:
    outcomes = list(outcomes)
    wrong = [o.lead for o in outcomes if o.wrong_helion]
    by_evidence: dict[str, int] = {}
    for o in outcomes:
        by_evidence[o.decision.evidence] = by_evidence.get(o.decision.evidence, 0) + 1
    logs = [math.log(o.speedup) for o in outcomes]
    return Summary(
        keys=len(outcomes),
        helion=sum(o.decision.helion for o in outcomes),
        wrong_helion=len(wrong),
        worst_wrong_lead=min(wrong, default=None),
        helion_won=sum(o.lead > 1.0 for o in outcomes),
        by_evidence=by_evidence,
        geomean_speedup=math.exp(sum(logs) / len(logs)) if logs else 1.0,
    )
