"""The sites the backend would find in a function, without compiling it: for tests and tuning tools.

The function is traced with fake tensors and Inductor's decompositions, which gives the graph the
post-grad pass sees up to Inductor's own pattern passes; normalize and match then describe its GEMMs.
No rule is chosen and nothing is rewritten.
"""

from __future__ import annotations

from typing import Any, Callable

from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from . import match, normalize
from .context import GemmSite, PassContext


def trace_sites(fn: Callable[..., Any], *args: Any) -> list[GemmSite]:
    """The GEMM sites of ``fn(*args)`` with their operands, epilogue chains and prologues."""
    gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    ctx = PassContext(graph=gm.graph, options=None, rules=[], report=None)
    normalize.run(ctx)
    for site in ctx.sites:
        match.follow_chain(site)
    return ctx.sites
