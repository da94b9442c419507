"""Decode-step benchmark: a Qwen3-8B-shaped decoder, helion_inductor against eager, reduce-overhead and
max-autotune.

The model is plain PyTorch (no ``transformers``): Qwen3-8B's layer shapes (hidden 4096, intermediate
12288, 32 query and 8 key/value heads of 128, per-head q/k RMSNorm, rotary embeddings with theta 1e6,
SwiGLU MLP, no biases, vocabulary 151936 with its own lm_head) with fewer layers (``--layers``, default
4), random bf16 weights, and a static KV cache: one preallocated [batch, kv_heads, max_len, head_dim]
tensor per layer for keys and one for values, prefilled with random values up to the context length.
One decode step embeds one token per sequence at a position given as a tensor, writes its keys and
values into the cache at that position (``index_copy_``), attends over the whole cache with a mask that
hides the positions after it, and returns the logits [batch, vocab]. Every shape is static, so the step
can be captured in a CUDA graph.

Typical use on the GPU machine (one call of at most ten minutes)::

    python benchmarks/decode.py --out-dir "$OUT"                          # bf16 and fp8, batch 1, 8, 32
    python benchmarks/decode.py --formats bf16 --out-dir "$OUT"           # one format a call, then --merge
    python benchmarks/decode.py --merge a/nvidia_h200_decode.json b/nvidia_h200_decode.json
    python benchmarks/decode.py --tp 2 --out-dir "$OUT"                   # sharded over 2 GPUs (decode_tp.py)
    python benchmarks/decode.py --formats int4_weight_only --batch 1 \
        --variants reduce_overhead,helion_inductor,helion_inductor_frozen  # and with frozen_weights
    python benchmarks/decode.py --formats bf16 --batch 1 \
        --variants reduce_overhead,compile_step_graph,helion_inductor_frozen_step_graph  # one graph a step

and on a CPU, to check the script end to end (tiny model, eager and helion_inductor only)::

    python benchmarks/decode.py --smoke
    python benchmarks/decode.py --smoke --tp 2                            # two gloo ranks

What each row measures (one row per format, batch and variant):

- ``wall_us``: median over ``--steps`` steps (after ``--warmup`` steps) of the host wall time of one
  step followed by ``torch.cuda.synchronize()``: what a serving loop waits for, host overhead included.
  Once every variant of a format and batch is measured, they take turns (``WALL_ROUNDS`` rounds, in a
  rotating order, each after one untimed step), so that the machine's drift over the minutes between two
  variants (its host time varies by a few hundred µs from one minute to the next) weighs on each alike;
  ``wall_method`` says whether a row's figure is ``interleaved`` or, where that phase failed, ``alone``.
- ``gpu_us``: the device time of one step. ``eager``: the step captured ``CALLS_PER_GRAPH`` times into
  one ``torch.cuda.CUDAGraph``, the median replay time (CUDA events) divided by the calls, as
  :mod:`helion_backend.tuning.timing` times kernels. The compiled variants run their own CUDA graphs (Inductor's
  cudagraph trees), which cannot be captured inside another graph: for them, CUDA events around one
  step, recorded behind a spin kernel that keeps the GPU busy until the host has queued the whole step,
  so that host time before the launch is not counted; median over ``--steps`` steps. Both figures are
  GPU time with no host gaps; the second also holds the trees' input copies (tokens, position). The
  ``*_step_graph`` variants (``compile_step_graph``: torch.compile's default mode;
  ``helion_inductor_frozen_step_graph``: the backend with ``frozen_weights`` and ``cudagraphs`` off) capture
  the whole step once in one ``torch.cuda.CUDAGraph`` and replay it directly (:class:`StepGraph`), as serving
  engines run a compiled model: their wall time is the step without torch.compile's per-call host path.
  ``helion_inductor_frozen_direct`` keeps torch.compile's call and has the backend replay its graph
  (option ``cudagraph_runner="direct"``) instead of the cudagraph trees.
- ``kernels_per_step`` and ``copies_per_step``: the GPU kernels and the memory copies and sets of one step,
  as the profiler records them over ``PROFILED_STEPS`` steps (CUPTI sees the kernels a CUDA graph
  replays too): the launches that each pay a ramp even under CUDA graphs.
- ``rel_err``: the relative Frobenius error ||logits - ref|| / ||ref|| against the eager model of the
  same format on the same input, the worse of two checks (the first call at position ``context``, and
  after timing, a new token batch at position ``context + 1``); for quantized formats also
  ``rel_err_base``, the same against the eager bf16 model. ``correct``: both within the format's
  tolerance.
- ``compile_s``: the wall time of the first call (Dynamo, Inductor, Helion's kernels, one run) with
  whatever Inductor and Triton caches the machine already holds.

Results go to ``<out-dir>/<device>_decode.json`` and a Markdown table next to it, rewritten after every
row, so a run cut short (``--budget-min``) still leaves its finished rows.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gemm import (
    comma_list,
    configure_dynamo,
    describe_error,
    geomean,
    import_helion_backend,
    synchronize,
    worst_error,
)
from benchmarks.common import (
    QUANT_RECIPES,
    TimingConfig,
    capture_calls,
    device_tag,
    measure_ceilings,
    median_replay_ms,
    merged_metadata,
    metadata_union,
    read_result_files,
    relative_error,
    rotated,
    run_metadata,
    write_result_files,
)

# ----------------------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder's shapes (Qwen3-8B's by default, with fewer layers) and the cache's lengths."""

    hidden: int = 4096
    intermediate: int = 12288
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    layers: int = 4
    vocab: int = 151936
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    context: int = 512  # cache positions filled before the timed step, which runs at this position
    max_len: int = 1024  # cache length: the attention reads all of it, masked past the step's position

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for the rotary embedding")
        if not 0 < self.context <= self.max_len - 2:  # the checks also step at context + 1
            raise ValueError(f"context ({self.context}) must be in [1, max_len - 2 = {self.max_len - 2}]")


QWEN3_8B = DecoderConfig()
SMOKE_CONFIG = DecoderConfig(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, layers=1,
                             vocab=1024, context=16, max_len=32)


class RMSNorm(nn.Module):
    """RMSNorm as Qwen3 computes it: normalize in float32, cast back, then scale in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(config: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_len, head_dim] of every position, in the half-split layout (rotate_half)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
    angles = torch.arange(config.max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., head_dim] by the angles of its position (``cos``/``sin`` broadcast to it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention of one new token per sequence over a static KV cache."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_eps)
        # [batch, kv_heads, max_len, head_dim], set by Decoder.allocate_cache
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(batch, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, self.kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # The cache write: a fixed-shape scatter at a position held in a tensor (no recompile, no sync).
        self.k_cache.index_copy_(2, pos, k.unsqueeze(2))
        self.v_cache.index_copy_(2, pos, v.unsqueeze(2))
        # One query token: the query heads that share a key/value head become that head's query rows
        # ([batch, kv_heads, heads / kv_heads, head_dim]), so the cache is read once, never repeated.
        q = q.view(batch, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return self.o_proj(out.reshape(batch, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down_proj = nn.Linear(config.intermediate, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden, config.rms_eps)
        self.attn = Attention(config)
        self.post_attention_norm = RMSNorm(config.hidden, config.rms_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), pos, cos, sin, mask)
        return x + self.mlp(self.post_attention_norm(x))


class Decoder(nn.Module):
    """The decode step: ``model(tokens [batch], pos [1]) -> logits [batch, vocab]``.

    ``pos`` is an int64 tensor of one element, so that stepping to the next position changes no shape
    and no guard. Call :meth:`allocate_cache` before the first step.
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        cos, sin = rotary_tables(config)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("positions", torch.arange(config.max_len), persistent=False)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # [batch, hidden]
        cos = self.cos.index_select(0, pos)  # [1, head_dim]: broadcasts over batch and heads
        sin = self.sin.index_select(0, pos)
        mask = (self.positions <= pos).view(1, 1, 1, -1)  # True where the step may attend
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return self.lm_head(self.norm(x))

    def allocate_cache(self, batch: int, context: int, seed: int) -> None:
        """Fresh caches for ``batch`` sequences: positions below ``context`` hold seeded random values
        (the same for every model of one dtype and device), the rest zeros. Each cache is marked as a
        static address, so that CUDA graphs write it in place instead of copying it as an input."""
        weight = self.embed.weight
        config = self.config
        generator = torch.Generator(device=weight.device).manual_seed(seed)
        shape = (batch, config.kv_heads, config.max_len, config.head_dim)
        for layer in self.layers:
            for name in ("k_cache", "v_cache"):
                setattr(layer.attn, name, None)  # free the previous cache first
                cache = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
                cache[:, :, :context] = torch.randn((*shape[:2], context, shape[3]), generator=generator,
                                                    device=weight.device, dtype=weight.dtype)
                torch._dynamo.mark_static_address(cache)
                setattr(layer.attn, name, cache)


def build_model(config: DecoderConfig, dtype: torch.dtype, device: torch.device, seed: int) -> Decoder:
    """The decoder with seeded random weights: ``nn.Linear``'s and ``nn.Embedding``'s default init, norm
    scales near 1 (random, so that a norm applied to the wrong axis shows in the error)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Decoder(config)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, RMSNorm):
                    module.weight.normal_(1.0, 0.1)
    return model.to(dtype).eval().requires_grad_(False)


def step_bytes(model: Decoder, batch: int) -> int:
    """The fewest bytes one decode step must move: every weight and buffer once (quantized ones as stored),
    but of the embedding and the rotary tables only the rows the step reads, of each KV cache only the
    positions up to the step's (``context``, included), and the logits it writes. What the step's
    ``hbm_floor_us`` divides by the measured bandwidth; the caches must be allocated for ``batch``."""
    config = model.config
    caches = [cache for layer in model.layers for cache in (layer.attn.k_cache, layer.attn.v_cache)]
    # Each tensor once; the embedding, the rotary tables and the caches are read in part, counted below.
    seen = {id(tensor) for tensor in (model.embed.weight, model.cos, model.sin, *caches)}
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    total += batch * config.hidden * model.embed.weight.element_size()  # the tokens' embedding rows
    total += 2 * config.head_dim * model.cos.element_size()  # one position's cos and sin
    positions_read = config.context + 1
    total += sum(cache[:, :, :positions_read].numel() * cache.element_size() for cache in caches)
    return total + batch * config.vocab * model.embed.weight.element_size()  # the logits


# ----------------------------------------------------------------------------------------------------
# Formats and variants

FLOAT_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASE_FORMAT = "bf16"  # quantized formats are built from this model and also checked against it
# The quantized formats the decoder is built in (names of benchmarks.common.QUANT_RECIPES).
QUANT_FORMATS = ("fp8_dynamic", "int8_dynamic", "int8_weight_only", "int4_weight_only", "int4_weight_only_zp")
FORMATS = (*FLOAT_FORMATS, *QUANT_FORMATS)
# Relative error of the logits allowed against the eager model of the same format. Compiled code
# rounds differently from eager (fused reductions, other GEMM kernels), and quantized formats re-round
# every activation to 8 bits, so a small difference upstream flips some of those roundings: the
# compiled model may differ from eager by up to the quantization's own noise. Measured on the CPU with
# the default model (4 layers, batch 8, Inductor and helion_inductor's reference path): bf16 compiled vs
# eager 5.5e-3 (eager bf16 vs fp32: 5.7e-3); fp8_dynamic compiled vs eager fp8 3.0e-2, eager fp8 vs eager
# bf16 4.0e-2. The tolerances leave 3-5x of that; the int8 ones are set from the formats' SQNR, unmeasured.
TOLERANCES = {"bf16": 3e-2, "fp16": 1e-2, "fp32": 1e-4, "fp8_dynamic": 0.1, "int8_dynamic": 0.05,
              "int8_weight_only": 3e-2, "int4_weight_only": 3e-2, "int4_weight_only_zp": 3e-2}
# Quantized formats against the eager bf16 model: the quantization error of the whole model (int4, groups of
# 128: 7.6e-2 on the smoke model on the CPU; unmeasured on the default one).
BASE_TOLERANCES = {"fp8_dynamic": 0.15, "int8_dynamic": 0.06, "int8_weight_only": 0.05, "int4_weight_only": 0.25,
                   "int4_weight_only_zp": 0.25}

HELION = "helion_inductor"
# The backend with option frozen_weights (int4 sites may run tinygemm on a copy of the weight kept beside it):
# beside the default in one run, where asked for.
HELION_FROZEN = "helion_inductor_frozen"
# The backend with frozen_weights and its CUDA graphs replayed by its direct runner (option cudagraph_runner).
HELION_DIRECT = "helion_inductor_frozen_direct"
# Whole-step CUDA graphs (:class:`StepGraph`): a compiled model without cudagraph trees, one step captured once
# and replayed directly, as serving engines run a compiled model; torch.compile's default mode, and the backend
# with frozen_weights.
COMPILE_STEP_GRAPH = "compile_step_graph"
HELION_STEP_GRAPH = "helion_inductor_frozen_step_graph"
STEP_GRAPH_VARIANTS = (COMPILE_STEP_GRAPH, HELION_STEP_GRAPH)
# Each backend variant's options besides the run's.
HELION_VARIANT_OPTIONS: dict[str, dict[str, Any]] = {
    HELION: {},
    HELION_FROZEN: {"frozen_weights": True},
    HELION_DIRECT: {"frozen_weights": True, "cudagraph_runner": "direct"},
    HELION_STEP_GRAPH: {"frozen_weights": True, "cudagraphs": False},  # the whole step is captured instead
}
HELION_VARIANTS = tuple(HELION_VARIANT_OPTIONS)
DEFAULT_VARIANTS = ("eager", "reduce_overhead", "max_autotune", HELION)
VARIANTS = (*DEFAULT_VARIANTS, HELION_FROZEN, HELION_DIRECT, *STEP_GRAPH_VARIANTS)
BASELINES = ("reduce_overhead", "max_autotune")  # what the summary compares helion_inductor with
# Further (ours, theirs) pairs the summary compares where both ran: each option's effect on its own.
PAIRS = ((HELION_FROZEN, HELION), (HELION_DIRECT, HELION_FROZEN), (HELION_STEP_GRAPH, HELION_FROZEN),
         (HELION_STEP_GRAPH, COMPILE_STEP_GRAPH))

CALLS_PER_GRAPH = 10  # eager steps captured in one CUDA graph for its GPU time


def make_format_model(fmt: str, base: Decoder, config: DecoderConfig, device: torch.device,
                      seed: int) -> Decoder:
    """The model of one format: the base model itself, another float dtype, or a quantized deep copy."""
    if fmt == BASE_FORMAT:
        return base
    if fmt in FLOAT_FORMATS:
        return build_model(config, FLOAT_FORMATS[fmt], device, seed)
    from helion_backend.quantize import quantize

    quant_format, options = QUANT_RECIPES[fmt]
    return quantize(copy.deepcopy(base), quant_format, **options)


def lm_head_kind(model: Decoder) -> str:
    """What the lm_head became: ``Linear`` when it kept its float weight, else the quantized class."""
    return type(model.lm_head).__name__


def compile_variant(variant: str, model: nn.Module, device: torch.device,
                    helion_options: Mapping[str, Any] | None = None) -> Callable[..., torch.Tensor]:
    """``model`` as the variant runs it; every compiled variant has static shapes and CUDA graphs on a GPU.
    ``helion_options`` are backend options of the helion_inductor variant (extra ``rules``, limits)."""
    if variant == "eager":
        return model
    if variant == "reduce_overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    if variant == "max_autotune":
        return torch.compile(model, mode="max-autotune", dynamic=False)
    if variant == COMPILE_STEP_GRAPH:
        return torch.compile(model, dynamic=False)
    if variant in HELION_VARIANTS:
        import_helion_backend()
        # The backend turns CUDA graphs on by default for graphs on CUDA; a CPU graph is rewritten only
        # when asked (its fused sites then run the reference implementation).
        options = {} if device.type == "cuda" else {"rewrite_on_cpu": True}
        options |= (helion_options or {}) | HELION_VARIANT_OPTIONS[variant]
        return torch.compile(model, backend=HELION, options=options, dynamic=False)
    raise ValueError(f"unknown variant {variant!r}")


# ----------------------------------------------------------------------------------------------------
# Measuring one row


@dataclasses.dataclass
class DecodeInputs:
    """Two token batches and positions: ``a`` at ``context`` (the timed step), ``b`` at ``context + 1``
    (a check that the step follows its position tensor and reads the keys the step before wrote)."""

    tokens_a: torch.Tensor
    pos_a: torch.Tensor
    tokens_b: torch.Tensor
    pos_b: torch.Tensor

    @classmethod
    def make(cls, batch: int, config: DecoderConfig, device: torch.device, seed: int) -> DecodeInputs:
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, config.vocab, (2, batch), generator=generator).to(device)
        pos = torch.tensor([[config.context], [config.context + 1]], device=device)
        return cls(tokens[0].clone(), pos[0].clone(), tokens[1].clone(), pos[1].clone())

    def run_both(self, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """Logits of a step at ``context`` then one at ``context + 1`` (which reads the first's keys)."""
        first = step(self.tokens_a, self.pos_a).clone()
        return [first, step(self.tokens_b, self.pos_b).clone()]


@dataclasses.dataclass
class References:
    """Eager logits of the format's model, and of the bf16 model for a quantized format."""

    same: list[torch.Tensor]
    base: list[torch.Tensor] | None

    def first(self) -> References:
        """The references of the step at ``context`` only."""
        return References(self.same[:1], None if self.base is None else self.base[:1])


def model_step(fn: Callable[..., torch.Tensor], variant: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """One decode step of ``fn``; a compiled step first tells the cudagraph trees that a new step begins
    (the previous step's outputs may then be overwritten, which this benchmark never reads again), and a
    step-graph variant replays its whole step (:class:`StepGraph`)."""
    if variant == "eager":
        return fn
    if variant in STEP_GRAPH_VARIANTS:
        return StepGraph(fn)

    def step(tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return fn(tokens, pos)

    return step


class StepGraph:
    """A compiled decode step replayed as one CUDA graph, as serving engines replay a compiled model: no
    Dynamo guards, AOTAutograd wrapper or cudagraph tree on the host between steps, only the copy of the
    step's tokens and position into the graph's own input tensors and one ``CUDAGraph.replay``.

    The first :attr:`UNCAPTURED_CALLS` calls run ``fn`` itself (the first compiles; what the backend does once
    per weight or key happens outside any capture), the next captures a call on copies of its inputs, and
    every call from then on replays it. The logits returned are the graph's own tensor, which the next call
    overwrites (as cudagraph trees' outputs are). Off CUDA every call runs ``fn``."""

    UNCAPTURED_CALLS = 2

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.logits: torch.Tensor | None = None

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not tokens.is_cuda or (self.graph is None and self.calls < self.UNCAPTURED_CALLS):
            self.calls += 1
            return self.fn(tokens, pos)
        if self.graph is None:
            self._capture(tokens, pos)
        for static, given in zip(self.inputs, (tokens, pos)):
            static.copy_(given)
        self.graph.replay()
        return self.logits

    def _capture(self, tokens: torch.Tensor, pos: torch.Tensor) -> None:
        self.inputs = (tokens.clone(), pos.clone())
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.fn(*self.inputs)


def wall_samples(step: Callable[[], object], steps: int, device: torch.device) -> list[float]:
    """The host wall time of each of ``steps`` steps, each followed by a device synchronization, in µs."""
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def wall_us(step: Callable[[], object], steps: int, device: torch.device) -> float:
    """Median host wall time of one step followed by a device synchronization, in microseconds."""
    return statistics.median(wall_samples(step, steps, device))


def interleaved_wall_us(steps: Mapping[str, Callable[[], object]], total_steps: int, rounds: int,
                        device: torch.device) -> dict[str, float]:
    """Median wall time of one step of each variant (:func:`wall_samples`), the variants taking turns in
    ``rounds`` rounds of ``total_steps / rounds`` steps each, in an order rotated every round. Each turn starts
    with one untimed step: switching between two functions' cudagraph trees is not what a serving loop does."""
    names = list(steps)
    per_turn = max(1, total_steps // rounds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotated(names, r):
            steps[name]()
            synchronize(device)
            samples[name] += wall_samples(steps[name], per_turn, device)
    return {name: statistics.median(values) for name, values in samples.items()}


_SPIN_CYCLES_PER_US: dict[int, float] = {}


def spin_cycles_per_us(device: torch.device) -> float:
    """Clock cycles per microsecond of ``torch.cuda._sleep``, measured once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SPIN_CYCLES_PER_US:
        torch.cuda._sleep(1000)
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SPIN_CYCLES_PER_US[index] = cycles / (start.elapsed_time(end) * 1e3)
    return _SPIN_CYCLES_PER_US[index]


def events_behind_spin_us(step: Callable[[], object], steps: int, spin_us: float, device: torch.device,
                          after_spin: Callable[[], object] | None = None) -> float:
    """Median GPU time of one step from CUDA events, each step queued behind a ``spin_us`` spin kernel.

    While the spin runs, the host queues the start event, the whole step and the end event; the start
    event then fires when the spin ends, so the interval holds the step's GPU work and no host time
    (as long as queuing the step takes less than ``spin_us``, which the caller sets above the step's
    wall time).
    """
    cycles = int(spin_us * spin_cycles_per_us(device))
    samples = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        if after_spin is not None:  # queued between the spin and the start event (tensor parallel: the ranks meet)
            after_spin()
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


@dataclasses.dataclass
class RowResult:
    """One variant on one format and batch; fields stay None past the step that failed."""

    wall_us: float | None = None
    wall_method: str | None = None  # "interleaved" with the batch's other variants, or "alone"
    gpu_us: float | None = None
    gpu_method: str | None = None
    kernels_per_step: float | None = None  # GPU kernels one step runs, counted by the profiler (CUDA only)
    copies_per_step: float | None = None  # and its memory copies and sets (cudagraph trees' input copies)
    rel_err: float | None = None
    rel_err_base: float | None = None
    compile_s: float | None = None
    graphs: int | None = None  # Dynamo graphs compiled (1 when the step has no graph break)
    graph_breaks: int | None = None
    cudagraph_skips: int | None = None  # graphs Inductor ran without CUDA graphs
    cudagraph_skip_reasons: list[str] | None = None  # why (Inductor logs the reason on CUDA only)
    helion_sites: str | None = None
    error: str | None = None


def check(result: RowResult, outputs: Sequence[torch.Tensor], refs: References) -> None:
    """Fold the errors of ``outputs`` (the two checks' logits) into ``result``."""
    for i, out in enumerate(outputs):
        result.rel_err = worst_error(result.rel_err, relative_error(out, refs.same[i]))
        if refs.base is not None:
            result.rel_err_base = worst_error(result.rel_err_base, relative_error(out, refs.base[i]))


def site_counts() -> str:
    """Where the GEMMs of the graphs compiled since the last ``clear_reports()`` run, counted."""
    counts: dict[str, int] = {}
    for report in import_helion_backend().get_reports():
        for site in report.sites:
            counts[site.runs_on] = counts.get(site.runs_on, 0) + 1
        if report.unfused_gemms:
            counts["unfused"] = counts.get("unfused", 0) + len(report.unfused_gemms)
        if report.error:
            counts["graph errors"] = counts.get("graph errors", 0) + 1
    return ", ".join(f"{where} {count}" for where, count in counts.items()) or "no GEMM reported"


class _Collect(logging.Handler):
    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()[:500]
        if message not in self.messages:
            self.messages.append(message)


@contextlib.contextmanager
def cudagraph_skip_messages() -> Iterator[list[str]]:
    """The "skipping cudagraphs due to ..." warnings Inductor logs meanwhile (for graphs on CUDA; a CPU
    graph's skip is only counted). A compiled variant that skips runs without CUDA graphs, and
    its times are then not the times of the mode it claims."""
    from torch._inductor import cudagraph_utils

    messages: list[str] = []
    logger = getattr(cudagraph_utils, "cudagraphs_log", None)
    handler = _Collect(messages)
    if logger is not None:
        logger.addHandler(handler)
    try:
        yield messages
    finally:
        if logger is not None:
            logger.removeHandler(handler)


def measure_variant(variant: str, model: Decoder, inputs: DecodeInputs, refs: References,
                    plan: Plan, device: torch.device, time_step: StepTimer | None = None,
                    ) -> tuple[RowResult, Callable[[], torch.Tensor] | None]:
    """Compile, check and time one variant; a failure is recorded, not raised, so the run goes on. Returns
    the row and, unless it failed, its timed step, which stays compiled (for :func:`interleaved_wall_us`)
    until the caller's :func:`release_memory`. ``time_step`` replaces the one-device timing
    (:func:`time_one_device`), e.g. by one that keeps the ranks of a tensor-parallel model together."""
    result = RowResult()
    timed = None
    with cudagraph_skip_messages() as skip_messages:
        try:
            timed = _measure_into(result, variant, model, inputs, refs, plan, device, time_step or time_one_device)
        except Exception as exc:  # any failure of a variant is a result of the benchmark
            traceback.print_exc()
            result.error = describe_error(exc)
    result.cudagraph_skip_reasons = skip_messages or None
    return result, timed


def _measure_into(result: RowResult, variant: str, model: Decoder, inputs: DecodeInputs, refs: References,
                  plan: Plan, device: torch.device, time_step: StepTimer) -> Callable[[], torch.Tensor]:
    from torch._dynamo.utils import counters

    # No torch._dynamo.reset() here: the batch's earlier variants stay compiled for the interleaved wall
    # times; each torch.compile has its own backend, which Dynamo's cache entries are guarded on.
    counters.clear()
    if variant in HELION_VARIANTS:
        import_helion_backend().clear_reports()
    step = model_step(compile_variant(variant, model, device, plan.helion_options), variant)

    start = time.perf_counter()
    first = step(inputs.tokens_a, inputs.pos_a).clone()
    synchronize(device)
    if variant != "eager":
        result.compile_s = time.perf_counter() - start
        result.graphs = counters["stats"]["unique_graphs"]
        result.graph_breaks = sum(counters["graph_break"].values())
    if variant in HELION_VARIANTS:
        result.helion_sites = site_counts()
    check(result, [first], refs.first())

    def timed() -> torch.Tensor:
        return step(inputs.tokens_a, inputs.pos_a)

    # From here on a recompile would be a bug of the variant (a guard on the position's value, say),
    # and compile time inside the timed steps: make it an error.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(plan.warmup):  # cudagraph trees warm up, then record, then replay
            timed()
        synchronize(device)
        time_step(result, variant, timed, refs, plan, device)
        # After timing: the step at context, then new tokens at context + 1.
        check(result, inputs.run_both(step), refs)
    result.cudagraph_skips = counters["inductor"]["cudagraph_skips"]
    return timed


def time_one_device(result: RowResult, variant: str, timed: Callable[[], torch.Tensor], refs: References,
                    plan: Plan, device: torch.device) -> None:
    """Wall time of a step alone, then its GPU time (:func:`_gpu_time`) and launches (:func:`launches_per_step`)
    on a GPU."""
    result.wall_us, result.wall_method = wall_us(timed, plan.steps, device), "alone"
    if device.type == "cuda":
        _gpu_time(result, variant, timed, refs, plan)
        result.kernels_per_step, result.copies_per_step = launches_per_step(timed, PROFILED_STEPS)


# Steps the profiler records to count a step's launches (each the same step, so the count divides evenly).
PROFILED_STEPS = 5
_COPY_PREFIXES = ("Memcpy", "Memset")  # the names CUPTI gives memory copies and sets


def launches_per_step(timed: Callable[[], torch.Tensor], steps: int) -> tuple[float | None, float | None]:
    """GPU kernels and memory copies one step runs: what the profiler (CUPTI, which also sees the kernels
    that a CUDA graph replays) records over ``steps`` steps, divided by ``steps``. (None, None) when it
    records no GPU activity at all (a profiler that could not attach), rather than a count of zero."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            timed()
        torch.cuda.synchronize()
    kernels, copies = count_gpu_activity((event.device_type, event.name) for event in prof.events())
    if kernels + copies == 0:
        return None, None
    return kernels / steps, copies / steps


def count_gpu_activity(events: Iterable[tuple[Any, str]]) -> tuple[int, int]:
    """(kernels, memory copies and sets) among profiler events given as (device type, name)."""
    kernels = copies = 0
    for device_type, name in events:
        if device_type != torch.autograd.DeviceType.CUDA:
            continue
        if name.startswith(_COPY_PREFIXES):
            copies += 1
        else:
            kernels += 1
    return kernels, copies


def _gpu_time(result: RowResult, variant: str, timed: Callable[[], torch.Tensor], refs: References,
              plan: Plan) -> None:
    """GPU time of one step: a CUDA-graph replay for eager, events behind a spin for the compiled
    variants (their cudagraph trees, and a step graph, are not captured inside another graph)."""
    if variant != "eager":
        result.gpu_method = "events_behind_spin"
        spin_us = max(1000.0, 2 * result.wall_us)
        result.gpu_us = events_behind_spin_us(timed, plan.steps, spin_us, torch.device("cuda"))
        return
    timing = TimingConfig(warmup_calls=3, calls_per_graph=CALLS_PER_GRAPH, warmup_replays=3,
                          replays=max(1, math.ceil(plan.steps / CALLS_PER_GRAPH)))
    captured = capture_calls(lambda _: timed(), timing)
    result.gpu_method = "cuda_graph_replay"
    result.gpu_us = median_replay_ms(captured.graph, timing) * 1e3 / timing.calls_per_graph
    # The numbers of the launches that were timed: one more replay, its first step's logits.
    captured.graph.replay()
    torch.cuda.synchronize()
    check(result, [captured.outputs[0]], refs.first())
    del captured


# ----------------------------------------------------------------------------------------------------
# Report


def row_is_correct(row: dict) -> bool:
    """True when the row has a time and its errors are within its format's tolerances (NaN fails)."""
    def within(err: float | None, tolerance: float | None) -> bool:
        return tolerance is None or (err is not None and err <= tolerance)

    return (row["wall_us"] is not None and within(row["rel_err"], row["tolerance"])
            and within(row.get("rel_err_base"), row.get("tolerance_base")))


def find_row(rows: Sequence[dict], fmt: str, batch: int, variant: str) -> dict | None:
    for row in rows:
        if (row["format"], row["batch"], row["variant"]) == (fmt, batch, variant):
            return row
    return None


def speedup(rows: Sequence[dict], fmt: str, batch: int, baseline: str, key: str,
            variant: str = HELION) -> float | None:
    """t_baseline / t_variant for one format and batch (> 1: ``variant`` faster); None unless both rows are
    correct and have the time ``key``."""
    base, ours = find_row(rows, fmt, batch, baseline), find_row(rows, fmt, batch, variant)
    if base is None or ours is None or not (row_is_correct(base) and row_is_correct(ours)):
        return None
    if base[key] is None or ours[key] is None:
        return None
    return base[key] / ours[key]


def format_speedup(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def geomean_cell(values: Sequence[float | None]) -> str:
    found = [v for v in values if v is not None]
    return f"{geomean(found):.3f}x (n={len(found)})" if found else "n/a"


def ordered(values: Sequence, order: Sequence) -> list:
    """``values`` in the order of ``order``, then any others in their own order."""
    return [v for v in order if v in values] + [v for v in values if v not in order]


def baselines_in(rows: Sequence[dict]) -> list[str]:
    """The baselines that have rows: the summary compares helion_inductor with these only."""
    return [b for b in BASELINES if any(row["variant"] == b for row in rows)]


def summary_lines(rows: Sequence[dict]) -> list[str]:
    """Per format: geomean over batches of helion_inductor's speedup over each baseline, wall and GPU; of each
    other backend variant that ran over each baseline; and of each of :data:`PAIRS` where both ran."""
    lines = []
    ran = {row["variant"] for row in rows}
    ours_ran = [HELION, *(variant for variant in HELION_VARIANTS if variant != HELION and variant in ran)]
    comparisons = [(ours, baseline) for ours in ours_ran for baseline in baselines_in(rows)]
    comparisons += [pair for pair in PAIRS if set(pair) <= ran]
    for fmt in ordered(list(dict.fromkeys(row["format"] for row in rows)), FORMATS):
        batches = sorted({row["batch"] for row in rows if row["format"] == fmt})
        for ours, baseline in comparisons:
            cells = [f"{label} geomean {geomean_cell([speedup(rows, fmt, b, baseline, key, ours) for b in batches])}"
                     for label, key in (("wall", "wall_us"), ("GPU", "gpu_us"))]
            lines.append(f"{fmt}: {ours} vs {baseline}: {', '.join(cells)}")
    return lines or [f"no rows to compare: {HELION} and one of {', '.join(BASELINES)} must both run"]


# Step-time targets at batch 1, GPU time (issues 31 and 28): (format of helion_inductor's row, the other row's
# format and variant, the least speedup over it).
STEP_TARGETS = (
    ("bf16", "bf16", "reduce_overhead", 1.5),
    ("fp8_dynamic", "fp8_dynamic", "reduce_overhead", 2.2),
    ("int4_weight_only", "bf16", "reduce_overhead", 2.0),
    ("int4_weight_only", "fp8_dynamic", HELION, 1.0),
)
TARGET_BATCH = 1
WALL_OVER_GPU_TARGET = 1.10  # helion_inductor's wall time within 10% of its GPU time (issue 31)


def target_lines(rows: Sequence[dict]) -> list[str]:
    """Each step-time target whose rows ran, met or missed, and helion_inductor's wall over GPU time."""
    lines = []
    for fmt, other_fmt, other_variant, target in STEP_TARGETS:
        for variant in HELION_VARIANTS:
            ours = find_row(rows, fmt, TARGET_BATCH, variant)
            other = find_row(rows, other_fmt, TARGET_BATCH, other_variant)
            if ours is None or other is None or not (row_is_correct(ours) and row_is_correct(other)):
                continue
            if ours["gpu_us"] is None or other["gpu_us"] is None:
                continue
            ratio = other["gpu_us"] / ours["gpu_us"]
            floor = ours.get("hbm_floor_us")
            needs = f"; it needs {100 * floor * target / other['gpu_us']:.0f}% of the HBM floor" if floor else ""
            lines.append(f"batch {TARGET_BATCH}, GPU: {variant} {fmt} vs {other_variant} {other_fmt}: {ratio:.2f}x: "
                         f"{'met' if ratio >= target else 'missed'} (>= {target:g}x{needs})")
    for row in rows:
        if row["variant"] in HELION_VARIANTS and row["batch"] == TARGET_BATCH and row["wall_us"] and row["gpu_us"]:
            ratio = row["wall_us"] / row["gpu_us"]
            lines.append(f"batch {TARGET_BATCH}, {row['variant']} {row['format']}: wall / GPU {ratio:.2f}: "
                         f"{'met' if ratio <= WALL_OVER_GPU_TARGET else 'missed'} (<= {WALL_OVER_GPU_TARGET:g})")
    return lines


def format_number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def row_cells(row: dict) -> list[str]:
    err = format_number(row["rel_err"], ".1e")
    if row.get("rel_err_base") is not None:
        err += f" (bf16 {row['rel_err_base']:.1e})"
    status = "err" if row["error"] else ("ok" if row_is_correct(row) else "⚠ over tolerance")
    diagnostics = []
    if row["graphs"] is not None and (row["graphs"] != 1 or row["graph_breaks"]):
        diagnostics.append(f"{row['graphs']} graphs, {row['graph_breaks']} breaks")
    if row["cudagraph_skips"]:
        reasons = row.get("cudagraph_skip_reasons") or []
        diagnostics.append(f"{row['cudagraph_skips']} cudagraph skips"
                           + (f" ({reasons[0].splitlines()[0][:120]})" if reasons else ""))
    if row["helion_sites"]:
        diagnostics.append(row["helion_sites"])
    if row["wall_us"] is not None and row.get("wall_method") != "interleaved":
        diagnostics.append("wall alone")  # measured in a block of its own (runs before the turns, or a failed turn)
    launches = format_number(row.get("kernels_per_step"), ".0f")
    if row.get("copies_per_step"):
        launches += f" + {row['copies_per_step']:.0f} copies"
    floor = row.get("hbm_floor_us")
    of_floor = f"{100 * floor / row['gpu_us']:.0f}%" if floor and row["gpu_us"] else "-"
    return [str(row["batch"]), row["variant"], format_number(row["wall_us"], ".1f"),
            format_number(row["gpu_us"], ".1f"), of_floor, launches, err, status,
            format_number(row["compile_s"], ".1f"), "; ".join(diagnostics) or "-"]


def format_section(fmt: str, rows: Sequence[dict]) -> list[str]:
    mine = [row for row in rows if row["format"] == fmt]
    batches = sorted({row["batch"] for row in mine})
    tolerance = f"tolerance {TOLERANCES[fmt]:g} against eager {fmt}"
    if fmt in BASE_TOLERANCES:
        tolerance += f", {BASE_TOLERANCES[fmt]:g} against eager {BASE_FORMAT}"
    header = ["batch", "variant", "wall µs", "GPU µs", "GPU % of floor", "kernels / step", "rel err", "check",
              "compile s", "notes"]
    lines = [f"## {fmt} ({tolerance})", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rank = {variant: i for i, variant in enumerate(VARIANTS)}
    for row in sorted(mine, key=lambda r: (r["batch"], rank.get(r["variant"], len(rank)))):
        lines.append("| " + " | ".join(row_cells(row)) + " |")
    baselines = baselines_in(mine)
    if not baselines or not any(row["variant"] == HELION for row in mine):
        return lines
    header = ["batch", *(f"vs {b} ({label})" for b in baselines for label in ("wall", "GPU"))]
    lines += ["", f"{HELION} speedup (t_baseline / t_{HELION}; > 1: {HELION} faster):", "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    keys = [(b, key) for b in baselines for key in ("wall_us", "gpu_us")]
    for batch in batches:
        cells = [format_speedup(speedup(mine, fmt, batch, b, key)) for b, key in keys]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    cells = [geomean_cell([speedup(mine, fmt, batch, b, key) for batch in batches]) for b, key in keys]
    lines.append("| geomean | " + " | ".join(cells) + " |")
    return lines


MARKDOWN_METADATA = ("command", "device", "torch", "cuda", "triton", "helion", "python", "date")


def markdown(metadata: dict, rows: Sequence[dict], title: str | None = None, preamble: Sequence[str] = ()) -> str:
    """The result table; ``title`` and ``preamble`` (bullet lines after the run's metadata) are for variants
    of the benchmark, such as the tensor-parallel one."""
    config = metadata["model"]
    lines = [title or f"# Decode-step benchmark: {metadata['device']}, Qwen3-8B-shaped decoder", ""]
    lines += [f"- {key}: `{metadata.get(key)}`" for key in MARKDOWN_METADATA]
    lines += list(preamble)
    lines += [f"- merged from: `{command}`" for command in metadata.get("merged_from", [])]
    lines += [
        f"- model: layers {config['layers']}, hidden {config['hidden']}, intermediate {config['intermediate']}, "
        f"{config['heads']} query / {config['kv_heads']} kv heads of {config['head_dim']}, vocab "
        f"{config['vocab']}; static KV cache of {config['max_len']} positions, step at position "
        f"{config['context']}; lm_head per format: `{metadata.get('lm_head')}`",
        f"- wall µs: {metadata['wall_method']}",
        f"- GPU µs: {metadata['gpu_method']}",
        f"- GPU % of floor: the step's HBM floor (every weight once, the embedding rows and cache positions it "
        f"reads, the logits; `step_bytes`) at {metadata.get('memory_bandwidth_gb_s') or 0:.0f} GB/s over its GPU time",
        f"- kernels / step: GPU kernels (+ memory copies and sets) of one step, counted by torch.profiler "
        f"(CUPTI) over {PROFILED_STEPS} steps",
        f"- rel err: {metadata['error_method']}",
        f"- compile s: {metadata['compile_method']}",
        f"- helion_inductor options besides the defaults: `{metadata.get('helion_options') or 'none'}`",
        f"- Inductor config of every compiled variant besides the defaults: "
        f"`{metadata.get('inductor_config') or 'none'}`",
        f"- rows run: {len(rows)}; skipped by the time budget: {len(metadata['skipped'])}"
        + ("" if metadata["complete"] else " (run incomplete)"),
        "",
        "## Summary",
        "",
        *(f"- {line}" for line in summary_lines(rows)),
        *(f"- {line}" for line in target_lines(rows)),
    ]
    for fmt in ordered(list(dict.fromkeys(row["format"] for row in rows)), FORMATS):
        lines += ["", *format_section(fmt, rows)]
    errors = [f"- {row['format']} batch {row['batch']} {row['variant']}: `{row['error'].splitlines()[0][:300]}`"
              for row in rows if row["error"]]
    if errors:
        lines += ["", "## Errors (full text in the JSON file)", "", *errors]
    return "\n".join(lines) + "\n"


def write_results(out_dir: Path, metadata: dict, rows: Sequence[dict]) -> Path:
    """Write ``<device>_decode.json`` and ``.md`` into ``out_dir``; return the JSON path."""
    return write_result_files(out_dir / f"{metadata['device_tag']}_decode", metadata, rows, markdown(metadata, rows))


def merge_results(paths: Sequence[Path], out_dir: Path) -> Path:
    """Merge result files of one device and model; a later file's row replaces an earlier one's."""
    shards = read_result_files(paths)
    models = {json.dumps(data["metadata"]["model"], sort_keys=True) for data in shards}
    if len(models) > 1:
        raise SystemExit(f"cannot merge results of different model configs: {sorted(models)}")
    worlds = {data["metadata"].get("world_size") for data in shards}  # None: one GPU
    if len(worlds) > 1:
        raise SystemExit(f"cannot merge results of different --tp world sizes: {sorted(worlds, key=str)}")
    rows: dict[tuple, dict] = {}
    for data in shards:
        for row in data["rows"]:
            rows[(row["format"], row["batch"], row["variant"])] = row
    merged = {
        **merged_metadata(shards, ran={f"{fmt} batch={batch} {variant}" for fmt, batch, variant in rows}),
        "formats": metadata_union(shards, "formats"),
        "batches": sorted(metadata_union(shards, "batches")),
        "variants": ordered(metadata_union(shards, "variants"), VARIANTS),
        "tolerances": {k: v for data in shards for k, v in data["metadata"]["tolerances"].items()},
        "base_tolerances": {k: v for data in shards for k, v in data["metadata"]["base_tolerances"].items()},
        "helion_reports": {k: v for data in shards for k, v in data["metadata"].get("helion_reports", {}).items()},
        "lm_head": {k: v for data in shards for k, v in data["metadata"].get("lm_head", {}).items()},
    }
    if worlds != {None}:
        from benchmarks import decode_tp

        return decode_tp.write_merged(out_dir, merged, shards, list(rows.values()))
    return write_results(out_dir, merged, list(rows.values()))


# ----------------------------------------------------------------------------------------------------
# Plans and command line


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run measures; the presets below are overridden field by field by explicit flags."""

    config: DecoderConfig
    formats: tuple[str, ...]
    batches: tuple[int, ...]
    variants: tuple[str, ...]
    device: str
    steps: int  # timed steps per variant (wall time, and GPU time)
    warmup: int  # untimed steps after the first call
    seed: int = 0
    # Backend options of the helion_inductor variant besides the defaults (extra rule files, limits).
    helion_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Inductor config settings for every compiled variant alike (torch._inductor.config names, e.g.
    # "triton.enable_pdl" or "combo_kernels"): to evaluate a setting against the same baselines.
    inductor_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# Times a checked, warmed-up step into a row: (result, variant, step, refs, plan, device).
StepTimer = Callable[[RowResult, str, Callable[[], torch.Tensor], References, Plan, torch.device], None]

PRESETS = {
    "default": Plan(config=QWEN3_8B, formats=("bf16", "fp8_dynamic"), batches=(1, 8, 32), variants=DEFAULT_VARIANTS,
                    device="cuda", steps=100, warmup=10),
    # CPU, one tiny layer, batch 1: checks the script in well under a minute on two cores; measures nothing.
    "smoke": Plan(config=SMOKE_CONFIG, formats=("bf16", "fp8_dynamic"), batches=(1,),
                  variants=("eager", HELION), device="cpu", steps=5, warmup=2),
}

# Smoke results never land beside the GPU results that the lead commits.
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SMOKE_DIR = Path(tempfile.gettempdir()) / "decode_smoke"

WALL_ROUNDS = 10  # turns each variant of a batch takes in the interleaved wall timing
WALL_METHOD = ("median over the timed steps of the host wall time of one step + torch.cuda.synchronize(); the "
               f"variants of one format and batch take turns, {WALL_ROUNDS} rounds of steps / {WALL_ROUNDS} "
               "steps each in a rotating order (a row's wall_method: interleaved), else alone")
GPU_METHOD = (f"eager: {CALLS_PER_GRAPH} steps captured in one torch.cuda.CUDAGraph, median replay time "
              "(CUDA events) / steps; compiled variants (their own cudagraph trees, or the *_step_graph "
              "variants' one graph of the step): CUDA events around one step queued behind a spin kernel longer "
              "than the step's wall time, median over the timed steps")
ERROR_METHOD = ("relative Frobenius error of the logits against the eager model of the same format (quantized: "
                "also against eager bf16), the worse of the first call at position context and, after timing, "
                "new tokens at position context + 1")
COMPILE_METHOD = ("wall time of the first call (Dynamo, Inductor, Helion's kernels, one run; CUDA graphs are "
                  "recorded later, in the warm-up steps), with whatever compile caches the machine already holds")


def int_list(text: str) -> tuple[int, ...]:
    return tuple(int(item) for item in text.split(",") if item.strip())


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    preset = parser.add_mutually_exclusive_group()
    preset.add_argument("--smoke", dest="preset", action="store_const", const="smoke",
                        help="CPU, tiny model, eager and helion_inductor: checks the script")
    preset.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="merge result files of several runs; run nothing")
    parser.set_defaults(preset="default")
    parser.add_argument("--formats", type=comma_list(FORMATS),
                        help=f"comma list of {FORMATS} (default bf16,fp8_dynamic)")
    parser.add_argument("--batch", type=int_list, help="comma list of batch sizes (default 1,8,32)")
    parser.add_argument("--variants", type=comma_list(VARIANTS),
                        help=f"comma list of {VARIANTS} (default {','.join(DEFAULT_VARIANTS)})")
    parser.add_argument("--helion-rules", nargs="+", metavar="TOML",
                        help="rule files helion_inductor loads besides the shipped ones "
                             "(e.g. my_rules.toml)")
    parser.add_argument("--helion-options", type=json.loads, metavar="JSON",
                        help="more helion_inductor options, e.g. '{\"rmsnorm_prologue_max_m\": 32}'")
    parser.add_argument("--inductor-config", type=json.loads, metavar="JSON",
                        help="torch._inductor.config settings for every compiled variant, e.g. "
                             "'{\"triton.enable_pdl\": true}' or '{\"combo_kernels\": true}'")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="tensor parallel over N GPUs of this host: N ranks started here, NCCL (gloo with "
                             "--device cpu); variants reduce_overhead,helion_inductor unless --variants "
                             "(benchmarks/decode_tp.py)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where the model runs (default cuda; --smoke: cpu)")
    parser.add_argument("--layers", type=int, help="decoder layers (default 4; smoke 1)")
    parser.add_argument("--context", type=int, help="cache positions filled before the step (default 512)")
    parser.add_argument("--max-len", type=int, help="cache length (default 1024)")
    parser.add_argument("--steps", type=int, help="timed steps per variant (default 100)")
    parser.add_argument("--warmup", type=int, help="untimed steps after the first call (default 10)")
    parser.add_argument("--seed", type=int, help="seed of weights, cache and tokens (default 0)")
    parser.add_argument("--out-dir", type=Path,
                        help=f"where results go ($OUT on the device; default {RESULTS_DIR}, {SMOKE_DIR} for --smoke)")
    parser.add_argument("--budget-min", type=float, default=8.5,
                        help="start no new row after this many minutes (0: no limit)")
    return parser.parse_args(argv)


def helion_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The helion_inductor options the command line sets (None: the plan's)."""
    options = dict(args.helion_options or {})
    if args.helion_rules:
        options["rules"] = list(args.helion_rules)
    return options or None


def resolve_plan(args: argparse.Namespace) -> Plan:
    plan = PRESETS[args.preset]
    shape = {"layers": args.layers, "context": args.context, "max_len": args.max_len}
    config = dataclasses.replace(plan.config, **{k: v for k, v in shape.items() if v is not None})
    variants = args.variants
    if variants is None and args.tp is not None:
        from benchmarks.decode_tp import TP_VARIANTS

        variants = TP_VARIANTS
    overrides = {"formats": args.formats, "batches": args.batch, "variants": variants, "device": args.device,
                 "steps": args.steps, "warmup": args.warmup, "seed": args.seed,
                 "helion_options": helion_options(args), "inductor_config": args.inductor_config}
    return dataclasses.replace(plan, config=config, **{k: v for k, v in overrides.items() if v is not None})


def run_metadata_for(plan: Plan, device: torch.device) -> dict[str, object]:
    return {
        **run_metadata(device),
        "device_tag": device_tag(device),
        "model": dataclasses.asdict(plan.config),
        "formats": list(plan.formats),
        "batches": list(plan.batches),
        "variants": list(plan.variants),
        "steps": plan.steps,
        "warmup": plan.warmup,
        "seed": plan.seed,
        "helion_options": dict(plan.helion_options),
        "inductor_config": dict(plan.inductor_config),
        "tolerances": {fmt: TOLERANCES[fmt] for fmt in plan.formats},
        "base_tolerances": {fmt: BASE_TOLERANCES[fmt] for fmt in plan.formats if fmt in BASE_TOLERANCES},
        "wall_method": WALL_METHOD,
        "gpu_method": GPU_METHOD if device.type == "cuda" else "none (no GPU)",
        "error_method": ERROR_METHOD,
        "compile_method": COMPILE_METHOD,
        "lm_head": {},  # format -> the lm_head's class (Linear: not quantized)
        "helion_reports": {},  # format -> the backend's report summaries of its first compile
        "skipped": [],
        "complete": False,
    }


def make_row(fmt: str, batch: int, variant: str, result: RowResult, hbm_floor_us: float | None = None) -> dict:
    return {
        "format": fmt,
        "batch": batch,
        "variant": variant,
        **dataclasses.asdict(result),
        "tolerance": TOLERANCES[fmt],
        "tolerance_base": BASE_TOLERANCES.get(fmt),
        "hbm_floor_us": hbm_floor_us,
    }


def progress_line(row: dict, done: int, total: int, elapsed_s: float) -> str:
    if row["error"]:
        what = f"error: {row['error'].splitlines()[0][:200]}"
    else:
        what = (f"wall {format_number(row['wall_us'], '.1f')} µs, GPU {format_number(row['gpu_us'], '.1f')} µs, "
                f"rel err {format_number(row['rel_err'], '.1e')}"
                + (f" (vs bf16 {row['rel_err_base']:.1e})" if row["rel_err_base"] is not None else "")
                + ("" if row_is_correct(row) else " OVER TOLERANCE")
                + (f", compile {row['compile_s']:.1f} s" if row["compile_s"] is not None else ""))
    return f"[{done}/{total} {elapsed_s:.0f}s] {row['format']} batch={row['batch']} {row['variant']}: {what}"


def eager_references(model: Decoder, inputs: DecodeInputs) -> list[torch.Tensor]:
    return inputs.run_both(model)


def run(plan: Plan, out_dir: Path, budget_s: float) -> Path:
    """Measure every (format, batch, variant) of ``plan``, rewriting the result files after each row."""
    started = time.monotonic()
    device = torch.device(plan.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --smoke on a CPU machine")
    configure_dynamo()
    metadata = run_metadata_for(plan, device)
    cases = [(fmt, batch, variant) for fmt in plan.formats for batch in plan.batches for variant in plan.variants]
    rows: list[dict] = []
    json_path = write_results(out_dir, metadata, rows)
    config = plan.config
    print(f"{metadata['device']}, torch {metadata['torch']}, helion {metadata['helion']}; model {config}; "
          f"formats {plan.formats}, batches {plan.batches}, variants {plan.variants}", flush=True)

    def over_budget() -> bool:
        return bool(budget_s) and time.monotonic() - started > budget_s

    bandwidth = measure_ceilings(device, FLOAT_FORMATS[BASE_FORMAT]).memory_bytes_per_s
    metadata["memory_bandwidth_gb_s"] = bandwidth / 1e9
    base = build_model(config, FLOAT_FORMATS[BASE_FORMAT], device, plan.seed)
    done = 0
    with torch.no_grad(), torch._inductor.config.patch(dict(plan.inductor_config)):
        for fmt in plan.formats:
            if over_budget():
                break
            model = make_format_model(fmt, base, config, device, plan.seed)
            metadata["lm_head"][fmt] = lm_head_kind(model)
            for batch in plan.batches:
                if over_budget():
                    break
                inputs = DecodeInputs.make(batch, config, device, plan.seed + batch)
                model.allocate_cache(batch, config.context, plan.seed + batch)
                base_refs = None
                if fmt in BASE_TOLERANCES:  # the bf16 model on the same cache and tokens
                    base.allocate_cache(batch, config.context, plan.seed + batch)
                    base_refs = eager_references(base, inputs)
                    base.allocate_cache(1, 1, plan.seed)  # drop the large cache
                refs = References(eager_references(model, inputs), base_refs)
                hbm_floor_us = step_bytes(model, batch) / bandwidth * 1e6
                batch_rows: dict[str, dict] = {}
                timed_steps: dict[str, Callable[[], torch.Tensor]] = {}
                for variant in plan.variants:
                    if over_budget():
                        break
                    result, timed = measure_variant(variant, model, inputs, refs, plan, device)
                    if timed is not None:
                        timed_steps[variant] = timed
                    report_key = fmt if variant == HELION else f"{fmt}, {variant}"
                    if (variant in HELION_VARIANTS and report_key not in metadata["helion_reports"]
                            and result.helion_sites):
                        summaries = [r.summary() for r in import_helion_backend().get_reports()]
                        metadata["helion_reports"][report_key] = summaries
                        print(f"{variant} report, {fmt}, batch {batch}:", *summaries, sep="\n", flush=True)
                    rows.append(make_row(fmt, batch, variant, result, hbm_floor_us))
                    batch_rows[variant] = rows[-1]
                    done += 1
                    write_results(out_dir, metadata, rows)
                    print(progress_line(rows[-1], done, len(cases), time.monotonic() - started), flush=True)
                if len(timed_steps) > 1:
                    interleave_wall_times(batch_rows, timed_steps, plan, device)
                    write_results(out_dir, metadata, rows)
                del timed_steps
                release_memory(device)
            if model is not base:
                del model
                release_memory(device)
    finished = {(row["format"], row["batch"], row["variant"]) for row in rows}
    metadata["skipped"] = [f"{fmt} batch={batch} {variant}" for fmt, batch, variant in cases
                           if (fmt, batch, variant) not in finished]
    if metadata["skipped"]:
        print(f"time budget spent: skipped {len(metadata['skipped'])} rows")
    metadata["complete"] = not metadata["skipped"]
    write_results(out_dir, metadata, rows)
    return json_path


def interleave_wall_times(rows: Mapping[str, dict], timed_steps: Mapping[str, Callable[[], torch.Tensor]],
                          plan: Plan, device: torch.device) -> None:
    """Replace the wall times the variants of one batch got alone by :func:`interleaved_wall_us`; should that
    phase fail (a recompile, say), the rows keep theirs, marked ``alone``."""
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            walls = interleaved_wall_us(timed_steps, plan.steps, WALL_ROUNDS, device)
    except Exception:
        traceback.print_exc()
        print("interleaved wall times failed: each row keeps the wall time it got alone", flush=True)
        return
    for variant, wall in walls.items():
        rows[variant].update(wall_us=wall, wall_method="interleaved")
    print("wall µs, interleaved: " + ", ".join(f"{v} {w:.1f}" for v, w in walls.items()), flush=True)


def release_memory(device: torch.device) -> None:
    """Drop the batch's compiled graphs and CUDA-graph pools before the next one."""
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def main(argv: Sequence[str]) -> Path:
    args = parse_args(argv)
    out_dir = args.out_dir or (SMOKE_DIR if args.preset == "smoke" else RESULTS_DIR)
    if args.merge:
        json_path = merge_results(args.merge, out_dir)
    elif args.tp is not None:
        from benchmarks import decode_tp

        json_path = decode_tp.run(resolve_plan(args), args.tp, out_dir, args.budget_min * 60)
    else:
        json_path = run(resolve_plan(args), out_dir, args.budget_min * 60)
    rows = json.loads(json_path.read_text())["rows"]
    print("\n".join(summary_lines(rows)))
    print(f"results: {json_path} and {json_path.with_suffix('.md')}")
    return json_path


if __name__ == "__main__":  # Helion's autotuner re-imports __main__ in its worker processes
    main(sys.argv[1:])
