"""Epilogue semantics, written once and shared by the reference path and the Helion kernels.

An epilogue is an ordered tuple of step names from :mod:`helion_backend.vocabulary`. It is applied to
the fp32 accumulator; steps that read a tensor take the next entry of ``operands`` and steps that
read a scalar take the next entry of ``scalars``, both in step order.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence, TypeVar

import torch

from helion_backend.vocabulary import (
    ACTIVATIONS,
    EPILOGUE_STEPS,
    GELU,
    GELU_TANH,
    PROLOGUE_STEPS,
    RELU,
    SIGMOID,
    SILU,
    UP_MUL,
    Operand,
)

T = TypeVar("T")

# fp32 formulas for the activations, written with the elementary ops that both eager PyTorch and
# Helion's device code lower (so one definition serves the reference and the kernel).
_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def _gelu(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1.0 + torch.erf(v * _SQRT_HALF))


def _gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    inner = _SQRT_2_OVER_PI * (v + 0.044715 * v * v * v)
    return 0.5 * v * (1.0 + torch.tanh(inner))


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v * torch.sigmoid(v)


def _relu(v: torch.Tensor) -> torch.Tensor:
    return torch.relu(v)


ACTIVATION_FORMULAS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    RELU: _relu,
    GELU: _gelu,
    GELU_TANH: _gelu_tanh,
    SILU: _silu,
    SIGMOID: torch.sigmoid,
}
assert tuple(ACTIVATION_FORMULAS) == ACTIVATIONS


@functools.cache
def parse_epilogue(spec: str) -> tuple[str, ...]:
    """``"bias,gelu_tanh"`` -> ``("bias", "gelu_tanh")``; the op carries epilogues as such strings."""
    return _parse_steps(spec, EPILOGUE_STEPS, "epilogue")


@functools.cache
def parse_prologue(spec: str) -> tuple[str, ...]:
    return _parse_steps(spec, PROLOGUE_STEPS, "prologue")


def _parse_steps(spec: str, vocabulary: dict, what: str) -> tuple[str, ...]:
    steps = tuple(s for s in spec.split(",") if s)
    unknown = [s for s in steps if s not in vocabulary]
    if unknown:
        raise ValueError(f"unknown {what} step(s) {unknown}; valid: {sorted(vocabulary)}")
    return steps


def format_steps(steps: Sequence[str]) -> str:
    """How the fused op carries a prologue or an epilogue: step names joined by commas."""
    return ",".join(steps)


# Between the outputs' epilogues where one op carries several (``"bias;;residual"``: three outputs).
OUTPUT_SEPARATOR = ";"


def format_epilogues(epilogues: Sequence[Sequence[str]]) -> str:
    return OUTPUT_SEPARATOR.join(map(format_steps, epilogues))


@functools.cache
def parse_epilogues(spec: str) -> tuple[tuple[str, ...], ...]:
    return tuple(parse_epilogue(part) for part in spec.split(OUTPUT_SEPARATOR))


def split_per_output(
    epilogues: Sequence[Sequence[str]], operands: Sequence[T], scalars: Sequence[float]
) -> list[tuple[list[T], list[float]]]:
    """Each output's tensor operands and scalars, from lists that hold every output's in turn; refuses
    counts that differ from what the epilogues read."""
    per_output, next_operand, next_scalar = [], 0, 0
    for steps in epilogues:
        n_operands, n_scalars = len(operand_kinds(steps)), num_scalars(steps)
        per_output.append((list(operands[next_operand:next_operand + n_operands]),
                           list(scalars[next_scalar:next_scalar + n_scalars])))
        next_operand, next_scalar = next_operand + n_operands, next_scalar + n_scalars
    if (next_operand, next_scalar) != (len(operands), len(scalars)):
        raise ValueError(f"epilogues {[list(s) for s in epilogues]} read {next_operand} tensor operand(s) and "
                         f"{next_scalar} scalar(s), got {len(operands)} and {len(scalars)}")
    return per_output


TENSOR_OPERANDS = (Operand.ROW, Operand.COL, Operand.ELEMENT, Operand.FULL)


def operand_kinds(steps: Sequence[str]) -> list[Operand]:
    """The tensor operands an epilogue reads, in the order it reads them."""
    return [EPILOGUE_STEPS[s].operand for s in steps if EPILOGUE_STEPS[s].operand in TENSOR_OPERANDS]


def num_scalars(steps: Sequence[str]) -> int:
    return sum(EPILOGUE_STEPS[s].operand is Operand.SCALAR for s in steps)


def apply_epilogue(
    acc: torch.Tensor,
    steps: Sequence[str],
    load_operand: Callable[[int], torch.Tensor],
    scalars: Sequence[float],
    up: torch.Tensor | None = None,
) -> torch.Tensor:
    """Apply ``steps`` to the fp32 ``acc``.

    ``load_operand(i)`` returns the i-th tensor operand already indexed for ``acc`` (the whole tensor
    on the reference path, the current tile inside a kernel); it is upcast to fp32 here. ``cast`` is a
    no-op on the accumulator: the caller stores the result in the site's output dtype. So is
    ``act_scale``: the kernel that quantized the activation multiplies by its scale right after the
    GEMM (the matcher only fuses it behind steps that commute with it). ``up`` is the second
    accumulator of a gated MLP (the up projection), which ``up_mul`` multiplies in.
    """
    next_operand = 0
    next_scalar = 0
    for step in steps:
        kind = EPILOGUE_STEPS[step].operand
        if kind is Operand.SCALAR:
            acc = acc * scalars[next_scalar]
            next_scalar += 1
        elif kind is not Operand.NONE:
            value = load_operand(next_operand).to(torch.float32)
            next_operand += 1
            acc = acc * value if EPILOGUE_STEPS[step].multiplies else acc + value
        elif step == UP_MUL:
            acc = acc * up.to(torch.float32)
        elif step in ACTIVATION_FORMULAS:
            acc = ACTIVATION_FORMULAS[step](acc)
    return acc
