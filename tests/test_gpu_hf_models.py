"""Hugging Face decoders on the GPU: built from small configs (random weights, no downloads), compiled with
the backend, their fused sites running the Helion kernels under CUDA graphs.

They run with the transformers the GPU image has (5.17.0) and skip where it has none; to try another
version in addition, carry its wheel and install it beside Helion's.
"""

import copy

import pytest
import torch

import helion_backend
from helion_backend.compile.placing import MIN_KERNEL_K

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 256, 512, 2, 1024


def config(name: str):
    attention = {"num_attention_heads": 4, "num_key_value_heads": 2}
    sizes = {"hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS,
             "vocab_size": VOCAB}
    return {
        "llama": lambda: transformers.LlamaConfig(**sizes, **attention),
        "qwen3": lambda: transformers.Qwen3Config(**sizes, **attention, head_dim=64),
        "mistral": lambda: transformers.MistralConfig(**sizes, **attention),
        # GPT-2's Conv1D runs addmm with a [K, N] weight.
        "gpt2": lambda: transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=4, vocab_size=VOCAB,
                                                n_positions=128, bos_token_id=0, eos_token_id=0),
    }[name]()


# Per layer q, k and v (one launch), o, the gated gate/up and down for the Llama family; c_attn, c_proj,
# c_fc (+ GELU) and the MLP's c_proj for GPT-2; plus the LM head.
EXPECTED_SITES = {"llama": 6 * LAYERS + 1, "qwen3": 6 * LAYERS + 1, "mistral": 6 * LAYERS + 1, "gpt2": 4 * LAYERS + 1}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def model_of(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config(name)).to("cuda", dtype).eval()


@pytest.mark.parametrize("name", sorted(EXPECTED_SITES))
def test_bf16_decoder_runs_every_projection_in_helion_and_matches_float32(name):
    """A bf16 prefill of 2 x 7 tokens (M = 14): every projection of every layer is a Helion site, and the
    logits, replayed under CUDA graphs on fresh tokens, are as close to the float32 model as eager bf16."""
    model = model_of(name, torch.bfloat16)
    reference = copy.deepcopy(model).float()
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor")
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            ids = torch.randint(0, VOCAB, (2, 7), device="cuda")
            expected = reference(ids).logits
            eager_error = rel_err(model(ids).logits, expected)
            assert rel_err(compiled(ids).logits, expected) <= max(1.5 * eager_error, 1e-2), eager_error
    every = [s for r in helion_backend.get_reports() for s in r.sites]
    # Some transformers versions write the rotary angles as a K = 1 product: never a kernel's.
    found = [s for s in every if s.k >= MIN_KERNEL_K]
    assert all(s.runs_on == "inductor" for s in every if s.k < MIN_KERNEL_K)
    assert len(found) == EXPECTED_SITES[name], [r.summary() for r in helion_backend.get_reports()]
    assert all(s.runs_on == "helion" and s.m == 14 for s in found), [(s.anchor, s.runs_on, s.why) for s in found]
    if name != "gpt2":
        assert sum(s.kernel == "gemm_multi" for s in found) == 3 * LAYERS
        assert sum(s.kernel == "gemm_glu" for s in found) == LAYERS


def generate(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static", **kwargs)


@pytest.mark.parametrize("how", ["compile_config", "compiled_forward"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_generate_with_a_static_cache_matches_eager(name, how):
    """Greedy ``generate`` with the static cache in float32 (so that rounding cannot flip a token): the
    decode steps (M = 2, the norms fused only at M = 1) run Helion under CUDA graphs and pick eager's tokens.

    On CUDA with a static cache ``generate`` compiles the decode step itself (with Inductor, unless its
    ``compile_config`` names another backend), so the reference turns that off. The backend runs either
    through that ``compile_config`` (CUDA graphs on) or as the user's own compiled ``forward`` with
    generate's off; the latter without CUDA graphs, since the prefill then also runs in the compiled code
    and the cache's lazily made tensors would be outputs of a CUDA graph that the decode steps overwrite
    (PyTorch's cudagraph trees refuse that, as with ``mode="reduce-overhead"``)."""
    model = model_of(name, torch.float32)
    ids = torch.randint(0, VOCAB, (2, 7), device="cuda")
    with torch.no_grad():
        expected = generate(model, ids, disable_compile=True)
        helion_backend.clear_reports()
        if how == "compile_config":
            got = generate(model, ids, compile_config=transformers.CompileConfig(backend="helion_inductor"))
        else:
            model.forward = torch.compile(model.forward, backend="helion_inductor", options={"cudagraphs": False})
            got = generate(model, ids, disable_compile=True)
    assert torch.equal(got, expected)
    def gemms(report):
        return [s for s in report.sites if s.k >= MIN_KERNEL_K]

    decode_graphs = [r for r in helion_backend.get_reports() if {s.m for s in gemms(r)} == {2}]
    assert decode_graphs, [r.summary() for r in helion_backend.get_reports()]
    assert all(s.runs_on == "helion" for s in gemms(decode_graphs[-1])), decode_graphs[-1].summary()
