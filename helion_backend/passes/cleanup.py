"""Clean up: drop the nodes the rewrite left without users and check the graph is well formed."""

from __future__ import annotations

from .context import PassContext


def run(ctx: PassContext) -> None:
    # Also after a rewrite that failed half-way: what it inserted before failing has no users.
    if any(site.rule is not None for site in ctx.sites):
        ctx.graph.eliminate_dead_code()
        ctx.graph.lint()
