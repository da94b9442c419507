"""What a recognizer returns for one epilogue or prologue step: the nodes it spans and what it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx


@dataclass
class Step:
    """One recognized epilogue step: the nodes it spans and what it reads besides the value."""

    name: str
    nodes: list[fx.Node]  # every node of the step, ``out`` last
    operand: fx.Node | None = None
    scalar: float | None = None
    # Transparent steps (reshapes between the GEMM and its epilogue) carry no vocabulary name.
    transparent: bool = False

    @property
    def out(self) -> fx.Node:
        return self.nodes[-1]
