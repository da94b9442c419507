"""Epilogue semantics, written once and shared by the reference path and the Helion kernels.

An epilogue is an ordered tuple of step names from :mod:`helion_backend.vocabulary`. It is applied to
the fp32 accumulator; steps that read a tensor take the next entry of ``operands`` and steps that
read a scalar take the next entry of ``scalars``, both in step order.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from .vocabulary import ACTIVATIONS, EPILOGUE_STEPS, Operand

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
    "relu": _relu,
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "silu": _silu,
    "sigmoid": torch.sigmoid,
}
assert tuple(ACTIVATION_FORMULAS) == ACTIVATIONS


@functools.cache
def parse_epilogue(spec: str) -> tuple[str, ...]:
    """``"bias,gelu_tanh"`` -> ``("bias", "gelu_tanh")``; the op carries epilogues as such strings."""
    steps = tuple(s for s in spec.split(",") if s)
    unknown = [s for s in steps if s not in EPILOGUE_STEPS]
    if unknown:
        raise ValueError(f"unknown epilogue step(s) {unknown}; valid: {sorted(EPILOGUE_STEPS)}")
    return steps


def format_epilogue(steps: Sequence[str]) -> str:
    return ",".join(steps)


def operand_kinds(steps: Sequence[str]) -> list[Operand]:
    """The tensor operands an epilogue reads, in the order it reads them."""
    return [
        EPILOGUE_STEPS[s].operand
        for s in steps
        if EPILOGUE_STEPS[s].operand in (Operand.ROW, Operand.FULL)
    ]


def num_scalars(steps: Sequence[str]) -> int:
    return sum(EPILOGUE_STEPS[s].operand is Operand.SCALAR for s in steps)


def apply_epilogue(
    acc: torch.Tensor,
    steps: Sequence[str],
    load_operand: Callable[[int], torch.Tensor],
    scalars: Sequence[float],
) -> torch.Tensor:
    """Apply ``steps`` to the fp32 ``acc``.

    ``load_operand(i)`` returns the i-th tensor operand already indexed for ``acc`` (the whole tensor
    on the reference path, the current tile inside a kernel); it is upcast to fp32 here. ``cast`` is a
    no-op on the accumulator: the caller stores the result in the site's output dtype.
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
            acc = acc * value if step == "mul" else acc + value
        elif step in ACTIVATION_FORMULAS:
            acc = ACTIVATION_FORMULAS[step](acc)
    return acc
