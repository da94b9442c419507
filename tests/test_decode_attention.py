"""Decode attention: ``scaled_dot_product_attention`` with a few query rows per head becomes the
``decode_attention`` op (the Helion kernel on CUDA, PyTorch's attention on a CPU with ``rewrite_on_cpu``);
everything else keeps PyTorch's kernel, with the reason in the report."""

import helpers
import pytest
import torch
import torch.nn.functional as F
from helpers import CPU_REWRITE, compile_run, rel_err

from helion_backend.options import BackendOptions

B, H, L, D = 2, 4, 50, 16


def attention_then_project(q, k, v, mask, weight):
    """A decode step's attention and the projection that reads it, as models write them."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(q.shape[0] * q.shape[2], -1) @ weight


def inputs(rows: int, mask_kind: str, dtype=torch.float32):
    q, k, v = torch.randn(B, H, rows, D, dtype=dtype), torch.randn(B, H, L, D, dtype=dtype), torch.randn(
        B, H, L, D, dtype=dtype)
    lengths = torch.tensor([17, 41])  # each sequence attends to its own prefix of the cache
    keep = (torch.arange(L)[None, :] < lengths[:, None]).view(B, 1, 1, L)
    mask = {"none": None, "bool": keep,
            "bias": torch.randn(B, 1, rows, L, dtype=dtype).masked_fill(~keep, float("-inf"))}[mask_kind]
    return q, k, v, mask, torch.randn(H * D, 8, dtype=dtype)


def float64_reference(q, k, v, mask, weight):
    mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    return attention_then_project(q.double(), k.double(), v.double(), mask, weight.double())


def attention_reports(reports):
    return [a for r in reports for a in r.attention]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "bias"])
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_attention_is_rewritten_and_matches_float64(rows, mask_kind):
    args = inputs(rows, mask_kind)
    out, reports = compile_run(attention_then_project, *args)
    assert rel_err(out, float64_reference(*args)) <= helpers.TOLERANCE[torch.float32]
    (site,) = attention_reports(reports)
    assert (site.batch, site.heads, site.rows, site.kv_len, site.head_dim) == (B, H, rows, L, D)
    assert site.runs_on == "reference" and site.mask == mask_kind, site.summary()


def test_the_boolean_mask_is_read_as_is(tmp_path, no_compile_caches):
    """The graph turns a boolean mask into a float bias (where(mask, 0, -inf)); the op reads the boolean,
    so that no bias tensor is computed, and the attention node is gone."""
    args = inputs(4, "bool")
    _, reports = compile_run(attention_then_project, *args, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    after = next(tmp_path.glob("*/after.py")).read_text()
    assert "decode_attention.default(" in after
    assert "aten._scaled_dot_product" not in after and "aten.where" not in after, after


@pytest.mark.parametrize("spelling", ["where_keep", "where_not_keep", "masked_fill"])
def test_a_boolean_mask_written_as_a_bias_is_read_as_the_boolean(spelling):
    """PyTorch's attention turns a boolean mask into a bias in one of these forms (cuDNN's: where(~keep,
    -inf, 0)); written by the model, they are recognized the same."""
    q, k, v, keep, weight = inputs(2, "bool")
    to_bias = {
        "where_keep": lambda m: torch.where(m, 0.0, float("-inf")),
        "where_not_keep": lambda m: torch.where(m.logical_not(), float("-inf"), 0.0),
        "masked_fill": lambda m: torch.zeros(m.shape).masked_fill(~m, float("-inf")),
    }[spelling]
    out, reports = compile_run(lambda *a: attention_then_project(*a[:3], to_bias(a[3]), a[4]), q, k, v, keep, weight)
    assert rel_err(out, float64_reference(q, k, v, keep, weight)) <= helpers.TOLERANCE[torch.float32]
    assert [a.mask for a in attention_reports(reports)] == ["bool"]


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Hugging Face's repeat_kv: each key/value head repeated for the query heads of its group."""
    b, h_kv, length, d = t.shape
    return t[:, :, None, :, :].expand(b, h_kv, groups, length, d).reshape(b, h_kv * groups, length, d)


@pytest.mark.parametrize("spelling", ["repeat_kv", "enable_gqa"])
def test_grouped_query_attention_reads_each_cache_once(spelling, tmp_path, no_compile_caches):
    """4 query heads over 2 key/value heads: keys and values repeated by the model (repeat_kv) are read before
    the repeat, as SDPA's own enable_gqa form is; the repeat is gone from the graph."""

    def grouped(q, k, v, mask):
        if spelling == "repeat_kv":
            return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    q, _, _, mask, _ = inputs(1, "bool")
    k, v = torch.randn(B, H // 2, L, D), torch.randn(B, H // 2, L, D)
    out, reports = compile_run(grouped, q, k, v, mask, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
    assert rel_err(out, expected) <= helpers.TOLERANCE[torch.float32]
    (site,) = attention_reports(reports)
    assert (site.heads, site.kv_heads, site.runs_on) == (H, H // 2, "reference"), site.summary()
    after = next(tmp_path.glob("*/after.py")).read_text()
    assert "aten.expand" not in after and "aten.clone" not in after, after


def test_a_site_reads_through_other_graph_users_of_the_mask():
    """Two attention nodes of one mask (two layers) both become decode ops and both stay right."""

    def two_layers(q, k, v, mask, weight):
        first = attention_then_project(q, k, v, mask, weight)
        return first + attention_then_project(q * 0.5, v, k, mask, weight)

    args = inputs(2, "bool")
    out, reports = compile_run(two_layers, *args)
    q, k, v, mask, weight = (a.double() if a.dtype != torch.bool else a for a in args)
    expected = attention_then_project(q, k, v, mask, weight) + attention_then_project(q * 0.5, v, k, mask, weight)
    assert rel_err(out, expected) <= helpers.TOLERANCE[torch.float32]
    assert [a.runs_on for a in attention_reports(reports)] == ["reference", "reference"]


def unfused_reason(fn, *args, options=None, **compile_kwargs) -> str:
    out, reports = compile_run(fn, *args, options=options, **compile_kwargs)
    (site,) = attention_reports(reports)
    assert site.runs_on == "inductor"
    return site.why


def test_a_prefill_keeps_pytorchs_kernel_and_says_why():
    args = inputs(17, "bool")
    assert "rows=17 > decode_attention_max_rows=16" in unfused_reason(attention_then_project, *args)
    options = {**CPU_REWRITE, "decode_attention_max_rows": 0}
    assert "decode_attention_max_rows=0" in unfused_reason(attention_then_project, *inputs(1, "bool"),
                                                           options=options)


def test_a_one_position_cache_keeps_pytorchs_kernel():
    """A one-token prompt without a cache attends one key per head: the decode kernel (whose Helion tiling of
    a length of one is wrong: 0.34 from the float32 model on the GPU) leaves it to PyTorch."""
    q, k, v = (torch.randn(B, H, 1, D) for _ in range(3))
    weight = torch.randn(H * D, 8)
    assert "L=1" in unfused_reason(attention_then_project, q, k, v, None, weight)


def test_is_causal_and_dynamic_shapes_are_refused():
    q, k, v, _, _ = inputs(4, "none")
    assert "is_causal" in unfused_reason(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), q, k, v)
    assert "dynamic shapes" in unfused_reason(F.scaled_dot_product_attention, q, k, v, dynamic=True)


def test_a_training_graph_keeps_pytorchs_kernel():
    """The backward reads the forward's log-sum-exp, which the decode kernel does not produce."""
    q, k, v, _, _ = inputs(4, "none")
    q.requires_grad_()
    helpers.helion_backend.clear_reports()
    out = torch.compile(F.scaled_dot_product_attention, backend="helion_inductor", options=CPU_REWRITE)(q, k, v)
    out.sum().backward()
    forward = [a for r in helpers.helion_backend.get_reports() if r.kind == "forward" for a in r.attention]
    assert forward and all(a.runs_on == "inductor" and "log-sum-exp" in a.why for a in forward)
    expected = torch.func.grad(lambda q_: F.scaled_dot_product_attention(q_, k, v).sum())(q.detach())
    torch.testing.assert_close(q.grad, expected)


def cudnn_style_bias(q, k, v, keep, weight):
    """What SDPA makes of a boolean mask for cuDNN (torch 2.11 on the H200): a bias in the query's dtype,
    0 where the mask keeps and a finite -65504 (rounded to that dtype) elsewhere."""
    bias = torch.where(keep, torch.zeros((), dtype=q.dtype), torch.full((), -65504.0, dtype=q.dtype))
    return attention_then_project(q, k, v, bias, weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_finite_fill_is_read_as_the_boolean_and_its_bias(tmp_path, no_compile_caches, dtype):
    """where(keep, 0, -65504) is read as keep plus the bias its masked positions add, exactly: a row whose
    positions are all masked then attends to all of them (as cuDNN computes it), not to none."""
    q, k, v, keep, weight = inputs(4, "bool", dtype)
    keep = keep.expand(B, 1, 4, L).clone()
    keep[1, :, 2] = False  # one row with nothing to attend to
    args = (q, k, v, keep, weight)
    out, reports = compile_run(cudnn_style_bias, *args, options={**CPU_REWRITE, "debug_dir": str(tmp_path)})
    (site,) = attention_reports(reports)
    fill = torch.tensor(-65504.0, dtype=dtype).item()
    assert site.runs_on == "reference" and site.mask == f"bool (masked positions add {fill:g})", site.summary()
    assert "aten.where" not in next(tmp_path.glob("*/after.py")).read_text()
    # Against the unfused graph: -65504 + a logit, in float32, already rounds the masked row's logits.
    assert rel_err(out, cudnn_style_bias(*args)) <= helpers.TOLERANCE[dtype]


def test_a_fill_in_another_dtype_than_the_query_stays_a_bias():
    """A finite fill is added in the bias's rounding, which the kernel only reproduces in the query's dtype:
    a float32 bias beside bfloat16 queries stays a bias (and computes as before)."""
    q, k, v, keep, weight = inputs(1, "bool", torch.bfloat16)

    def float32_bias(q, k, v, keep, weight):
        return attention_then_project(q, k, v, torch.where(keep, torch.zeros(()), torch.full((), -1e30)), weight)

    out, reports = compile_run(float32_bias, q, k, v, keep, weight)
    (site,) = attention_reports(reports)
    assert site.mask == "bias", site.summary()
    assert rel_err(out, float32_bias(q, k, v, keep, weight)) <= helpers.TOLERANCE[torch.bfloat16]


def test_a_cpu_graph_without_rewrite_on_cpu_is_left_alone():
    why = unfused_reason(attention_then_project, *inputs(1, "bool"), options={})
    assert "rewrite_on_cpu" in why


def test_bad_option_value_is_refused():
    with pytest.raises(ValueError, match="decode_attention_max_rows"):
        BackendOptions.from_user({"decode_attention_max_rows": -1})
    with pytest.raises(TypeError, match="decode_attention_max_rows"):
        BackendOptions.from_user({"decode_attention_max_rows": 2.5})


def test_the_op_returns_the_strides_of_the_node_it_replaces():
    """Views the graph took of the replaced node were traced with its strides (e.g. cuDNN's [B, R, H, D]
    memory order), so the op's result keeps them."""
    q, k, v, mask, _ = inputs(3, "bias")
    stride = torch.empty(B, 3, H, D).transpose(1, 2).stride()
    out = torch.ops.helion_inductor.decode_attention(q, k, v, mask, 0.3, float("-inf"), list(stride), "test")
    assert out.stride() == stride
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.3)
    assert rel_err(out, expected) <= helpers.TOLERANCE[torch.float32]


@pytest.mark.slow
def test_the_decode_benchmarks_model_runs_every_layers_attention_as_the_op():
    """The benchmark's decoder (benchmarks/decode.py): one op per layer, the logits of eager at every step."""
    from test_decode_benchmark import TINY, decode

    model = decode.build_model(TINY, torch.float32, torch.device("cpu"), seed=0)
    model.allocate_cache(2, TINY.context, seed=1)
    tokens = torch.randint(0, TINY.vocab, (2,))
    with torch.no_grad():
        expected = [model(tokens, torch.tensor([p])) for p in (TINY.context, TINY.context + 1)]
        model.allocate_cache(2, TINY.context, seed=1)
        helpers.helion_backend.clear_reports()
        compiled = torch.compile(model, backend="helion_inductor", options=CPU_REWRITE)
        got = [compiled(tokens, torch.tensor([p])) for p in (TINY.context, TINY.context + 1)]
    for g, e in zip(got, expected):
        assert rel_err(g, e) <= 1e-5
    found = attention_reports(helpers.helion_backend.get_reports())
    assert len(found) == TINY.layers and all(a.runs_on == "reference" and a.mask == "bool" for a in found), found
