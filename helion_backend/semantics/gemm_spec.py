"""The one description of a fused GEMM call: everything but its tensors, as a frozen dataclass.

The rewrite builds a :class:`GemmSpec` per rewritten site and hands it to the fused op as one string
(:meth:`GemmSpec.to_key`: deterministic, so the FX graph cache sees the same graph for the same site);
the op's run-time side and its fake parse it back with :meth:`GemmSpec.from_key`, once per distinct
string and process. The manifest entry and the report's site line are derived from it too.

A spec describes one launch: a single GEMM (one output; optionally a gated MLP's up projection) or a
shared launch of several GEMMs of one activation (one weight layout and one epilogue per output).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

import torch

from helion_backend.semantics.norm import RmsNormSpec, parse_spec
from helion_backend.semantics.quant_program import QuantProgram, parse_program
from helion_backend.vocabulary import (
    DEQUANT_FP8_BLOCK,
    DEQUANT_INT4,
    DEQUANT_INT4_ZP,
    EPILOGUE_STEPS,
    KERNEL_FAMILIES,
    MULTI_GEMM_FAMILIES,
    MULTI_GEMM_SLOTS,
    PROLOGUE_STEPS,
    RMSNORM,
    dtype_name,
)

WEIGHT_LAYOUTS = ("kn", "nk")  # a [K, N] weight used as is; an nn.Linear [N, K] weight seen transposed
# Prologue steps that read the weight's scales besides the weight (the op's ``weight_scale``).
SCALED_WEIGHT_STEPS = (DEQUANT_INT4, DEQUANT_INT4_ZP, DEQUANT_FP8_BLOCK)
_KERNELS = (*KERNEL_FAMILIES, *MULTI_GEMM_FAMILIES.values())


class SpecError(ValueError):
    """A spec that cannot describe a fused call; the message names the field and the problem."""


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """Everything non-tensor a fused GEMM call needs.

    ``weight_layouts`` and ``epilogues`` hold one entry per output (a single GEMM has one); ``scalars``
    are every epilogue's Python scalars in turn (then the up projection's). ``up_layout`` is a gated MLP's
    up projection's layout (None: no up projection), ``up_epilogue`` its own steps before the product.
    ``norm`` is a fused RMSNorm's spec (the ``rmsnorm`` prologue step's). Rows up to ``max_helion_m`` run
    the ``kernel`` family's Helion kernel, with configs from ``config_dir`` (user-tuned; "" for none)
    first; ``site`` names the site in the report (``graph:anchor``). ``frozen_weights`` is the option's: the
    site may keep its weight in another layout (int4: tinygemm's).
    """

    kernel: str
    out_dtype: torch.dtype
    weight_layouts: tuple[str, ...]
    epilogues: tuple[tuple[str, ...], ...]
    scalars: tuple[float, ...] = ()
    prologue: tuple[str, ...] = ()
    quant_program: QuantProgram | None = None
    up_layout: str | None = None
    up_epilogue: tuple[str, ...] = ()
    norm: RmsNormSpec | None = None
    max_helion_m: int = 0
    config_dir: str = ""
    site: str = ""
    frozen_weights: bool = False  # option frozen_weights: the site may keep its weight in another form

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem is not None:
            raise SpecError(f"fused GEMM spec of site {self.site or '<unnamed>'}: {problem}")

    @property
    def outputs(self) -> int:
        return len(self.weight_layouts)

    @property
    def epilogue(self) -> tuple[str, ...]:
        """A single GEMM's epilogue (a shared launch has one per output: :attr:`epilogues`)."""
        if self.outputs != 1:
            raise SpecError(f"a shared launch of {self.outputs} outputs has one epilogue per output")
        return self.epilogues[0]

    @property
    def steps(self) -> tuple[str, ...]:
        """Every output's epilogue steps in turn (as the manifest records a launch)."""
        return tuple(step for steps in self.epilogues for step in steps)

    def to_key(self) -> str:
        """The spec as the op's one string argument: compact JSON with sorted keys."""
        return json.dumps(_to_json(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> GemmSpec:
        """The spec :meth:`to_key` wrote; parsed once per distinct string. Raises :class:`SpecError` saying
        what is wrong with a garbled key."""
        return _from_key(key)


def _problem(spec: GemmSpec) -> str | None:
    """What makes ``spec`` inconsistent, or None."""
    if spec.kernel not in _KERNELS:
        return f"unknown kernel family {spec.kernel!r}; valid: {list(_KERNELS)}"
    if not isinstance(spec.out_dtype, torch.dtype):
        return f"out_dtype must be a torch.dtype, got {spec.out_dtype!r}"
    if not 1 <= len(spec.weight_layouts) <= MULTI_GEMM_SLOTS or len(spec.epilogues) != len(spec.weight_layouts):
        return (f"expected 1 to {MULTI_GEMM_SLOTS} weight layouts with one epilogue each, got "
                f"{list(spec.weight_layouts)} and {len(spec.epilogues)} epilogue(s)")
    layouts = [*spec.weight_layouts, *([spec.up_layout] if spec.up_layout is not None else [])]
    bad_layout = next((layout for layout in layouts if layout not in WEIGHT_LAYOUTS), None)
    if bad_layout is not None:
        return f"weight layout must be one of {list(WEIGHT_LAYOUTS)}, got {bad_layout!r}"
    for what, steps, vocabulary in (("prologue", spec.prologue, PROLOGUE_STEPS),
                                    *(("epilogue", s, EPILOGUE_STEPS) for s in (*spec.epilogues, spec.up_epilogue))):
        unknown = [step for step in steps if step not in vocabulary]
        if unknown:
            return f"unknown {what} step(s) {unknown}; valid: {sorted(vocabulary)}"
    if spec.up_epilogue and spec.up_layout is None:
        return f"up_epilogue {list(spec.up_epilogue)} without an up projection"
    if spec.up_layout is not None and spec.outputs != 1:
        return "an up projection belongs to a single GEMM, not to a shared launch"
    if (RMSNORM in spec.prologue) != (spec.norm is not None):
        return f"the {RMSNORM} prologue step and the norm spec go together (prologue {list(spec.prologue)}, " \
               f"norm {spec.norm})"
    scaled = [step for step in spec.prologue if step in SCALED_WEIGHT_STEPS]
    if scaled and spec.weight_layouts != ("nk",):
        return f"prologue {scaled} reads [N, ..] weights, got weight layouts {list(spec.weight_layouts)}"
    if DEQUANT_FP8_BLOCK in spec.prologue and spec.quant_program is None:
        return f"prologue {DEQUANT_FP8_BLOCK} needs the activation groups' quant_program"
    if not isinstance(spec.max_helion_m, int) or spec.max_helion_m < 0:
        return f"max_helion_m must be an integer >= 0, got {spec.max_helion_m!r}"
    return None


_FIELDS = frozenset(field.name for field in dataclasses.fields(GemmSpec))


def _to_json(spec: GemmSpec) -> dict[str, Any]:
    program = spec.quant_program
    return {
        "kernel": spec.kernel,
        "out_dtype": dtype_name(spec.out_dtype),
        "weight_layouts": list(spec.weight_layouts),
        "epilogues": [list(steps) for steps in spec.epilogues],
        "scalars": list(spec.scalars),
        "prologue": list(spec.prologue),
        "quant_program": None if program is None else json.loads(program.to_json()),
        "up_layout": spec.up_layout,
        "up_epilogue": list(spec.up_epilogue),
        "norm": None if spec.norm is None else json.loads(spec.norm.to_json()),
        "max_helion_m": spec.max_helion_m,
        "config_dir": spec.config_dir,
        "site": spec.site,
        "frozen_weights": spec.frozen_weights,
    }


@functools.cache
def _from_key(key: str) -> GemmSpec:
    try:
        data = json.loads(key)
    except (TypeError, ValueError) as e:
        raise SpecError(f"fused GEMM spec {key!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise SpecError(f"fused GEMM spec {key!r} must be a JSON object")
    unknown, missing = sorted(data.keys() - _FIELDS), sorted(_FIELDS - data.keys())
    if unknown or missing:
        raise SpecError(f"fused GEMM spec {key!r}: " + "; ".join(
            [*([f"unknown field(s) {unknown}"] if unknown else []), *([f"missing field(s) {missing}"] if missing else [])]))
    try:
        return GemmSpec(
            kernel=_typed(data, "kernel", str),
            out_dtype=_dtype(data["out_dtype"]),
            weight_layouts=_strings(data, "weight_layouts"),
            epilogues=tuple(_strings({"epilogues": steps}, "epilogues") for steps in _list(data, "epilogues")),
            scalars=tuple(float(_typed({"scalars": s}, "scalars", (int, float))) for s in _list(data, "scalars")),
            prologue=_strings(data, "prologue"),
            quant_program=None if data["quant_program"] is None else parse_program(json.dumps(data["quant_program"])),
            up_layout=None if data["up_layout"] is None else _typed(data, "up_layout", str),
            up_epilogue=_strings(data, "up_epilogue"),
            norm=None if data["norm"] is None else parse_spec(json.dumps(data["norm"])),
            max_helion_m=_typed(data, "max_helion_m", int),
            config_dir=_typed(data, "config_dir", str),
            site=_typed(data, "site", str),
            frozen_weights=_flag(data, "frozen_weights"),
        )
    except SpecError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise SpecError(f"fused GEMM spec {key!r}: {e}") from None


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data[name]
    if not isinstance(value, bool):
        raise ValueError(f"field {name!r} must be true or false: {value!r}")
    return value


def _typed(data: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"field {name!r} has the wrong type: {value!r}")
    return value


def _list(data: dict[str, Any], name: str) -> list[Any]:
    if not isinstance(data[name], list):
        raise ValueError(f"field {name!r} must be a list, got {data[name]!r}")
    return data[name]


def _strings(data: dict[str, Any], name: str) -> tuple[str, ...]:
    values = _list(data, name)
    if not all(isinstance(value, str) for value in values):
        raise ValueError(f"field {name!r} must list strings, got {values!r}")
    return tuple(values)


def _dtype(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"field 'out_dtype' must name a torch dtype, got {name!r}")
    return dtype
