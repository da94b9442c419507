"""Clean up: drop the nodes the rewrite left without users and check the graph is well formed."""

from __future__ import annotations

from .context import PassContext


def run(ctx: PassContext) -> None:
    if any(site.fused is not None for site in ctx.sites):
        ctx.graph.eliminate_dead_code()
        ctx.graph.lint()
