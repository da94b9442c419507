"""Which custom ops of a graph run outside CUDA graphs.

Inductor's cudagraph trees capture every kernel of a graph partition, opaque custom ops included. A custom op
that reads its inputs on the host (``tensor.tolist()``, ``.item()``: transformers' fp16/fp32 MoE fallback)
fails the capture, where plain ``torch.compile`` without CUDA graphs runs it. The backend turns CUDA graphs on
by default, so it must not capture an op it knows nothing about: Inductor partitions the graph around each
such op (``custom_should_partition_ops``), which then runs eagerly between the captured partitions.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import fx

from helion_backend.vocabulary import CAPTURE_SAFE_NAMESPACES


def stream_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (a caller's, or a runner's)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def ops_outside_cuda_graphs(graph: fx.Graph, vouched: Iterable[str] = ()) -> list[str]:
    """The ``namespace::name.overload`` of each custom op in ``graph`` not known to be capture-safe: not in
    :data:`CAPTURE_SAFE_NAMESPACES` and not ``vouched`` for (namespaces or ``namespace::name`` packets)."""
    vouched = set(vouched)
    found: dict[str, None] = {}
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace in CAPTURE_SAFE_NAMESPACES:
            continue
        packet = target.overloadpacket._qualified_op_name
        if target.namespace in vouched or packet in vouched:
            continue
        found[f"{packet}.{target._overloadname}"] = None
    return list(found)


def partition_patches(ops: list[str]) -> dict[str, Any]:
    """``torch._inductor.config`` patches that keep ``ops`` out of CUDA-graph capture: a partition boundary
    around each, or, where Inductor does not partition graphs, no CUDA graphs for this graph."""
    if not ops:
        return {}
    config = torch._inductor.config
    if getattr(config, "graph_partition", False) and hasattr(config, "custom_should_partition_ops"):
        return {"custom_should_partition_ops": [*config.custom_should_partition_ops, *ops]}
    return {"triton.cudagraphs": False}
