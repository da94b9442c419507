"""Tensor-parallel models for tests/test_tensor_parallel.py, and the worker that runs one rank of them.

The models are a two-layer GELU MLP and a Llama-style decoder layer (RMSNorm, grouped-query attention with
rotary embeddings, SwiGLU MLP). Each is sharded two ways, column-parallel q/k/v, gate/up (and the MLP's up),
row-parallel o and down:

- ``dtensor``: ``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` and
  ``RowwiseParallel`` (DTensor);
- ``funcol``: hand-written local shards and a ``torch.distributed._functional_collectives.all_reduce`` after
  each row-parallel linear, the way vLLM writes it, with the row-parallel bias added after the reduction.

Run as a script, one process per rank (``--rank``, ``--world``, ``--init file://...``, ``--out``), the worker
compiles every case with ``backend="helion_inductor"`` on the CPU (``rewrite_on_cpu``) and writes
``<out>/rank<r>.json``: each case's error against the unsharded model in float64, its sites as each rank's
report lists them, what the backend's pass did to the graph's collectives, and the manifest of the rank.
Sizes scale with the world size: every rank holds two query heads and one key/value head.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten

HIDDEN = 64
HEAD_DIM = 8
HEADS_PER_RANK = 2
KV_HEADS_PER_RANK = 1
MLP_WIDTH_PER_RANK = 64  # the GELU MLP's hidden width per rank
INTERMEDIATE_PER_RANK = 48  # the decoder's SwiGLU width per rank
MAX_LEN = 16
RMS_EPS = 1e-6

STYLES = ("dtensor", "funcol")
MODELS = ("mlp", "decoder")
# Token counts: prefill and decode (M = 1) static, then a dynamic M (mark_dynamic) called at two sizes.
PREFILL_TOKENS = 8
DYNAMIC_TOKENS = (6, 3)
WORKER_TIMEOUT = datetime.timedelta(seconds=300)  # of a collective that waits for the other rank


# --------------------------------------------------------------------------------------------------
# The unsharded models


class GeluMLP(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, MLP_WIDTH_PER_RANK * world)
        self.down = nn.Linear(MLP_WIDTH_PER_RANK * world, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x), approximate="tanh"))


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm: normalize in float32, cast back, scale."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        return self.weight * x32.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query attention over the given tokens. Head counts are read from the projections'
    widths (``view(.., -1, head_dim)``), so a rank's module with local shards computes its own heads."""

    def __init__(self, world: int) -> None:
        super().__init__()
        heads, kv_heads = HEADS_PER_RANK * world, KV_HEADS_PER_RANK * world
        self.q_proj = nn.Linear(HIDDEN, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
        angles = torch.arange(MAX_LEN, dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, HEAD_DIM).transpose(1, 2)
        cos, sin = self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GatedMLP(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTERMEDIATE_PER_RANK * world, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTERMEDIATE_PER_RANK * world, bias=False)
        self.down_proj = nn.Linear(INTERMEDIATE_PER_RANK * world, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.input_norm = RMSNorm(HIDDEN)
        self.attn = Attention(world)
        self.post_attention_norm = RMSNorm(HIDDEN)
        self.mlp = GatedMLP(world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


def build_model(name: str, world: int) -> nn.Module:
    """The unsharded model, the same on every rank (seeded), norm scales near 1 (random, so a norm applied
    to the wrong axis shows)."""
    torch.manual_seed(0)
    model = GeluMLP(world) if name == "mlp" else DecoderLayer(world)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.normal_(1.0, 0.1)
    return model.eval().requires_grad_(False)


# Column- and row-parallel linears of each model, by module path.
COLUMN_PARALLEL = {"mlp": ("up",), "decoder": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj",
                                               "mlp.up_proj")}
ROW_PARALLEL = {"mlp": ("down",), "decoder": ("attn.o_proj", "mlp.down_proj")}


# --------------------------------------------------------------------------------------------------
# The two ways of sharding them


def shard_with_dtensor(model: nn.Module, name: str, mesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {**{path: ColwiseParallel() for path in COLUMN_PARALLEL[name]},
            **{path: RowwiseParallel() for path in ROW_PARALLEL[name]}}
    return parallelize_module(copy.deepcopy(model), mesh, plan)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a linear's weight (and bias): its slice of the output features, no communication."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.chunk(world, dim=0)[rank].clone(), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.chunk(world)[rank].clone(), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This rank's columns of a linear's weight: a partial sum, all-reduced, then the whole bias (added once,
    after the reduction)."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.chunk(world, dim=1)[rank].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        out = funcol.all_reduce(F.linear(x, self.weight), "sum", dist.group.WORLD)
        return out if self.bias is None else out + self.bias


def shard_by_hand(model: nn.Module, name: str, rank: int, world: int) -> nn.Module:
    sharded = copy.deepcopy(model)
    for paths, layer in ((COLUMN_PARALLEL[name], ColumnParallelLinear), (ROW_PARALLEL[name], RowParallelLinear)):
        for path in paths:
            parent_path, _, child = path.rpartition(".")
            parent = sharded.get_submodule(parent_path)
            setattr(parent, child, layer(getattr(parent, child), rank, world))
    return sharded


# --------------------------------------------------------------------------------------------------
# What the backend's pass does to a graph's collectives

_VIEWS = (aten.permute.default, aten.t.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _source(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def collective_schedule(graph: fx.Graph) -> dict[str, Any]:
    """The graph's collectives in order, and for each graph input how many collectives come before the first op
    that reads it (seen through views): a pass that swallows, drops or reorders a collective changes the first,
    one that moves a GEMM, its epilogue or its prologue past a collective the second (the op replacing them
    reads their inputs where it runs)."""
    from helion_backend.patterns import is_collective

    collectives: list[str] = []
    first_read: dict[str, int] = {}
    for node in graph.nodes:
        if is_collective(node):
            collectives.append(f"{node.name}: {node.target}")
        elif node.op == "call_function" and node.target not in _VIEWS:
            for inp in node.all_input_nodes:
                if _source(inp).op == "placeholder":
                    first_read.setdefault(_source(inp).name, len(collectives))
    return {"collectives": collectives, "collectives_before_first_read": first_read}


def record_collective_schedules(schedules: list[dict[str, Any]]) -> None:
    """Wrap the pass manager so that each graph it runs on appends its schedule before and after the pass."""
    from helion_backend.passes.manager import HelionPassManager

    run = HelionPassManager.__call__

    def recording(self, graph: fx.Graph) -> None:
        before = collective_schedule(graph)
        run(self, graph)
        schedules.append({"before": before, "after": collective_schedule(graph)})

    HelionPassManager.__call__ = recording


def place_as_on_cuda() -> None:
    """Place sites where a CUDA compile would send them to Helion (the fused op still runs the reference on the
    CPU), so that the manifest records them as a GPU rank would."""
    from helion_backend.passes import placement, shared_input

    place = placement.place

    def on_helion(site, ctx, kernel, n):
        return placement.Placement("helion", None, place(site, ctx, kernel, n).helion_limit)

    placement.place = shared_input.place = on_helion


# --------------------------------------------------------------------------------------------------
# The worker


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    style: str
    shape: str  # "prefill" | "decode" | "dynamic"

    @property
    def name(self) -> str:
        return f"{self.model}-{self.style}-{self.shape}"


ALL_CASES = {case.name: case for case in (Case(model, style, shape) for model in MODELS for style in STYLES
                                          for shape in ("prefill", "decode", "dynamic"))}
# Every model, style and shape once, without the slowest case (the DTensor decoder with a dynamic M, 13 s of
# CPU a rank): what CI runs.
QUICK_CASES = tuple(name for name in ALL_CASES if name != "decoder-dtensor-dynamic")
TOKEN_COUNTS = {"prefill": (PREFILL_TOKENS,), "decode": (1,), "dynamic": DYNAMIC_TOKENS}


def token_inputs(model: str, tokens: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fresh random activations of ``tokens`` tokens (the same on every rank): [M, H] for the MLP, [1, M, H]
    (one sequence) for the decoder."""
    generator = torch.Generator().manual_seed(seed)
    shape = (tokens, HIDDEN) if model == "mlp" else (1, tokens, HIDDEN)
    return torch.randn(shape, generator=generator).to(device, dtype)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run_case(case: Case, model: nn.Module, sharded: nn.Module, options: dict[str, Any],
             schedules: list[dict[str, Any]]) -> dict[str, Any]:
    """Compile ``sharded`` and run it at the case's token counts: its errors against ``model`` in float64,
    the reports of its graphs and what the pass did to their collectives."""
    import helion_backend

    torch._dynamo.reset()
    helion_backend.clear_reports()
    schedules.clear()
    compiled = torch.compile(sharded, backend="helion_inductor", options=options)
    reference = copy.deepcopy(model).double()
    weight = next(sharded.parameters())
    errors = []
    for i, tokens in enumerate(TOKEN_COUNTS[case.shape]):
        x = token_inputs(case.model, tokens, 100 + i, weight.device, weight.dtype)
        if case.shape == "dynamic" and i == 0:
            torch._dynamo.mark_dynamic(x, x.dim() - 2)  # the token dimension
        with torch.no_grad():
            errors.append(relative_error(compiled(x), reference(x.double())))
    return {
        "errors": errors,
        "reports": [dataclasses.asdict(report) for report in helion_backend.get_reports()],
        "schedules": list(schedules),
    }


def run_rank(rank: int, world: int, init: str, out: Path, device: str, cases: list[str]) -> dict[str, Any]:
    """Every case of ``cases`` on this rank, one after the other (every rank runs them in one order)."""
    on_cuda = device == "cuda"
    if on_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init, rank=rank, world_size=world,
                            timeout=WORKER_TIMEOUT)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device, (world,))
        schedules: list[dict[str, Any]] = []
        record_collective_schedules(schedules)
        cache_dir = out / f"cache{rank}"
        options: dict[str, Any] = {"cache_dir": str(cache_dir), "inductor_config": {"fx_graph_cache": False}}
        if not on_cuda:
            place_as_on_cuda()
            options["rewrite_on_cpu"] = True
        dtype = torch.bfloat16 if on_cuda else torch.float32
        target = torch.device(device, rank) if on_cuda else torch.device(device)
        models = {name: build_model(name, world).to(target, dtype) for name in MODELS}
        results = {}
        for name in cases:
            case = ALL_CASES[name]
            model = models[case.model]
            sharded = (shard_with_dtensor(model, case.model, mesh) if case.style == "dtensor"
                       else shard_by_hand(model, case.model, rank, world))
            started = time.perf_counter()
            try:
                results[name] = run_case(case, model, sharded, options, schedules)
            except Exception:
                results[name] = {"failure": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - started
        manifest = cache_dir / "manifest.json"
        return {"rank": rank, "world": world, "dtype": str(dtype).removeprefix("torch."), "cases": results,
                "manifest": json.loads(manifest.read_text()) if manifest.exists() else None}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init", required=True, help="init_method of the process group (file://...)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--cases", default=",".join(QUICK_CASES),
                        help=f"comma-separated, of {', '.join(ALL_CASES)} (default: all but decoder-dtensor-dynamic)")
    args = parser.parse_args(argv)
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - ALL_CASES.keys())
    if unknown:
        parser.error(f"unknown case(s) {unknown}; valid: {list(ALL_CASES)}")
    result = run_rank(args.rank, args.world, args.init, args.out, args.device, cases)
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
