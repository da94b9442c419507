"""Dynamic per-token activation quantization, kept exactly as the model wrote it.

Libraries write the same idea in many ways (``amax`` or ``max``, ``div`` or ``mul(reciprocal)``, fp32
round trips, optional clamps, different epsilons). Rather than guess a canonical formula and risk
computing something else, the matcher records the graph's own pointwise ops as a small program, and
this module replays it: on whole tensors for the reference path, on tiles inside the Helion kernel.
The program has three parts around the one reduction (an amax over K):

- ``pre(x)``: the value reduced (e.g. ``abs(x)``), per element of x;
- ``post(r)``: the per-token scale from the reduced ``r`` (e.g. ``clamp_min(r.float() / 448, 1e-12)``);
- ``quant(x, r, s)``: the quantized activation (e.g. ``clamp(x.float() / s, -448, 448).to(fp8)``).

Programs are immutable and hashed by value: Helion keys a kernel's callable arguments by their
closures, so one compiled kernel serves every site whose program is the same.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Callable

import torch

# Op names a program may hold, with how to apply each to tensors (or tiles). Constants stay Python
# numbers, as in the graph, so a replay computes in the same dtypes the graph did.
_OPS: dict[str, Callable[..., torch.Tensor]] = {
    "abs": torch.abs,
    "neg": torch.neg,
    "reciprocal": torch.reciprocal,
    "round": torch.round,
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "clamp_min": torch.clamp_min,
    "clamp_max": torch.clamp_max,
    "clamp": torch.clamp,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}
CONVERT = "convert"  # args: (value, dtype name)
REDUCE = "amax"  # the one reduction: max over the last dimension, kept as a [.., 1] column

# A value's name: "v0" is x, "v{i + 1}" instruction i's result.
Ref = str


def ref(index: int) -> Ref:
    return f"v{index}"


def index_of(name: Ref) -> int:
    return int(name[1:])


@dataclass(frozen=True)
class Value:
    """A reference to a program value inside an instruction's arguments (constants stay plain)."""

    name: Ref


@dataclass(frozen=True)
class Instruction:
    op: str
    args: tuple[Value | float | int | str | None, ...]


@dataclass(frozen=True)
class QuantProgram:
    instructions: tuple[Instruction, ...]
    reduced: Ref  # the value whose amax over K is taken (``pre``'s output)
    amax: Ref  # the reduction's result r, a [M, 1] column
    scale: Ref  # the per-token scale s
    quantized: Ref  # the quantized activation
    amax_dtype_name: str  # the dtype the graph took the amax in (exact in fp32, so kernels use fp32)

    @property
    def amax_dtype(self) -> torch.dtype:
        return getattr(torch, self.amax_dtype_name)

    @functools.cached_property
    def scale_dtype(self) -> torch.dtype:
        """The dtype the graph computed the scale in (found by running ``post`` on a meta tensor)."""
        return scale_from_amax(self, torch.empty(1, 1, dtype=self.amax_dtype, device="meta")).dtype

    @property
    def quant_dtype(self) -> torch.dtype:
        """The dtype of the quantized activation: its last op is always a convert."""
        return getattr(torch, _instruction(self, self.quantized).args[1])

    def to_json(self) -> str:
        def enc(a):
            return {"v": index_of(a.name)} if isinstance(a, Value) else a

        roles = [index_of(r) for r in (self.reduced, self.amax, self.scale, self.quantized)]
        return json.dumps({
            "ops": [[i.op, [enc(a) for a in i.args]] for i in self.instructions],
            "roles": [*roles, self.amax_dtype_name],
        }, separators=(",", ":"))


@functools.cache
def parse_program(text: str) -> QuantProgram:
    """The program a fused op carries as a JSON string (custom op arguments cannot be nested)."""
    data = json.loads(text)

    def dec(a):
        return Value(ref(a["v"])) if isinstance(a, dict) else a

    instructions = tuple(Instruction(op, tuple(dec(a) for a in args)) for op, args in data["ops"])
    *roles, amax_dtype_name = data["roles"]
    program = QuantProgram(instructions, *map(ref, roles), amax_dtype_name)
    check_program(program)
    return program


def check_program(program: QuantProgram) -> None:
    """Refuse a program that is not one per-token quantization (the matcher never builds one)."""
    n = len(program.instructions)
    for i, ins in enumerate(program.instructions):
        if ins.op not in _OPS and ins.op not in (CONVERT, REDUCE):
            raise ValueError(f"quantization program: unknown op {ins.op!r}")
        if any(isinstance(a, Value) and not 0 <= _index(a.name) <= i for a in ins.args):
            raise ValueError(f"quantization program: instruction {i} reads a value not computed before it")
    roles = [_index(r) for r in (program.amax, program.scale, program.quantized)]
    if not 0 <= _index(program.reduced) <= n or not all(0 < r <= n for r in roles):
        raise ValueError("quantization program: roles do not name its values")
    if _instruction(program, program.amax).op != REDUCE:
        raise ValueError("quantization program: the amax role must name the reduction")
    if _instruction(program, program.quantized).op != CONVERT:
        raise ValueError("quantization program: the quantized value must end in a convert")
    if ref(0) in _inputs(program, program.scale, stop={program.amax}):
        raise ValueError("quantization program: the scale must depend on x only through the amax")


def _index(name: object) -> int:
    if not isinstance(name, str) or not name.startswith("v") or not name[1:].isdigit():
        raise ValueError(f"quantization program: {name!r} is not a value name")
    return index_of(name)


def _instruction(program: QuantProgram, name: Ref) -> Instruction:
    return program.instructions[index_of(name) - 1]


def _inputs(program: QuantProgram, target: Ref, stop: set[Ref]) -> set[Ref]:
    """Every value ``target`` depends on, not looking past ``stop``."""
    seen, todo = set(), [target]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name == ref(0) or name in stop:
            continue
        todo.extend(a.name for a in _instruction(program, name).args if isinstance(a, Value))
    return seen


def _evaluate(program: QuantProgram, env: dict[Ref, torch.Tensor], target: Ref) -> torch.Tensor:
    """``target`` computed from the values in ``env`` (which it must be able to reach)."""
    if target in env:
        return env[target]
    ins = _instruction(program, target)
    args = [_evaluate(program, env, a.name) if isinstance(a, Value) else a for a in ins.args]
    if ins.op == CONVERT:
        result = args[0].to(getattr(torch, args[1]))
    elif ins.op == REDUCE:
        result = torch.amax(args[0], dim=-1, keepdim=True)
    else:
        result = _OPS[ins.op](*args)
    env[target] = result
    return result


def reduced_value(program: QuantProgram, x: torch.Tensor) -> torch.Tensor:
    """``pre(x)``: what the amax is taken over, element by element of ``x`` (a tile in kernels)."""
    return _evaluate(program, {ref(0): x}, program.reduced)


def scale_from_amax(program: QuantProgram, amax: torch.Tensor) -> torch.Tensor:
    """``post(r)``: the per-token scale from the amax column ``r`` (in the program's amax dtype)."""
    return _evaluate(program, {program.amax: amax}, program.scale)


def quantize(program: QuantProgram, x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``quant(x, r, s)``: the quantized activation for ``x`` given its row's amax and scale."""
    return _evaluate(program, {ref(0): x, program.amax: amax, program.scale: scale}, program.quantized)


def quantize_rows(program: QuantProgram, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole program on an [M, K] tensor: ``(x_quantized, scale)``, as the graph computed them."""
    env: dict[Ref, torch.Tensor] = {ref(0): x}
    _evaluate(program, env, program.quantized)
    return env[program.quantized], _evaluate(program, env, program.scale)
