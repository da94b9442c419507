"""The model zoo: every decoder family people deploy, as the installed ``transformers`` ships it, built from a
tiny config with random weights (no downloads), compiled with the backend and compared with its float32 model.

Each family runs a prefill at a few lengths (odd ones and one token) and a static-cache decode step, in
float32, bfloat16 and float16. The compiled logits may be at most :data:`ERROR_FACTOR` times as far from the
float32 model's as eager's logits in that dtype are, plus a small floor (eager's own rounding is the
yardstick, on the CPU as on the GPU, whose low-precision GEMMs round differently), and each compiled graph
must fuse at least the projections the family's layers hold, so that nothing passes with nothing fused.

One file for both devices: the ``cpu`` cases run the rewrite with ``rewrite_on_cpu`` (the sites run their
reference composites), a fast subset by default and the rest marked ``slow``; the ``cuda`` cases (marker
``gpu``) run the whole matrix with the default options, the sites' Helion kernels replayed under CUDA
graphs. A family the installed ``transformers`` lacks is skipped with the reason.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from helpers import CPU_REWRITE, rel_err

import helion_backend
from helion_backend.options import BackendOptions
from helion_backend.report import GraphReport, SiteReport

transformers = pytest.importorskip("transformers")

# The compiled error may exceed eager's by this factor, plus FLOOR[dtype] (where eager is exact: float32).
ERROR_FACTOR = 1.5
FLOOR = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 5e-3}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LAYERS, HEADS, KV_HEADS = 2, 4, 2
EXPERTS = 4  # in the mixture-of-experts families, each token routed to all of them


@dataclass(frozen=True)
class Sizes:
    hidden: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // HEADS


# Tiny on the CPU (compile time); on the GPU as large as tests/test_gpu_hf_models.py, so that every projection
# is worth a Helion kernel.
SIZES = {"cpu": Sizes(hidden=64, intermediate=128, vocab=128), "cuda": Sizes(hidden=256, intermediate=512, vocab=1024)}
# Prefill shapes (batch, length): one token (M = 1) and odd lengths; M stays <= max_helion_size on the GPU.
PREFILLS = {"cpu": ((2, 7), (1, 1)), "cuda": ((1, 1), (2, 7), (3, 9))}
assert all(b * s <= BackendOptions().max_helion_size for b, s in PREFILLS["cuda"])
# Decode: batches (M of each step) after a prompt of PROMPT tokens; on the GPU three steps, so that a CUDA
# graph is warmed up, recorded and replayed (and, likewise, three calls per prefill shape).
PROMPT, DECODE_BATCHES = 5, {"cpu": (1,), "cuda": (1, 3)}
CALLS = {"cpu": 1, "cuda": 3}
OPTIONS: dict[str, dict[str, Any]] = {"cpu": dict(CPU_REWRITE), "cuda": {}}
RUNS_ON = {"cpu": "reference", "cuda": "helion"}


@dataclass(frozen=True)
class Family:
    """A decoder family: its config class, the config's arguments for some sizes, and the GEMM sites each of
    its layers must fuse at least (the LM head adds one)."""

    name: str
    config_class: str
    arguments: Callable[[Sizes], dict[str, Any]]
    sites_per_layer: int

    def config(self, sizes: Sizes):
        """The tiny config, or a skip where the installed transformers has no such family."""
        made = getattr(transformers, self.config_class, None)
        if made is None:
            pytest.skip(f"transformers {transformers.__version__} has no {self.config_class} ({self.name})")
        return made(**self.arguments(sizes))

    @property
    def min_sites(self) -> int:
        return self.sites_per_layer * LAYERS + 1


def _llama_like(s: Sizes, **extra: Any) -> dict[str, Any]:
    return {"hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": LAYERS,
            "vocab_size": s.vocab, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, **extra}


def _with_head_dim(s: Sizes, **extra: Any) -> dict[str, Any]:
    return _llama_like(s, head_dim=s.head_dim, **extra)


# Per layer: q, k, v, o, gate and up (one gated site), down for the Llama-like families.
FAMILIES = {f.name: f for f in (
    Family("llama", "LlamaConfig", _llama_like, 6),
    Family("mistral", "MistralConfig", lambda s: _llama_like(s, sliding_window=4), 6),
    Family("qwen2", "Qwen2Config", _llama_like, 6),  # q, k, v with bias
    Family("qwen3", "Qwen3Config", _with_head_dim, 6),  # q and k RMSNorms between the projections and rotary
    Family("gemma", "GemmaConfig", _with_head_dim, 6),
    # Soft-capped attention and logits, sandwich norms, and sliding-window layers.
    Family("gemma2", "Gemma2Config", lambda s: _with_head_dim(s, sliding_window=4), 6),
    Family("gemma3", "Gemma3TextConfig", lambda s: _with_head_dim(
        s, sliding_window=4, layer_types=["sliding_attention", "full_attention"]), 6),
    # Fused qkv_proj and gate_up_proj weights, split after the GEMM.
    Family("phi3", "Phi3Config", lambda s: _llama_like(s, pad_token_id=0, bos_token_id=1, eos_token_id=2), 4),
    # Multipliers as the released checkpoints have them: a scale before each residual add.
    Family("granite", "GraniteConfig", lambda s: _llama_like(
        s, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
        attention_multiplier=1.0 / s.head_dim), 6),
    # Conv1D: addmm with a [K, N] weight; c_attn, c_proj, c_fc (+ GELU), the MLP's c_proj.
    Family("gpt2", "GPT2Config", lambda s: {
        "n_embd": s.hidden, "n_layer": LAYERS, "n_head": HEADS, "vocab_size": s.vocab, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0}, 4),
    # Partial rotary, parallel residual: query_key_value, dense, dense_h_to_4h (+ GELU), dense_4h_to_h.
    Family("gpt_neox", "GPTNeoXConfig", lambda s: {
        "hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "vocab_size": s.vocab, "use_parallel_residual": True}, 4),
    # Learned positions, ReLU MLP: q, k, v, out_proj, fc1, fc2.
    Family("opt", "OPTConfig", lambda s: {
        "hidden_size": s.hidden, "ffn_dim": s.intermediate, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "vocab_size": s.vocab, "word_embed_proj_dim": s.hidden,
        "max_position_embeddings": 64}, 6),
    # Multi-query attention and parallel attention/MLP (falcon-7b): query_key_value, dense, h_to_4h, 4h_to_h.
    Family("falcon", "FalconConfig", lambda s: {
        "hidden_size": s.hidden, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "vocab_size": s.vocab, "ffn_hidden_size": s.intermediate}, 4),
    # Partial rotary, parallel attention/MLP, biases everywhere (Phi-2): q, k, v, dense, fc1, fc2.
    Family("phi", "PhiConfig", lambda s: {
        "hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "vocab_size": s.vocab, "partial_rotary_factor": 0.5}, 6),
    # LayerNorm with bias, a c_fc/c_proj MLP with GELU: q, k, v, o, c_fc, c_proj.
    Family("starcoder2", "Starcoder2Config", lambda s: _llama_like(s, sliding_window=None), 6),
    # Norms after attention and MLP, q/k norms over all heads.
    Family("olmo2", "Olmo2Config", _llama_like, 6),
    # Parallel attention/MLP with LayerNorm, scaled logits.
    Family("cohere", "CohereConfig", lambda s: _llama_like(s, logit_scale=0.25), 6),
    # Mixture of experts: the router is a GEMM site; the experts' [E, N, K] weights run as one grouped GEMM
    # per projection (aten._grouped_mm under torch.compile), which stays with Inductor. q, k, v, o, router.
    # Every token goes to all EXPERTS: with fewer, a near tie between two experts' scores (5e-4 apart in
    # deepseek_v3's, under one bf16 rounding of the hidden state) flips on any change of rounding, and the
    # logits then jump by far more than rounding, whoever computes them.
    Family("mixtral", "MixtralConfig", lambda s: _llama_like(
        s, num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS), 5),
    # Experts as in Mixtral, q/k norms as in Qwen3.
    Family("qwen3_moe", "Qwen3MoeConfig", lambda s: _with_head_dim(
        s, num_experts=EXPERTS, num_experts_per_tok=EXPERTS, moe_intermediate_size=s.intermediate // 4), 5),
    # Multi-head latent attention (q and kv through low-rank projections, each with its RMSNorm) and, after one
    # dense layer, routed and shared experts: q_a, q_b, kv_a, kv_b, o, and the router or the dense MLP.
    Family("deepseek_v3", "DeepseekV3Config", lambda s: {
        **_llama_like(s, num_key_value_heads=HEADS), "n_routed_experts": EXPERTS, "num_experts_per_tok": EXPERTS,
        "moe_intermediate_size": s.intermediate // 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "q_lora_rank": s.hidden // 2, "kv_lora_rank": s.hidden // 4, "qk_rope_head_dim": s.head_dim // 2,
        "qk_nope_head_dim": s.head_dim // 2, "v_head_dim": s.head_dim, "n_group": 1, "topk_group": 1}, 6),
)}


@dataclass(frozen=True)
class Case:
    """One compiled graph: a prefill of ``batch`` x ``length`` tokens, or (``length`` 0) a decode step at
    ``batch``."""

    device: str
    family: str
    dtype: torch.dtype
    batch: int
    length: int = 0

    def __str__(self) -> str:
        shape = f"{self.batch}x{self.length}" if self.length else f"batch{self.batch}"
        return f"{self.device}-{self.family}-{str(self.dtype).removeprefix('torch.')}-{shape}"


# The CPU's fast subset (one compile, about 13 s on two cores): Llama's bfloat16 decode step
# (tests/test_hf_models.py compiles Llama's prefill). The rest of the CPU matrix is marked slow:
# CI runs its bfloat16 cases (``-k bfloat16``), the GPU the whole matrix.
CPU_FAST = {"cpu-llama-bfloat16-batch1"}


def _cases(decode: bool) -> list:
    params = []
    for device in ("cpu", "cuda"):
        shapes = [(b, 0) for b in DECODE_BATCHES[device]] if decode else PREFILLS[device]
        for family in FAMILIES:
            for dtype in DTYPES:
                for batch, length in shapes:
                    case = Case(device, family, dtype, batch, length)
                    fast = device == "cpu" and str(case) in CPU_FAST
                    marks = [pytest.mark.gpu] if device == "cuda" else [] if fast else [pytest.mark.slow]
                    params.append(pytest.param(case, marks=marks, id=str(case)))
    return params


assert CPU_FAST <= {p.id for p in _cases(False) + _cases(True)}


def _models(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The family's float32 model and a copy in the case's dtype, on its device, with the same random weights."""
    if case.device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = FAMILIES[case.family].config(SIZES[case.device])
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).to(case.device, torch.float32).eval()
    return reference, copy.deepcopy(reference).to(case.dtype)


def _compile(model: torch.nn.Module, case: Case) -> torch.nn.Module:
    # Static shapes: each length is a graph of its own, as Dynamo's automatic dynamic shapes would make the
    # second one symbolic (a far longer compile on the CPU, and the GPU's sites then route on M at run time).
    return torch.compile(model, backend="helion_inductor", options=OPTIONS[case.device], dynamic=False)


def _tokens(case: Case, gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, SIZES[case.device].vocab, shape, generator=gen, device=case.device)


def _summary(reports: list[GraphReport]) -> str:
    return "\n".join(r.summary() for r in reports)


def _check_error(case: Case, got: torch.Tensor, eager: torch.Tensor, expected: torch.Tensor, what: str,
                 reports: list[GraphReport]) -> None:
    """The compiled logits are as close to the float32 model's as eager's, within the factor and floor."""
    assert got.dtype == eager.dtype and got.shape == eager.shape, f"{what}: {got.dtype} {got.shape}"
    error, eager_error = rel_err(got, expected), rel_err(eager, expected)
    bound = ERROR_FACTOR * eager_error + FLOOR[case.dtype]
    print(f"{case} {what}: error {error:.3g}, eager {eager_error:.3g}")
    assert error <= bound, (f"{case} {what}: compiled logits {error:.3g} from the float32 model's, eager's "
                            f"{eager_error:.3g} (bound {bound:.3g})\n{_summary(reports)}")


def _check_sites(case: Case, reports: list[GraphReport], m: int, what: str) -> list[SiteReport]:
    """The graphs compiled for one shape fuse at least the family's projections at that M, where the device
    runs them (the reference composite on the CPU, Helion on the GPU)."""
    summary = _summary(reports)
    assert reports, f"{case} {what}: nothing compiled"
    assert all(r.error is None for r in reports), summary
    fused = [s for r in reports for s in r.sites if s.m == m and s.runs_on == RUNS_ON[case.device]]
    print(f"{case} {what}: {len(fused)} site(s) on {RUNS_ON[case.device]}")
    assert len(fused) >= FAMILIES[case.family].min_sites, \
        f"{case} {what}: {len(fused)} fused site(s), expected >= {FAMILIES[case.family].min_sites}\n{summary}"
    return fused


def _cache_argument(model: torch.nn.Module) -> str:
    """How the model's forward takes the KV cache: ``cache`` from transformers 5.24, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize("case", _cases(decode=False))
def test_prefill_matches_float32_like_eager(case: Case) -> None:
    """A prefill without cache: the compiled logits are about as close to the float32 model as eager's, and the
    graph fuses every projection."""
    reference, model = _models(case)
    compiled = _compile(model, case)
    gen = torch.Generator(device=case.device).manual_seed(1)
    what = f"prefill {case.batch}x{case.length}"
    with torch.no_grad():
        for _ in range(CALLS[case.device]):
            ids = _tokens(case, gen, case.batch, case.length)
            expected = reference(ids, use_cache=False).logits
            eager = model(ids, use_cache=False).logits
            got = compiled(ids, use_cache=False).logits
            _check_error(case, got, eager, expected, what, helion_backend.get_reports())
    _check_sites(case, helion_backend.get_reports(), case.batch * case.length, what)


@pytest.mark.parametrize("case", _cases(decode=True))
def test_static_cache_decode_matches_float32_like_eager(case: Case) -> None:
    """Decode steps on a static cache that an eager prefill filled: each step's compiled logits are about as
    close to the float32 model as eager's, and the step's graph fuses every projection at M = batch."""
    reference, model = _models(case)
    steps = CALLS[case.device]
    caches = [transformers.StaticCache(config=reference.config, max_cache_len=PROMPT + steps) for _ in range(3)]
    cache_argument = _cache_argument(model)
    gen = torch.Generator(device=case.device).manual_seed(1)
    prompt = _tokens(case, gen, case.batch, PROMPT)
    with torch.no_grad():
        for runner, cache in zip((reference, model, model), caches):
            runner(prompt, use_cache=True, **{cache_argument: cache})
        compiled = _compile(model, case)
        for step in range(steps):
            what = f"decode step {step} at batch {case.batch}"
            token = _tokens(case, gen, case.batch, 1)
            before = len(helion_backend.get_reports())
            expected, eager, got = [runner(token, use_cache=True, **{cache_argument: cache}).logits
                                    for runner, cache in zip((reference, model, compiled), caches)]
            compiled_now = helion_backend.get_reports()[before:]
            _check_error(case, got, eager, expected, what, compiled_now or helion_backend.get_reports())
            # The first step compiles; a later one only where a guard fails, and when what it recompiles holds
            # no GEMM (OPT's position ids), the projections run in the graph checked at step 0.
            if step == 0 or any(r.sites or r.unfused_gemms for r in compiled_now):
                _check_sites(case, compiled_now, case.batch, what)
