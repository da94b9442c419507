"""Route each call of a dynamic-token graph to the variant compiled for its num_tokens range.

With a symbolic M, one compiled graph would have to serve decode and prefill alike. Instead the
backend compiles two variants of the same Dynamo graph: one with the Helion rewrite (for calls whose
every rewritten GEMM has M within its Helion limit: max_helion_size, or the measured crossover of its
shape) and plain Inductor (cuBLAS plus Inductor's own epilogue fusion) for the rest. Each call
evaluates the sites' M expressions from its actual arguments and runs the matching variant, so a
choice made for one M is never replayed for another.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import sympy
import torch


def make_token_counter(
    gm: torch.fx.GraphModule, m_exprs: Sequence[str]
) -> Callable[[Sequence[Any]], list[int]] | None:
    """A function giving each site's M for a call's arguments, or None if M cannot be located.

    ``m_exprs`` are the sites' M as sympy strings over the shape symbols of ``gm``'s inputs (strings,
    since they may come from a cached compile of an identical graph).
    """
    try:
        exprs = [sympy.sympify(e) for e in m_exprs]
    except (sympy.SympifyError, TypeError, ValueError, NameError):  # e.g. torch's FloorDiv in the text
        return None
    names = sorted({str(s) for e in exprs for s in e.free_symbols})
    where = _locate_symbols(gm, set(names))
    if any(name not in where for name in names):
        return None
    symbols = [sympy.Symbol(name) for name in names]
    fns = [sympy.lambdify(symbols, e.subs({s: sympy.Symbol(str(s)) for s in e.free_symbols}), modules="math")
           for e in exprs]
    places = [where[name] for name in names]

    def site_ms(args: Sequence[Any]) -> list[int]:
        values = [int(args[i]) if dim is None else args[i].shape[dim] for i, dim in places]
        return [int(f(*values)) for f in fns]

    return site_ms


def _locate_symbols(gm: torch.fx.GraphModule, names: set[str]) -> dict[str, tuple[int, int | None]]:
    """Symbol name -> (graph input index, tensor dim, or None for a SymInt input)."""
    where: dict[str, tuple[int, int | None]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index, node in enumerate(placeholders):
        example = node.meta.get("example_value")
        if isinstance(example, torch.SymInt) and str(example.node.expr) in names:
            where.setdefault(str(example.node.expr), (index, None))
        elif isinstance(example, torch.Tensor):
            for dim, size in enumerate(example.shape):
                if isinstance(size, torch.SymInt) and str(size.node.expr) in names:
                    where.setdefault(str(size.node.expr), (index, dim))
    return where


class TokenRouter:
    """Calls ``small`` when every site's M is within its limit, else ``large``."""

    def __init__(self, small: Callable[..., Any], large: Callable[..., Any],
                 site_ms: Callable[[Sequence[Any]], list[int]], limits: Sequence[int]) -> None:
        self.small = small
        self.large = large
        self.site_ms = site_ms
        self.limits = list(limits)

    def __call__(self, *args: Any) -> Any:
        fits = all(m <= limit for m, limit in zip(self.site_ms(args), self.limits))
        return (self.small if fits else self.large)(*args)
