"""State the passes hand to each other: one :class:`GemmSite` per GEMM in the graph, one
:class:`AttentionSite` per attention node.

Passes communicate only through a :class:`PassContext`; each pass reads what earlier passes wrote and
adds its own part (normalize: the anchor; match: the chain and the rule; legality: the final chain or
the reason not to fuse; placement: where it runs; shared_input: the launch it shares; rewrite: the
fused node; attention and attention_rewrite: the same for attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

import torch
import torch.fx as fx

from helion_backend.compile.recognize.step import Step
from helion_backend.vocabulary import ACTIVATION_QUANT_STEPS, TOKEN_SCALE

if TYPE_CHECKING:
    from helion_backend.compile.recognize.norm_patterns import RmsNormMatch
    from helion_backend.compile.rules import Rule
    from helion_backend.options import BackendOptions
    from helion_backend.report import GraphReport
    from helion_backend.semantics.quant_program import QuantProgram

Dim = Union[int, torch.SymInt]


def token_scale(steps: Sequence[Step]) -> fx.Node | None:
    """The [M, 1] scale that ``steps`` (a quantized GEMM's) multiply its rows by, if any."""
    return next((step.operand for step in steps if step.name == TOKEN_SCALE), None)


def with_token_scale(steps: Sequence[Step], scale: fx.Node) -> list[Step]:
    """``steps`` rescaling by ``scale`` instead of their own token scale: sites proven to read equal
    quantized rows read one quantization (the fused op reads it), and the others are left dead."""
    return [replace(step, operand=scale) if step.name == TOKEN_SCALE else step for step in steps]


@dataclass
class GemmSite:
    """A GEMM anchor and what the passes learned about it."""

    anchor: fx.Node
    forms: frozenset[str]  # anchor vocabulary names this GEMM answers to (mm / addmm / linear)
    x: fx.Node  # the [M, K] activation (with a fused activation quantization: its float input)
    weight: fx.Node  # the weight tensor as stored (with a fused dequantization: the int8 tensor)
    weight_layout: str  # "kn" (used as is) or "nk" (seen through permute([1, 0]))
    m: Dim
    k: int
    n: int
    dtype: torch.dtype  # the GEMM's input dtype (float8_e4m3fn/int8 for a quantized GEMM)
    device: torch.device
    gemm_input: fx.Node  # the activation the GEMM multiplies, before any prologue and padding
    leading_steps: list[Step] = field(default_factory=list)  # addmm's bias, _scaled_mm's scales
    chain: list[Step] = field(default_factory=list)
    # Fused prologue steps, and for an activation quantization its program (x is then the float input).
    prologue: list[Step] = field(default_factory=list)
    quant_program: QuantProgram | None = None
    # The scales a weight dequantization reads besides the weight (dequant_int4: [N, K/G] group scales;
    # dequant_int4_zp: [N, K/G, 2] group scales and zero points;
    # dequant_fp8_block: [N/128, K/128] block scales, or with weight_scale_kn [K/128, N/128] ones, which the
    # rewrite passes transposed).
    weight_scale: fx.Node | None = None
    weight_scale_kn: bool = False
    # Why the anchor cannot run without the prologue (_scaled_mm's block scales are applied only by it):
    # dropping the prologue then leaves the site unfused, with this reason.
    prologue_required: str | None = None
    # A fused RMSNorm (x is then the norm's input): its weight, spec and the view to [M, K], if any.
    rms_norm: RmsNormMatch | None = None
    # A gated MLP's up projection, multiplied in by the ``up_mul`` step: its weight as stored, and layout.
    up_weight: fx.Node | None = None
    up_layout: str = "nk"
    up_anchor: fx.Node | None = None  # the up projection's GEMM node (for the report's picture)
    # The up projection's own steps before the product (on quantized rows: its token and channel scales).
    up_steps: list[Step] = field(default_factory=list)
    # What fusing the prologue changed (attribute -> old value): undone when no rule takes it.
    undo_prologue: list[dict[str, object]] = field(default_factory=list)
    rule: Rule | None = None
    reason: str | None = None  # why no rule applies, or why the site is not rewritten
    objections: list[str] = field(default_factory=list)  # with no rule applying: each rule's, nearest first
    notes: list[str] = field(default_factory=list)  # what legality cut, and why
    runs_on: str = "inductor"
    max_helion_m: int = 0  # the largest M that runs the Helion kernel (set by placement)
    # What placement's decision rests on at each M it checked (M as text -> an EVIDENCE word), and whether some
    # M had no measurement at all (the manifest then lists the site, for the tuner).
    evidence: dict[str, str] = field(default_factory=dict)
    untuned: bool = False
    # The sites of the same activation this one shares a launch with (passes/shared_input.py), itself included.
    group: SiteGroup | None = field(default=None, repr=False, compare=False)
    fused: fx.Node | None = None

    def fuse_prologue(self, step: Step, **changes: object) -> None:
        """Take ``step`` into the prologue, changing operands or chain steps as ``changes`` say."""
        self.undo_prologue.append({name: getattr(self, name) for name in changes})
        self.prologue = [*self.prologue, step]
        for name, value in changes.items():
            setattr(self, name, value)

    def drop_prologue(self) -> None:
        """Put the operands back as they were before any prologue was fused. A chain step the prologue
        renamed (``act_scale``) gets its original back, wherever legality has cut the chain since."""
        for changes in reversed(self.undo_prologue):
            for name, value in changes.items():
                if name == "chain":
                    originals = {id(new): old for new, old in zip(self.chain, value) if new is not old}
                    value = [originals.get(id(step), step) for step in self.chain]
                setattr(self, name, value)
        self.prologue, self.quant_program, self.rms_norm, self.undo_prologue = [], None, None, []

    @property
    def quantizes_per_token(self) -> bool:
        """Whether the prologue quantizes the activation per token (its scale is then the ``act_scale`` step)."""
        return any(step.name in ACTIVATION_QUANT_STEPS.values() for step in self.prologue)

    @property
    def steps(self) -> list[Step]:
        return [s for s in self.chain if not s.transparent]

    @property
    def output(self) -> fx.Node:
        return self.chain[-1].out if self.chain else self.anchor

    @property
    def static_m(self) -> int | None:
        return self.m if isinstance(self.m, int) else None


@dataclass(eq=False)
class SiteGroup:
    """Sites that read one activation and run in one launch, in graph order, and the launch's family
    (``gemm_multi`` or a quantized variant, :data:`~helion_backend.vocabulary.MULTI_GEMM_FAMILIES`)."""

    sites: list[GemmSite]
    family: str


@dataclass
class AttentionSite:
    """A ``scaled_dot_product_attention`` node (one of :data:`~helion_backend.vocabulary.SDPA_OPS`), read
    through its output 0, and where it runs."""

    node: fx.Node
    output: fx.Node  # the node's ``getitem(.., 0)``
    query: fx.Node
    key: fx.Node  # the node's key, or what it repeated for the query heads of each group (repeat_kv)
    value: fx.Node
    mask: fx.Node | None  # boolean (True attends) or an additive float bias
    mask_kind: str  # "none" | "bool" | "bias"
    masked_bias: float  # what a boolean mask's masked positions add to their logits (-inf: they drop out)
    scale: float
    shape: tuple[object, ...]  # batch, heads, key/value heads, query rows, cache length, head dim (int or SymInt)
    dtype: torch.dtype
    runs_on: str = "inductor"
    reason: str | None = None
    fused: fx.Node | None = None


def tf32_matmuls_allowed() -> bool:
    """Whether PyTorch lets float32 CUDA matmuls use TF32 (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` sets too)."""
    return bool(torch.backends.cuda.matmul.allow_tf32)


@dataclass
class PassContext:
    graph: fx.Graph
    options: BackendOptions
    rules: list[Rule]
    report: GraphReport
    # Whether PyTorch's float32 CUDA matmuls may use TF32 (read once per compile: part of the pass uuid).
    tf32: bool = False
    sites: list[GemmSite] = field(default_factory=list)
    # GEMM nodes no rule can anchor on, with the reason (the report's ``unfused_gemms``).
    unanchored: list[tuple[fx.Node, str]] = field(default_factory=list)
    attention: list[AttentionSite] = field(default_factory=list)
    # Shared launches kept apart for want of any measurement of their key: the tuner's manifest lists them.
    untuned_groups: list[SiteGroup] = field(default_factory=list)
