"""The decode benchmark (:mod:`benchmarks.decode`) tensor parallel: ``decode.py --tp N``.

The Qwen3-8B-shaped decoder is sharded over N ranks of one host the way vLLM and torchtitan shard it:
column-parallel q, k, v, gate and up projections (each rank holds ``heads / N`` query and ``kv_heads / N``
key/value heads, its slice of the KV cache, and ``intermediate / N`` of the MLP), row-parallel o and down
projections, each followed by an all-reduce, and a vocabulary-parallel LM head whose logits are
all-gathered; the embedding and the norms are replicated. The collectives are hand-written
``torch.distributed._functional_collectives`` calls, which Dynamo traces into the graph as
``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` and ``wait_tensor``. They are chosen over
``parallelize_module`` (DTensor), which compiles to the same functional collectives, because the quantized
formats replace each ``nn.Linear`` with a quantized layer that DTensor's ``ColwiseParallel`` /
``RowwiseParallel`` do not know, and because a rank's local tensors keep the traced graph and the KV cache
the plain tensors the one-GPU step has.

The script starts the ranks itself (``torch.multiprocessing`` spawn of N processes; NCCL on the GPUs, each
rank on ``cuda:rank``; gloo with ``--device cpu``) and leaves the environment's NCCL settings alone
(``NCCL_NVLS_ENABLE``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` are recorded, never set). Every rank builds the
same unsharded model (seeded), takes its shard, and checks the sharded step against the unsharded eager
model of the same format on the same cache and tokens (the one-GPU benchmark's check and tolerances). Each
variant runs under CUDA graphs on a GPU (reduce-overhead's cudagraph trees, and the backend's, on by
default), with the same sharding. Timing, with every rank in step:

- ``wall_us``: after a barrier, the host wall time of one step + ``torch.cuda.synchronize()``, median over
  the timed steps on each rank (the collectives of each step keep the ranks together); the row's figure is
  the slowest rank's. The variants of a batch then take turns, as on one GPU.
- ``gpu_us``: CUDA events around one step (the replay of its CUDA graphs), queued behind a spin kernel and
  then a one-element all-reduce, so that the start events of all ranks fire together, after the slowest
  rank's host has queued its step; median over the timed steps, the slowest rank's.

Rank 0 writes ``<out-dir>/<device>_tp<N>_decode.json`` and ``.md`` (rewritten after every row): the rows
with each rank's figures, the GPUs, versions, world size and command, each rank's report of its fused sites
(their per-rank K and N), and the one-GPU speedups of ``<device>_decode.json`` in ``benchmarks/results``
for comparison.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import os
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from benchmarks import decode
from benchmarks.bench_gemm import configure_dynamo, import_helion_backend
from benchmarks.decode import HELION, Decoder, DecoderConfig, Plan, References, RowResult

# all_gather_tensor's newer name (torch 2.13 deprecates the old one; 2.11 may lack the new).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
TP_VARIANTS = ("reduce_overhead", HELION)  # the variants of a --tp run unless --variants says otherwise
# How long a rank waits in a collective for the others before the run fails. The ranks compile each variant
# at the same time, so a wait is the difference of two compile times (a variant's whole compile took up to
# 40 s on one H200, max-autotune's up to 240 s); a rank that failed alone shows within a device call.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=180)
# The environment's multicast settings, recorded in the results (the benchmark never sets them).
RECORDED_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_P2P_DISABLE", "CUDA_VISIBLE_DEVICES")
TP_WALL_METHOD = ("after a barrier, median over the timed steps of the host wall time of one step + "
                  "torch.cuda.synchronize() on each rank, the slowest rank's; the variants of one format and "
                  "batch then take turns as on one GPU (wall_method: interleaved), else alone")
TP_GPU_METHOD = ("CUDA events around one step (its CUDA-graph replay) queued behind a spin kernel longer than "
                 "the step's wall time and a one-element all-reduce that starts every rank's step together; "
                 "median over the timed steps, the slowest rank's")
TP_ERROR_METHOD = ("relative Frobenius error of the sharded step's logits (all-gathered) against the unsharded "
                   "eager model of the same format (quantized: also against unsharded eager bf16), the worse of "
                   "the first call at position context and, after timing, new tokens at position context + 1, "
                   "the worst rank's")


# ----------------------------------------------------------------------------------------------------
# Sharding


def sharding_problems(config: DecoderConfig, world: int) -> list[str]:
    """What keeps ``config`` from being split over ``world`` ranks, one line each (none: it splits)."""
    sizes = {"heads": config.heads, "kv_heads": config.kv_heads, "intermediate": config.intermediate,
             "vocab": config.vocab}
    return [f"{name} ({size}) is not a multiple of --tp {world}" for name, size in sizes.items() if size % world]


def rank_config(config: DecoderConfig, world: int) -> DecoderConfig:
    """The sizes one rank holds: its heads, its slice of the MLP and of the vocabulary."""
    return dataclasses.replace(config, heads=config.heads // world, kv_heads=config.kv_heads // world,
                               intermediate=config.intermediate // world, vocab=config.vocab // world)


def _linear_like(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return linear


def _require_no_bias(linear: nn.Linear, what: str) -> None:
    if linear.bias is not None:  # Qwen3 has none; a sharded bias needs its own placement (added once)
        raise ValueError(f"{what}: a linear with a bias is not sharded by this benchmark")


def column_parallel(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    """This rank's output features of ``linear``: a plain ``nn.Linear`` (so that ``quantize`` can take it)."""
    _require_no_bias(linear, "column_parallel")
    return _linear_like(linear.weight.chunk(world, dim=0)[rank])


class RowParallelLinear(nn.Module):
    """This rank's input features of a linear: a partial product, summed over the ranks by an all-reduce."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        _require_no_bias(linear, "RowParallelLinear")
        self.linear = _linear_like(linear.weight.chunk(world, dim=1)[rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.linear(x), "sum", dist.group.WORLD)


class VocabParallelLMHead(nn.Module):
    """This rank's slice of the vocabulary; the logits of every rank are gathered along the vocabulary."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.linear = column_parallel(linear, rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_gather(self.linear(x), x.dim() - 1, dist.group.WORLD)


def shard_decoder(model: Decoder, rank: int, world: int) -> Decoder:
    """A copy of ``model`` holding rank ``rank``'s shard of every layer (the module docstring's plan)."""
    problems = sharding_problems(model.config, world)
    if problems:
        raise ValueError("cannot shard the decoder: " + "; ".join(problems))
    sharded = copy.deepcopy(model)
    for layer in sharded.layers:
        attn, mlp = layer.attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (column_parallel(p, rank, world)
                                                 for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        attn.o_proj = RowParallelLinear(attn.o_proj, rank, world)
        attn.heads, attn.kv_heads = attn.heads // world, attn.kv_heads // world
        mlp.gate_proj, mlp.up_proj = (column_parallel(p, rank, world) for p in (mlp.gate_proj, mlp.up_proj))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, world)
    sharded.lm_head = VocabParallelLMHead(sharded.lm_head, rank, world)
    return sharded


def sharded_format_model(fmt: str, base: Decoder, full: Decoder, rank: int, world: int) -> Decoder:
    """The rank's model of one format: a float model's shard, or the bf16 model's shard quantized (each rank
    quantizes its own weights, so a row-parallel weight's per-channel scales are those of its slice)."""
    if fmt in decode.FLOAT_FORMATS:
        return shard_decoder(full, rank, world)
    from helion_backend.quantize import quantize

    return quantize(shard_decoder(base, rank, world), fmt)


def shard_caches(full: Decoder, sharded: Decoder, rank: int, world: int) -> None:
    """Give each sharded layer this rank's key/value heads of the unsharded model's caches (copies)."""
    for whole, part in zip(full.layers, sharded.layers):
        heads = whole.attn.kv_heads // world
        for name in ("k_cache", "v_cache"):
            setattr(part.attn, name, None)
            cache = getattr(whole.attn, name)[:, rank * heads:(rank + 1) * heads].clone()
            torch._dynamo.mark_static_address(cache)
            setattr(part.attn, name, cache)


# ----------------------------------------------------------------------------------------------------
# The ranks in step


@dataclasses.dataclass
class Ranks:
    """This process's place among the ranks, and a host-side (gloo) group for barriers and results."""

    rank: int
    world: int
    device: torch.device
    host_group: Any

    def barrier(self) -> None:
        dist.barrier(group=self.host_group)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, by rank."""
        objs: list[Any] = [None] * self.world
        dist.all_gather_object(objs, obj, group=self.host_group)
        return objs

    def time_step(self, result: RowResult, variant: str, timed: Callable[[], torch.Tensor], refs: References,
                  plan: Plan, device: torch.device) -> None:
        """:data:`decode.StepTimer` for tensor parallel: the module docstring's wall and GPU times, this rank's."""
        self.barrier()
        result.wall_us, result.wall_method = decode.wall_us(timed, plan.steps, device), "alone"
        if device.type == "cuda":
            result.gpu_method = "aligned_events_behind_spin"
            result.gpu_us = self.aligned_events_us(timed, plan.steps, max(1000.0, 2 * result.wall_us))

    def aligned_events_us(self, step: Callable[[], object], steps: int, spin_us: float) -> float:
        """Median GPU time of one step from CUDA events whose start fires on every rank at once: behind a spin
        that outlasts the host's queuing of the step, then a one-element all-reduce (the ranks' streams meet
        there). Without it a rank that started early would count its wait for the others in the first
        collective."""
        meet = torch.zeros(1, device=self.device)
        self.barrier()
        return decode.events_behind_spin_us(step, steps, spin_us, self.device, after_spin=lambda: dist.all_reduce(meet))


def rank_sites() -> list[dict[str, Any]]:
    """The sites of the graphs compiled since the last ``clear_reports()``, at this rank's shapes."""
    return [{"module": s.module, "kernel": s.kernel, "k": s.k, "n": s.n, "m": s.m, "runs_on": s.runs_on,
             "prologue": s.prologue, "epilogue": s.epilogue, "why": s.why, "fallbacks": s.fallbacks}
            for report in import_helion_backend().get_reports() for s in report.sites]


def combine_ranks(results: Sequence[dict[str, Any]]) -> RowResult:
    """One row from every rank's: times and errors of the slowest / worst rank, the first rank's error."""
    def worst(key: str) -> float | None:
        values = [r[key] for r in results if r[key] is not None]
        return max(values) if len(values) == len(results) else None

    first = results[0]
    combined = RowResult(**{**first, "wall_us": worst("wall_us"), "gpu_us": worst("gpu_us"),
                            "rel_err": worst("rel_err"), "rel_err_base": worst("rel_err_base"),
                            "compile_s": worst("compile_s")})
    combined.error = next((f"rank {i}: {r['error']}" for i, r in enumerate(results) if r["error"]), None)
    if combined.error:
        combined.wall_us = combined.gpu_us = None
    skips = [r["cudagraph_skips"] for r in results if r["cudagraph_skips"] is not None]
    combined.cudagraph_skips = max(skips) if skips else None
    return combined


# ----------------------------------------------------------------------------------------------------
# One rank's run


def run_rank(rank: int, world: int, init_method: str, plan: Plan, command: str, out_dir: Path,
             budget_s: float) -> None:
    """Every (format, batch, variant) of ``plan`` on this rank, in the order every rank runs them."""
    device = torch.device(plan.device, rank) if plan.device == "cuda" else torch.device(plan.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=PROCESS_GROUP_TIMEOUT)
    try:
        host_group = dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
        ranks = Ranks(rank, world, device, host_group)
        _run(ranks, plan, command, out_dir, budget_s)
    finally:
        dist.destroy_process_group()


def _run(ranks: Ranks, plan: Plan, command: str, out_dir: Path, budget_s: float) -> None:
    started = time.monotonic()
    configure_dynamo()
    device, config = ranks.device, plan.config
    writer = ResultWriter(out_dir, tp_metadata(plan, ranks, command)) if ranks.rank == 0 else None
    cases = [(fmt, batch, variant) for fmt in plan.formats for batch in plan.batches for variant in plan.variants]
    done = 0

    def over_budget() -> bool:  # every rank must stop at the same row: rank 0 decides
        stop = bool(budget_s) and time.monotonic() - started > budget_s
        return ranks.gather(stop)[0]

    base = decode.build_model(config, decode.FLOAT_FORMATS[decode.BASE_FORMAT], device, plan.seed)
    with torch.no_grad():
        for fmt in plan.formats:
            if over_budget():
                break
            full = decode.make_format_model(fmt, base, config, device, plan.seed)
            sharded = sharded_format_model(fmt, base, full, ranks.rank, ranks.world)
            if writer is not None:
                writer.metadata["lm_head"][fmt] = type(sharded.lm_head.linear).__name__
            for batch in plan.batches:
                if over_budget():
                    break
                inputs = decode.DecodeInputs.make(batch, config, device, plan.seed + batch)
                full.allocate_cache(batch, config.context, plan.seed + batch)
                shard_caches(full, sharded, ranks.rank, ranks.world)
                base_refs = None
                if fmt in decode.BASE_TOLERANCES:
                    base.allocate_cache(batch, config.context, plan.seed + batch)
                    base_refs = decode.eager_references(base, inputs)
                    base.allocate_cache(1, 1, plan.seed)
                refs = References(decode.eager_references(full, inputs), base_refs)
                full.allocate_cache(1, 1, plan.seed)  # the unsharded cache is no longer needed
                sharding_error = max(decode.relative_error(out, ref) for out, ref in
                                     zip(decode.eager_references(sharded, inputs), refs.same))
                if writer is not None:
                    writer.metadata["eager_sharding_error"][f"{fmt} batch={batch}"] = sharding_error
                batch_rows: dict[str, dict] = {}
                timed_steps: dict[str, Callable[[], torch.Tensor]] = {}
                for variant in plan.variants:
                    if over_budget():
                        break
                    ranks.barrier()
                    result, timed = decode.measure_variant(variant, sharded, inputs, refs, plan, device,
                                                           time_step=ranks.time_step)
                    sites = rank_sites() if variant == HELION else []
                    gathered = ranks.gather({"result": dataclasses.asdict(result), "sites": sites,
                                             "summaries": _summaries() if variant == HELION else []})
                    if all(g["result"]["error"] is None for g in gathered) and timed is not None:
                        timed_steps[variant] = timed
                    done += 1
                    if writer is not None:
                        row = writer.add_row(fmt, batch, variant, gathered)
                        batch_rows[variant] = row
                        print(decode.progress_line(row, done, len(cases), time.monotonic() - started), flush=True)
                if len(timed_steps) > 1:
                    walls = interleaved_walls(ranks, timed_steps, plan, device)
                    if writer is not None and walls is not None:
                        writer.set_interleaved(batch_rows, walls)
                del timed_steps
                decode.release_memory(device)
            del full, sharded
            decode.release_memory(device)
    if writer is not None:
        writer.finish(cases)


def _summaries() -> list[str]:
    return [report.summary() for report in import_helion_backend().get_reports()]


def interleaved_walls(ranks: Ranks, timed_steps: Mapping[str, Callable[[], torch.Tensor]], plan: Plan,
                      device: torch.device) -> dict[str, float] | None:
    """The slowest rank's interleaved wall time of each variant (:func:`decode.interleaved_wall_us`); None
    when any rank's turns failed (the rows then keep the times they got alone)."""
    walls = None
    ranks.barrier()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            walls = decode.interleaved_wall_us(timed_steps, plan.steps, decode.WALL_ROUNDS, device)
    except Exception:
        traceback.print_exc()
    gathered = ranks.gather(walls)
    if any(w is None for w in gathered):
        return None
    return {variant: max(w[variant] for w in gathered) for variant in timed_steps}


# ----------------------------------------------------------------------------------------------------
# Results (rank 0)


def tp_metadata(plan: Plan, ranks: Ranks, command: str) -> dict[str, Any]:
    metadata = decode.run_metadata_for(plan, ranks.device)
    on_gpu = ranks.device.type == "cuda"
    gpus = [torch.cuda.get_device_name(i) for i in range(ranks.world)] if on_gpu else []
    metadata.update({
        "command": command,
        "device_tag": f"{metadata['device_tag']}_tp{ranks.world}",
        "world_size": ranks.world,
        "gpus": gpus,
        "collectives": f"nccl {nccl_version()}" if on_gpu else "gloo",
        "environment": {name: os.environ.get(name) for name in RECORDED_ENV},
        "sharding": ("column-parallel q/k/v, gate/up and the LM head (vocabulary, logits all-gathered); "
                     "row-parallel o and down, each followed by an all-reduce; embedding and norms replicated; "
                     "torch.distributed._functional_collectives"),
        "rank_model": dataclasses.asdict(rank_config(plan.config, ranks.world)),
        "wall_method": TP_WALL_METHOD,
        "gpu_method": TP_GPU_METHOD if on_gpu else "none (no GPU)",
        "error_method": TP_ERROR_METHOD,
        "eager_sharding_error": {},  # "fmt batch=b" -> the sharded eager model's error (no compile)
        "rank_sites": {},  # format -> [the sites of each rank]
        "helion_reports": {},  # format -> [the report summaries of each rank]
        "one_gpu": one_gpu_speedups(metadata["device_tag"]),
    })
    return metadata


def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def one_gpu_speedups(device_tag: str) -> dict[str, Any]:
    """helion_inductor's speedups over reduce-overhead in the committed one-GPU results of this device, per
    format and batch (wall, GPU), for comparison; empty when there are none."""
    path = decode.RESULTS_DIR / f"{device_tag}_decode.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    speedups = {}
    for fmt, batch in dict.fromkeys((row["format"], row["batch"]) for row in rows):
        pair = [decode.speedup(rows, fmt, batch, "reduce_overhead", key) for key in ("wall_us", "gpu_us")]
        if any(v is not None for v in pair):
            speedups[f"{fmt} batch={batch}"] = pair
    return {"file": str(path.relative_to(decode.RESULTS_DIR.parents[1])), "speedups": speedups}


class ResultWriter:
    """Rank 0's result files, rewritten after every row."""

    def __init__(self, out_dir: Path, metadata: dict[str, Any]) -> None:
        self.out_dir, self.metadata, self.rows = out_dir, metadata, []
        self.write()
        print(f"{metadata['world_size']} ranks on {metadata['gpus'] or metadata['device']}, torch "
              f"{metadata['torch']}, helion {metadata['helion']}, {metadata['collectives']}; per rank "
              f"{metadata['rank_model']}", flush=True)

    def add_row(self, fmt: str, batch: int, variant: str, gathered: Sequence[dict[str, Any]]) -> dict:
        results = [g["result"] for g in gathered]
        row = decode.make_row(fmt, batch, variant, combine_ranks(results))
        row["ranks"] = [{key: r[key] for key in ("wall_us", "gpu_us", "rel_err", "compile_s", "helion_sites")}
                        for r in results]
        if variant == HELION and fmt not in self.metadata["rank_sites"] and any(g["sites"] for g in gathered):
            self.metadata["rank_sites"][fmt] = [g["sites"] for g in gathered]
            self.metadata["helion_reports"][fmt] = [g["summaries"] for g in gathered]
            for rank, g in enumerate(gathered):
                print(f"{HELION} report, {fmt}, batch {batch}, rank {rank}:", *g["summaries"], sep="\n", flush=True)
        self.rows.append(row)
        self.write()
        return row

    def set_interleaved(self, rows: Mapping[str, dict], walls: Mapping[str, float]) -> None:
        for variant, wall in walls.items():
            rows[variant].update(wall_us=wall, wall_method="interleaved")
        print("wall µs, interleaved (slowest rank): " + ", ".join(f"{v} {w:.1f}" for v, w in walls.items()),
              flush=True)
        self.write()

    def finish(self, cases: Sequence[tuple[str, int, str]]) -> None:
        finished = {(row["format"], row["batch"], row["variant"]) for row in self.rows}
        self.metadata["skipped"] = [f"{f} batch={b} {v}" for f, b, v in cases if (f, b, v) not in finished]
        if self.metadata["skipped"]:
            print(f"time budget spent: skipped {len(self.metadata['skipped'])} rows")
        self.metadata["complete"] = not self.metadata["skipped"]
        self.write()

    def write(self) -> Path:
        return write_results(self.out_dir, self.metadata, self.rows)


def write_results(out_dir: Path, metadata: Mapping[str, Any], rows: Sequence[dict]) -> Path:
    """``<out_dir>/<device>_tp<N>_decode.json`` and ``.md``; returns the JSON path."""
    return decode.write_result_files(out_dir / f"{metadata['device_tag']}_decode", dict(metadata), rows,
                                     markdown(metadata, rows))


def write_merged(out_dir: Path, merged: dict[str, Any], shards: Sequence[dict], rows: Sequence[dict]) -> Path:
    """The merge of ``decode.py --merge`` for tensor-parallel files: also every file's per-rank sites and
    sharding errors (a later file's win)."""
    for key in ("rank_sites", "eager_sharding_error"):
        merged[key] = {k: v for data in shards for k, v in data["metadata"].get(key, {}).items()}
    return write_results(out_dir, merged, rows)


def markdown(metadata: Mapping[str, Any], rows: Sequence[dict]) -> str:
    world = metadata["world_size"]
    model = metadata["rank_model"]
    preamble = [
        f"- world size: {world}; GPUs: `{metadata['gpus'] or 'none'}`; collectives: {metadata['collectives']}; "
        f"environment: `{metadata['environment']}`",
        f"- sharding: {metadata['sharding']}; per rank: {model['heads']} query / {model['kv_heads']} kv heads, "
        f"intermediate {model['intermediate']}, vocabulary {model['vocab']}",
        f"- eager sharded vs unsharded error (no compile): `{metadata['eager_sharding_error']}`",
    ]
    one_gpu = metadata["one_gpu"]
    if one_gpu.get("speedups"):
        cells = ", ".join(f"{key} {wall and f'{wall:.2f}x'} / {gpu and f'{gpu:.2f}x'}"
                          for key, (wall, gpu) in one_gpu["speedups"].items())
        preamble.append(f"- one GPU, for comparison ({one_gpu['file']}), helion_inductor vs reduce_overhead "
                        f"(wall / GPU): {cells}")
    text = decode.markdown(metadata, rows, title=f"# Decode-step benchmark, tensor parallel over {world} "
                           f"ranks: {metadata['device']}, Qwen3-8B-shaped decoder", preamble=preamble)
    sections = []
    for fmt, per_rank in metadata["rank_sites"].items():
        sections += ["", f"## {HELION} sites per rank, {fmt} (K and N of the rank's shard)", "",
                     "| rank | module | kernel | K | N | M | runs on | prologue | epilogue |", "|" + "---|" * 9]
        for rank, sites in enumerate(per_rank):
            sections += [f"| {rank} | {s['module'] or '-'} | {s['kernel']} | {s['k']} | {s['n']} | {s['m']} | "
                         f"{s['runs_on']} | {','.join(s['prologue']) or '-'} | {','.join(s['epilogue']) or '-'} |"
                         for s in sites]
    return text + "\n".join(sections) + ("\n" if sections else "")


# ----------------------------------------------------------------------------------------------------
# Launch


def require_devices(world: int, device: str) -> None:
    """Refuse, in one line, a run that asks for more GPUs than this host shows."""
    if world < 1:
        raise SystemExit(f"--tp must be at least 1, got {world}")
    if device == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < world:
            raise SystemExit(f"--tp {world} needs {world} CUDA GPUs; {visible} visible "
                             "(use --device cpu for the gloo smoke run)")


def run(plan: Plan, world: int, out_dir: Path, budget_s: float) -> Path:
    """Start ``world`` ranks of ``plan`` on this host, wait for them, and return rank 0's JSON file."""
    import shlex
    import sys

    require_devices(world, plan.device)
    problems = sharding_problems(plan.config, world)
    if problems:
        raise SystemExit(f"--tp {world}: " + "; ".join(problems))
    command = shlex.join(sys.orig_argv)
    with tempfile.TemporaryDirectory(prefix="decode_tp_") as rendezvous:
        torch.multiprocessing.spawn(run_rank, nprocs=world, join=True,
                                    args=(world, f"file://{rendezvous}/store", plan, command, out_dir, budget_s))
    tag = decode.device_tag(torch.device(plan.device, 0) if plan.device == "cuda" else torch.device("cpu"))
    return out_dir / f"{tag}_tp{world}_decode.json"
