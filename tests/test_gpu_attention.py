"""The decode attention kernel on the GPU: numerics against float64 at decode shapes (default configs, so
split caches and their combine run), and the decode benchmark's model compiled under CUDA graphs."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from test_decode_benchmark import decode

import helion_backend

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mask_kind", ["bool", "bool_finite", "bias", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, rows, kv_len, head_dim", [(1, 4, 1024, 128), (8, 1, 777, 64), (32, 4, 1024, 128),
                                                            (3, 16, 300, 128)])
def test_decode_attention_kernel_matches_float64(batch, rows, kv_len, head_dim, dtype, mask_kind):
    from helion_backend.kernels.attention import decode_attention_helion

    heads = 8
    q = torch.randn(batch, heads, rows, head_dim, device="cuda", dtype=dtype)
    # The cache stored [B, L, H, D] in one case, to read strided keys and values.
    k, v = (torch.randn(batch, heads, kv_len, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    if batch == 3:
        k, v = (torch.randn(batch, kv_len, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
                for _ in range(2))
    lengths = torch.randint(1, kv_len + 1, (batch,), device="cuda")
    keep = (torch.arange(kv_len, device="cuda")[None, :] < lengths[:, None]).view(batch, 1, 1, kv_len)
    mask = {"none": None, "bool": keep, "bool_finite": keep,
            "bias": torch.randn(batch, 1, rows, kv_len, device="cuda", dtype=dtype).masked_fill(~keep, float("-inf"))}
    mask = mask[mask_kind]
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    # cuDNN's fill for a boolean mask, rounded to the dtype: the masked positions' bias.
    masked_bias = torch.tensor(-65504.0, dtype=dtype).item() if mask_kind == "bool_finite" else float("-inf")
    decode_attention_helion(q, k, v, mask, out=out, masked_bias=masked_bias)
    double_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    if mask_kind == "bool_finite":
        double_mask = torch.where(keep, 0.0, masked_bias).double()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=double_mask)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_a_static_cache_is_not_read_past_each_sequence(batch):
    """Qwen3-8B's heads over a 1024-position cache whose positions past each sequence's length hold NaN (never
    written): with a boolean mask (fill -inf) no chunk reads them, at the default splits of each batch."""
    from helion_backend.kernels.attention import decode_attention_helion

    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.randint(1, 1025, (batch,), device="cuda")
    keep = (torch.arange(1024, device="cuda")[None, :] < lengths[:, None]).view(batch, 1, 1, 1024)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, enable_gqa=True)
    past = ~keep.view(batch, 1, 1024, 1).expand(batch, 8, 1024, 128)
    k, v = k.masked_fill(past, float("nan")), v.masked_fill(past, float("nan"))
    out = decode_attention_helion(q, k, v, keep)
    assert not out.isnan().any() and rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("batch", [1, 8])
def test_grouped_query_heads_match_float64(batch):
    """Qwen3-8B's heads as Hugging Face passes them (32 query heads of one row over 8 key/value heads): a
    key/value head's four query heads are the kernel's rows."""
    from helion_backend.kernels.attention import decode_attention_helion

    q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(batch, 8, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    keep = torch.arange(1024, device="cuda").view(1, 1, 1, 1024) < 700
    out = torch.full_like(q, float("nan"))
    decode_attention_helion(q, k, v, keep, out=out)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, enable_gqa=True)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_step_under_cuda_graphs_matches_eager(batch):
    """The benchmark's decoder in bf16 (two layers, Qwen3-8B's head layout): every layer's attention runs the
    kernel, and the logits replayed over several steps are as close to a float32 copy as eager bf16's."""
    config = dataclasses.replace(decode.SMOKE_CONFIG, hidden=1024, intermediate=2048, heads=32, kv_heads=8,
                                 head_dim=128, layers=2, vocab=512, context=300, max_len=1024)
    model = decode.build_model(config, torch.bfloat16, torch.device("cuda"), seed=0)
    reference = decode.build_model(config, torch.float32, torch.device("cuda"), seed=0)
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    for m in (model, reference):
        m.allocate_cache(batch, config.context, seed=1)
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor")
    with torch.no_grad():
        for step in range(4):  # warm-up, record, replays
            tokens = torch.randint(0, config.vocab, (batch,), device="cuda")
            pos = torch.tensor([config.context + step], device="cuda")
            got = compiled(tokens, pos)
            expected = reference(tokens, pos)
            # Eager bf16 from the same cache state: the compiled step already wrote this position's keys,
            # which the eager step rewrites with the same values.
            eager_error = rel_err(model(tokens, pos), expected.double())
            assert rel_err(got, expected.double()) <= max(1.5 * eager_error, 1e-2), eager_error
    found = [a for r in helion_backend.get_reports() for a in r.attention]
    # The boolean, read back from the bias the graph made of it (cuDNN's finite fill on torch 2.11's H200 graph).
    assert len(found) == config.layers and all(a.runs_on == "helion" for a in found), found
    assert all(a.mask.startswith("bool") for a in found), [a.mask for a in found]
    assert not any(a.fallbacks for a in found)
