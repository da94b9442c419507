"""Hugging Face decoders built from tiny configs (random weights, no downloads) compile and match eager,
and the report shows every projection of every layer as a fused site."""

import helpers
import pytest
import torch
from helpers import CPU_REWRITE, QUANT_IN_KERNEL, slow_except

import helion_backend

transformers = pytest.importorskip("transformers")

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 64, 128, 2, 128


def config(name: str):
    attention = {"num_attention_heads": 4, "num_key_value_heads": 2}
    return {
        "llama": lambda: transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                  num_hidden_layers=LAYERS, vocab_size=VOCAB, **attention),
        "qwen3": lambda: transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                  num_hidden_layers=LAYERS, vocab_size=VOCAB, head_dim=16,
                                                  **attention),
        "mistral": lambda: transformers.MistralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                      num_hidden_layers=LAYERS, vocab_size=VOCAB, **attention),
        # GPT-2's Conv1D runs addmm with a [K, N] weight.
        "gpt2": lambda: transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, vocab_size=VOCAB,
                                                n_positions=64, bos_token_id=0, eos_token_id=0),
    }[name]()


NORMS_FUSED = {**CPU_REWRITE, **helpers.NORMS_FUSED}

# Per layer: q, k, v, o, gate and up (one gated site: silu(gate) * up), down, for the Llama family; c_attn,
# c_proj, c_fc (+gelu), mlp c_proj for GPT-2; plus the LM head. Quantized gate and up stay two sites (the
# gated kernel is a float one).
EXPECTED_SITES = {"llama": 6 * LAYERS + 1, "qwen3": 6 * LAYERS + 1, "mistral": 6 * LAYERS + 1, "gpt2": 4 * LAYERS + 1}
QUANTIZED_SITES = 7 * LAYERS + 1


@pytest.mark.parametrize("name", slow_except({"llama"}, sorted(EXPECTED_SITES)))
def test_decoder_matches_eager_and_fuses_every_projection(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(name)).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        # 14 rows: above the default rmsnorm_prologue_max_m, which would keep the norms as kernels of their own.
        compiled = torch.compile(model, backend="helion_inductor", options={**NORMS_FUSED})
        got = compiled(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    found = [s for r in helion_backend.get_reports() for s in r.sites]
    assert len(found) == EXPECTED_SITES[name], [r.summary() for r in helion_backend.get_reports()]
    assert all(s.runs_on == "reference" and s.m == 14 for s in found)
    epilogues = {tuple(s.epilogue) for s in found}
    if name == "gpt2":
        assert ("bias", "gelu_tanh") in epilogues and ("bias", "residual") in epilogues
    else:
        assert ("silu", "up_mul") in epilogues and ("residual",) in epilogues
        # Every layer's q, k, v (input norm) and gated gate/up (post-attention norm) take their RMSNorm as the
        # prologue, and so does the LM head (the final norm; the slice of all positions is gone post-grad).
        assert sum(s.prologue == ["rmsnorm"] for s in found) == 4 * LAYERS + 1, \
            [r.summary() for r in helion_backend.get_reports()]


@pytest.mark.slow  # the zoo's decode case keeps a static-cache step in the default run
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_generate_with_a_static_cache_matches_eager(name):
    """Greedy ``generate`` with the static cache (prefill, then one-token decode steps of M = batch):
    the compiled model picks the same tokens, and its decode graph fuses every projection at M = 2."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(name)).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
        helion_backend.clear_reports()
        model.forward = torch.compile(model.forward, backend="helion_inductor", options={"rewrite_on_cpu": True})
        got = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(got, expected)
    decode_graphs = [r for r in helion_backend.get_reports() if {s.m for s in r.sites} == {2}]
    assert decode_graphs and len(decode_graphs[-1].sites) == EXPECTED_SITES[name], \
        [r.summary() for r in helion_backend.get_reports()]


@pytest.mark.parametrize("fmt, options", [
    pytest.param("fp8_dynamic", CPU_REWRITE, marks=pytest.mark.slow), pytest.param("fp8_dynamic", QUANT_IN_KERNEL, marks=pytest.mark.slow),
    pytest.param("int8_dynamic", CPU_REWRITE, marks=pytest.mark.slow),
    pytest.param("int8_dynamic", QUANT_IN_KERNEL, marks=pytest.mark.slow),
    pytest.param("int8_weight_only", CPU_REWRITE, marks=pytest.mark.slow),
], ids=["fp8_dynamic", "fp8_dynamic-kernel_quant", "int8_dynamic", "int8_dynamic-kernel_quant", "int8_weight_only"])
def test_quantized_decoder_fuses_every_projection(fmt, options):
    """A Qwen3 decoder quantized with the project's helper: every linear (LM head included) is a quantized
    site, and the compiled logits match the eager quantized model. Weight-only sites take their
    dequantization as the prologue; fp8 and int8 sites read the rows Inductor quantized (with the norm or
    residual add that produces them), or with ``fuse_activation_quant`` quantize them in their prologue."""
    from helion_backend.layers.quantize import quantize

    torch.manual_seed(0)
    model = quantize(transformers.AutoModelForCausalLM.from_config(config("qwen3")).eval(), fmt)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        helion_backend.clear_reports()
        got = torch.compile(model, backend="helion_inductor", options=options)(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4
    found = [s for r in helion_backend.get_reports() for s in r.sites]
    summary = [r.summary() for r in helion_backend.get_reports()]
    in_kernel = fmt == "int8_weight_only" or options.get("fuse_activation_quant", False)
    # On rows Inductor quantized, each layer's gate and up are one site (gemm_glu_fp8 / gemm_glu_int8), and q,
    # k and v share a launch (gemm_multi_fp8 / gemm_multi_int8).
    siblings = fmt in ("fp8_dynamic", "int8_dynamic") and not in_kernel
    sites_expected = QUANTIZED_SITES - (LAYERS if siblings else 0)
    assert len(found) == sites_expected, summary
    if siblings:
        kernels = [s.kernel for s in found]
        suffix = "fp8" if fmt == "fp8_dynamic" else "int8"
        assert kernels.count(f"gemm_glu_{suffix}") == LAYERS and kernels.count(f"gemm_multi_{suffix}") == 3 * LAYERS, \
            summary
    assert all(bool(s.prologue) == in_kernel and s.runs_on == "reference" for s in found), summary
    left = [any("left to Inductor" in note for note in s.notes) for s in found]
    assert left == [not in_kernel] * sites_expected, summary


@pytest.mark.parametrize("name", slow_except({"llama"}, ["llama", "qwen3"]))
def test_gated_mlp_rules_fuse_gate_and_up_in_every_layer(name):
    """Each layer's gate and up projections are one site (``rules/gated_mlp.toml``), whose kernel runs the
    post-attention norm."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(name)).eval()
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        helion_backend.clear_reports()
        got = torch.compile(model, backend="helion_inductor", options=NORMS_FUSED)(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    found = [s for r in helion_backend.get_reports() for s in r.sites]
    assert len(found) == EXPECTED_SITES[name], [r.summary() for r in helion_backend.get_reports()]
    gated = [s for s in found if s.rule == "gated_mlp"]
    assert len(gated) == LAYERS and all(s.prologue == ["rmsnorm"] for s in gated), gated
