"""Match: follow each GEMM's epilogue through the graph and pick the rule that fuses most of it."""

from __future__ import annotations

from typing import Sequence

from ..patterns import next_step, val
from ..rules import Rule
from .context import GemmSite, PassContext, Step

_MAX_CHAIN = 32


def run(ctx: PassContext) -> None:
    for site in ctx.sites:
        site.chain = site.leading_steps + _follow(site)
        choose_rule(site, ctx.rules)


def _follow(site: GemmSite) -> list[Step]:
    """Recognized steps after the anchor, in order, until one is not in the vocabulary."""
    steps: list[Step] = []
    value = site.leading_steps[-1].out if site.leading_steps else site.anchor
    while len(steps) < _MAX_CHAIN:
        step = next_step(value, site.n)
        if step is None or val(step.out) is None:
            break
        steps.append(step)
        value = step.out
    return steps


def choose_rule(site: GemmSite, rules: Sequence[Rule]) -> None:
    """Give ``site`` the best applicable rule (priority, then length) and cut its chain to fit.

    With no applicable rule the site keeps ``rule=None`` and a reason naming each rule's objection.
    """
    names = [s.name for s in site.chain if not s.transparent]
    best: tuple[tuple[int, int], Rule, int] | None = None
    objections = []
    for rule in rules:
        problem, accepted = _check(rule, site, names)
        if problem:
            objections.append(f"{rule.name}: {problem}")
            continue
        key = (rule.priority, accepted)
        if best is None or key > best[0]:
            best = (key, rule, accepted)
    if best is None:
        site.rule = None
        site.reason = "no rule applies (" + "; ".join(objections or ["no rules loaded"]) + ")"
        return
    _, site.rule, accepted = best
    site.reason = None
    site.chain = _cut(site.chain, accepted)


def _check(rule: Rule, site: GemmSite, names: list[str]) -> tuple[str | None, int]:
    if not rule.anchors & site.forms:
        return f"anchor {sorted(site.forms)} not in {sorted(rule.anchors)}", 0
    if site.dtype not in rule.dtypes:
        return f"dtype {site.dtype} not allowed", 0
    values = {"m": site.static_m, "k": site.k, "n": site.n}
    for constraint in rule.where:
        holds = constraint.holds(values)
        if holds is None:
            return f"'{constraint.text}' reads the dynamic m", 0
        if not holds:
            return f"'{constraint.text}' is false for m={site.m}, k={site.k}, n={site.n}", 0
    accepted = rule.accepted_prefix(names)
    leading = len(site.leading_steps)
    if accepted is None or accepted < leading:
        got = ", ".join(names) or "none"
        return f"epilogue [{got}] does not fit [{', '.join(map(str, rule.epilogue))}]", 0
    return None, accepted


def _cut(chain: list[Step], named_steps: int) -> list[Step]:
    """The shortest prefix of ``chain`` holding ``named_steps`` vocabulary steps."""
    if named_steps == 0:
        return []
    seen = 0
    for i, step in enumerate(chain):
        seen += not step.transparent
        if seen == named_steps:
            return chain[: i + 1]
    return chain
