"""Clean up: drop the nodes the rewrite left without users and check the graph is well formed."""

from __future__ import annotations

from helion_backend.compile.context import PassContext
from helion_backend.compile.graph_pass import GraphPass

ALSO_RUNS_NOTE = "the unfused GEMM runs as well"


class CleanupPass(GraphPass):
    name = "cleanup"

    def run(self, ctx: PassContext) -> None:
        # Also after a rewrite that failed half-way: what it inserted before failing has no users.
        if any(site.rule is not None for site in ctx.sites) or any(site.fused is not None for site in ctx.attention):
            ctx.graph.eliminate_dead_code()
            ctx.graph.lint()
            _note_surviving_gemms(ctx)


def _note_surviving_gemms(ctx: PassContext) -> None:
    """A rewritten site whose original GEMM is still in the graph computes its product twice: the
    result is right, the time is not. Matching should never leave a reader outside the chain, so
    this is a bug to report, not to hide."""
    live = set(ctx.graph.nodes)
    for site in ctx.sites:
        if site.fused is not None and site.anchor in live:
            readers = ", ".join(sorted(user.name for user in site.anchor.users))
            site.notes.append(f"{ALSO_RUNS_NOTE}: {readers} still read {site.anchor.name}")
