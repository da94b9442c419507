"""Rule selection: follow a GEMM's epilogue through the graph (:func:`follow_chain`) and pick the rule that
fuses most of it (:func:`choose_rule`). The match pass runs both on every site; siblings and legality
choose again after changing a site's chain.

A quantized GEMM whose input was quantized per token just before it reads the quantized rows, and its
``token_scale`` step multiplies by their scale: Inductor computes the quantization, fused into the kernel
that produces the activation (an RMSNorm, a residual add), at no launch of its own. With the option
``fuse_activation_quant`` the GEMM takes that quantization as its prologue instead: the kernel then reads
the float activation, and the ``token_scale`` step becomes ``act_scale`` (the kernel knows that scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch.fx as fx

from helion_backend.compile.context import GemmSite
from helion_backend.compile.recognize.norm_patterns import find_rmsnorm
from helion_backend.compile.recognize.patterns import collective_between, next_step, val
from helion_backend.compile.recognize.quant_patterns import activation_quant, activation_quant_problem
from helion_backend.compile.recognize.step import Step
from helion_backend.compile.rules import Rule
from helion_backend.vocabulary import (
    ACT_SCALE,
    ACTIVATION_QUANT_STEPS,
    CAST,
    KERNEL_FAMILIES,
    QUANT_DTYPES,
    RMSNORM,
    SCALING_STEPS,
    SUPPORTED_DTYPES,
    TOKEN_SCALE,
)

_MAX_CHAIN = 32


def follow_chain(site: GemmSite, fuse_activation_quant: bool) -> None:
    """Every recognized step after the GEMM, and the RMSNorm before it if there is one; the activation
    quantization before it too where ``fuse_activation_quant`` (the option) says so."""
    site.chain = site.leading_steps + _follow(site)
    _fuse_activation_quant(site, fuse_activation_quant)
    fuse_rmsnorm(site)


def fuse_rmsnorm(site: GemmSite) -> None:
    """An RMSNorm computing a float GEMM's activation: the kernel reads the norm's input and weight and
    normalizes in its prologue. The norm's nodes stay in the graph: other readers still get it, and
    cleanup removes it once every site that read it is fused."""
    if site.prologue or site.dtype not in SUPPORTED_DTYPES.values():
        return
    found = find_rmsnorm(site.x, site.k, site.dtype)
    if isinstance(found, str):
        site.notes.append(f"RMSNorm not fused: {found}")
    elif found is not None and (collective := collective_between(*found.nodes, site.anchor)) is not None:
        site.notes.append(f"RMSNorm not fused: {collective_note(collective)} and the GEMM")
    elif found is not None:
        site.fuse_prologue(Step(RMSNORM, list(found.nodes), operand=found.weight, scalar=found.spec.eps),
                           x=found.x, rms_norm=found)


def _fuse_activation_quant(site: GemmSite, fuse: bool) -> None:
    """The per-token quantization before a quantized GEMM as its prologue, if ``fuse``; else only a note
    where it would have been fused (the recognizer still runs, so the note is true)."""
    if site.dtype not in QUANT_DTYPES.values():
        return
    i = next((i for i, step in enumerate(site.chain) if step.name == TOKEN_SCALE), None)
    # The rows' scale moves to right after the GEMM: it must commute with every step before it.
    if i is None or not all(s.transparent or s.name in SCALING_STEPS or s.name == CAST for s in site.chain[:i]):
        return
    step = site.chain[i]
    found = activation_quant(site.x, step.operand)
    if found is None:
        if site.x.op == "call_function":
            site.notes.append(f"the quantization before the GEMM is not a per-token one of the activation alone "
                              f"({activation_quant_problem(site.x, step.operand)}): the GEMM reads the quantized "
                              "activation")
        return
    name = ACTIVATION_QUANT_STEPS[found.program.quant_dtype]
    collective = collective_between(*found.nodes, site.anchor)
    if collective is not None:
        site.notes.append(f"activation quantization ({name}) not fused: {collective_note(collective)} and the GEMM")
        return
    if not fuse:
        site.notes.append(f"activation quantization ({name}) left to Inductor, which fuses it with the op producing "
                          "the activation; option fuse_activation_quant fuses it into the kernel")
        return
    chain = list(site.chain)
    chain[i] = Step(ACT_SCALE, step.nodes)
    site.fuse_prologue(
        Step(name, list(found.nodes)),
        x=found.x, quant_program=found.program, chain=chain,
    )


def _follow(site: GemmSite) -> list[Step]:
    """Recognized steps after the anchor, in order, until one is not in the vocabulary or comes after a
    collective that comes after the GEMM (the fused op, placed at the last step, would move the GEMM past it)."""
    steps: list[Step] = []
    value = site.leading_steps[-1].out if site.leading_steps else site.anchor
    checked = site.anchor
    while len(steps) < _MAX_CHAIN:
        step = next_step(value, site.n)
        if step is None or val(step.out) is None:
            break
        collective = collective_between(checked, step.out)
        if collective is not None:
            site.notes.append(f"epilogue stops before {step.out.name}: {collective_note(collective)} and the GEMM")
            break
        steps.append(step)
        value = checked = step.out
    return steps


def collective_note(collective: fx.Node) -> str:
    """Why a site leaves out what lies on the other side of ``collective`` (the note goes on: "and ...")."""
    return (f"a fused op never moves work past a collective, and {collective.name} ({collective.target}) "
            "runs between it")


def choose_rule(site: GemmSite, rules: Sequence[Rule]) -> None:
    """Give ``site`` the best applicable rule (priority, then length) and cut its chain to fit.

    A site with a prologue no rule takes (or whose epilogue lost the prologue's scale step) drops the
    prologue and tries again, unless its anchor needs it. With no applicable rule the site keeps
    ``rule=None``, a one-line reason naming the nearest rule and its objection, and every rule's objection.
    """
    if site.prologue_required and not site.prologue:  # the notes say why the prologue was dropped
        site.rule, site.reason = None, "; ".join([site.prologue_required, *site.notes])
        return
    all_rules = rules
    names = [s.name for s in site.chain if not s.transparent]
    best: tuple[tuple[int, int], Rule, int] | None = None
    objections: list[Objection] = []
    prologue = [s.name for s in site.prologue]
    if prologue and ACT_SCALE not in names and site.quantizes_per_token:
        objections.append(Objection(None, 0, f"prologue [{', '.join(prologue)}]: its scale step is not in the "
                                             "fused epilogue"))
        rules = ()
    for rule in rules:
        fit = _check(rule, site, names)
        if fit.problem:
            objections.append(Objection(rule, fit.stage, fit.problem))
            continue
        key = (rule.priority, fit.accepted)
        if best is None or key > best[0]:
            best = (key, rule, fit.accepted)
    if best is not None and site.rms_norm is not None:
        outranking = _outranks_without_norm(site, rules, names, best[0])
        if outranking is not None:  # the norm is only worth fusing where the rule the user ranks first takes it
            site.notes.append(f"RMSNorm not fused: rule {outranking.name} ranks higher and takes no prologue")
            site.drop_prologue()
            choose_rule(site, all_rules)
            return
    objections.sort(key=Objection.nearness, reverse=True)
    if best is None and site.prologue:
        site.notes.append("prologue [" + ", ".join(prologue) + "] not fused: " + _nearest(objections))
        site.drop_prologue()
        choose_rule(site, all_rules)
        return
    if best is None:
        site.rule = None
        site.reason = "no rule applies: " + _nearest(objections)
        site.objections = [str(o) for o in objections]
        return
    _, site.rule, accepted = best
    site.reason = None
    site.objections = []
    site.chain = _cut(site.chain, accepted)


@dataclass(frozen=True)
class Objection:
    """Why ``rule`` does not take a site; ``stage`` counts the checks of :func:`_check` it passed (the rule
    that passed most, then the highest ranked, is the nearest: the one a user would edit). ``rule`` is None
    for an objection to the site itself, which no rule can lift."""

    rule: Rule | None
    stage: int
    problem: str

    def nearness(self) -> tuple[int, int]:
        return (self.stage, self.rule.priority if self.rule else 0)

    def __str__(self) -> str:
        return f"{self.rule.name}: {self.problem}" if self.rule else self.problem


def _nearest(objections: Sequence[Objection]) -> str:
    """One line: the nearest rule, where it is defined, and what stopped it."""
    if not objections:
        return "no rules loaded"
    nearest = objections[0]
    if nearest.rule is None:
        return nearest.problem
    others = f" ({len(objections) - 1} other rule(s) fit less)" if len(objections) > 1 else ""
    return f"nearest rule {nearest.rule.name} ({_file_and_line(nearest.rule.source)}): {nearest.problem}{others}"


def _file_and_line(source: str) -> str:
    """``name.toml:line`` of a rule's ``path:line``."""
    path, _, line = source.rpartition(":")
    return f"{Path(path).name}:{line}"


@dataclass(frozen=True)
class _Fit:
    problem: str | None  # None: the rule takes the site
    stage: int = 0  # checks passed before the problem
    accepted: int = 0  # with no problem: how many named epilogue steps the rule fuses


def _outranks_without_norm(site: GemmSite, rules: Sequence[Rule], names: list[str],
                           key: tuple[int, int]) -> Rule | None:
    """A rule that would win over ``key`` if the site had no RMSNorm prologue, if there is one."""
    prologue, site.prologue = site.prologue, []
    try:
        for rule in rules:
            fit = _check(rule, site, names)
            if fit.problem is None and (rule.priority, fit.accepted) > key:
                return rule
    finally:
        site.prologue = prologue
    return None


def _check(rule: Rule, site: GemmSite, names: list[str]) -> _Fit:
    """Whether ``rule`` takes ``site``: checks in the order a user would fix them (the form, the dtype, the
    prologue, the shapes, the epilogue)."""
    if not rule.anchors & site.forms:
        return _Fit(f"anchor {sorted(site.forms)} not in {sorted(rule.anchors)}", 0)
    if site.dtype not in rule.dtypes:
        return _Fit(f"dtype {site.dtype} not allowed", 1)
    prologue = [s.name for s in site.prologue]
    if KERNEL_FAMILIES[rule.kernel].needs_prologue and not prologue:
        return _Fit(f"kernel {rule.kernel} needs a prologue", 2)
    if not rule.accepts_prologue(prologue):
        return _Fit(f"prologue [{', '.join(prologue)}] does not fit [{', '.join(map(str, rule.prologue))}]", 3)
    values = {"m": site.static_m, "k": site.k, "n": site.n}
    for constraint in rule.where:
        holds = constraint.holds(values)
        if holds is None:
            return _Fit(f"'{constraint.text}' reads the dynamic m", 4)
        if not holds:
            return _Fit(f"'{constraint.text}' is false for m={site.m}, k={site.k}, n={site.n}", 4)
    accepted = rule.accepted_prefix(names)
    leading = sum(not s.transparent for s in site.leading_steps)
    if accepted is None or accepted < leading:
        got = ", ".join(names) or "none"
        return _Fit(f"epilogue [{got}] does not fit [{', '.join(map(str, rule.epilogue))}]", 5)
    if site.quantizes_per_token and accepted <= names.index(ACT_SCALE):
        # The kernel rescales by the activation's scale right after the GEMM: the site must reach that step.
        return _Fit("its fused epilogue would stop before act_scale", 6)
    return _Fit(None, accepted=accepted)


def _cut(chain: list[Step], named_steps: int) -> list[Step]:
    """The prefix of ``chain`` holding ``named_steps`` vocabulary steps and the transparent steps right
    after them. Those are views of the value (a 3-D linear's reshape) or the slice that drops rows
    padded for the GEMM: the kernel computes the unpadded rows, so the site must end past that slice."""
    end = seen = 0
    for i, step in enumerate(chain):
        if not step.transparent:
            if seen == named_steps:
                break
            seen += 1
        end = i + 1
    return chain[:end]
