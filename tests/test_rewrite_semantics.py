"""The rewrite preserves what the program computes: 3-D inputs, dynamic M, shared intermediates,
two GEMMs feeding one add, dtypes, strides, training, and CPU graphs left alone by default."""

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from helpers import CPU_REWRITE, WITHOUT_GATED, compile_run, randn, rel_err, sites

from helion_backend.compile.context import GemmSite, Step
from helion_backend.compile.passes import legality


def test_three_d_linear_with_residual(op_calls):
    x, w, b, r = randn(2, 5, 32), randn(48, 32), randn(48), randn(2, 5, 48)
    fn = lambda x, w, b, r: F.gelu(F.linear(x, w, b), approximate="tanh") + r  # noqa: E731
    out, reports = compile_run(fn, x, w, b, r)
    (site,) = sites(reports)
    assert site.epilogue == ["bias", "gelu_tanh", "residual"] and site.m == 10
    assert out.shape == (2, 5, 48) and op_calls.count == 1
    assert rel_err(out, fn(x.double(), w.double(), b.double(), r.double())) < 1e-5


@pytest.mark.parametrize("leading", [(), (2,)], ids=["2d", "3d"])
def test_dynamic_tokens_route_each_call_on_its_m(leading, op_calls):
    """One Dynamo compile serves every M; M <= max_helion_size runs the rewrite, larger M plain Inductor."""
    import helion_backend

    w, b = randn(48, 32), randn(48)
    fn = lambda x: F.silu(F.linear(x, w, b))  # noqa: E731
    compiled = torch.compile(fn, backend="helion_inductor",
                             options={"rewrite_on_cpu": True, "max_helion_size": 8})
    rows = len(leading) and leading[0]
    seen = []
    for tokens in (3, 5, 40, 8, 9, 2):
        x = randn(*leading, tokens, 32)
        torch._dynamo.mark_dynamic(x, x.dim() - 2)
        out = compiled(x)
        assert rel_err(out, F.silu(F.linear(x.double(), w.double(), b.double()))) < 1e-5
        seen.append(tokens * (rows or 1))
    fused = [m for m in seen if m <= 8]
    assert op_calls.count == len(fused), (seen, op_calls.epilogues)
    (report,) = helion_backend.get_reports()
    assert [s.m for s in report.sites] == ["dynamic"]


def test_token_router_needs_every_site_within_its_own_limit():
    """Two sites with different Helion limits (say a measured crossover of 4 and the default 32): a
    call runs the rewritten variant only if each site's M is within its own limit."""
    from helion_backend.runtime.token_routing import TokenRouter

    router = TokenRouter(small=lambda *a: "small", large=lambda *a: "large",
                         site_ms=lambda args: [args[0], 2 * args[0]], limits=[32, 8])
    assert [router(m) for m in (1, 4, 5, 16, 33)] == ["small", "small", "large", "large", "large"]


def test_intermediate_with_two_users_is_not_swallowed(op_calls):
    x, w, b = randn(6, 32), randn(48, 32), randn(48)

    def fn(x, w, b):
        h = F.linear(x, w, b)
        return F.gelu(h), h * 3.0

    out, reports = compile_run(fn, x, w, b)
    (site,) = sites(reports)
    assert site.epilogue == ["bias"] and "also read by" in site.notes[0]
    ref = fn(x.double(), w.double(), b.double())
    assert all(rel_err(o, r) < 1e-5 for o, r in zip(out, ref))


def test_activation_region_with_outside_user_stops_before_it(op_calls):
    x, w = randn(6, 32), randn(48, 32)

    def fn(x, w):
        h = x @ w.t()
        return torch.sigmoid(h) * h, torch.sigmoid(h)  # sigmoid(h) is shared: silu cannot take it

    out, reports = compile_run(fn, x, w)
    ref = fn(x.double(), w.double())
    assert all(rel_err(o, r) < 1e-5 for o, r in zip(out, ref))
    assert all("silu" not in s.epilogue for s in sites(reports))


def test_two_gemms_summed_are_fused_once(op_calls):
    x, w1, w2 = randn(6, 32), randn(48, 32), randn(48, 32)
    fn = lambda x, w1, w2: F.linear(x, w1) + F.linear(x, w2)  # noqa: E731
    out, reports = compile_run(fn, x, w1, w2)
    found = sites(reports)
    assert sorted(s.epilogue for s in found) == [[], ["residual"]]
    assert rel_err(out, fn(x.double(), w1.double(), w2.double())) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_half_precision_matches_float64(dtype, op_calls):
    x, w, b, r = randn(6, 64, dtype=dtype), randn(96, 64, dtype=dtype), randn(96, dtype=dtype), randn(6, 96, dtype=dtype)
    fn = lambda x, w, b, r: F.gelu(F.linear(x, w, b), approximate="tanh") * 0.5 + r  # noqa: E731
    out, reports = compile_run(fn, x, w, b, r)
    assert sites(reports)[0].dtype == str(dtype).removeprefix("torch.")
    assert out.dtype == dtype and op_calls.count == 1
    assert rel_err(out, fn(x.double(), w.double(), b.double(), r.double())) < 1e-2


def test_cast_to_float32_output(op_calls):
    x, w = randn(6, 64, dtype=torch.bfloat16), randn(96, 64, dtype=torch.bfloat16)
    fn = lambda x, w: F.relu(x @ w.t()).float()  # noqa: E731
    out, reports = compile_run(fn, x, w)
    (site,) = sites(reports)
    assert site.epilogue[-1] == "cast" and out.dtype == torch.float32
    assert rel_err(out, fn(x.double(), w.double())) < 1e-2


def test_non_contiguous_weight_and_activation(op_calls):
    w_store, x_store = randn(64, 48), randn(32, 12)
    w = w_store[::2]  # [32, 48] with row stride 96
    x = x_store.t()  # [12, 32], transposed strides
    fn = lambda x, w: F.relu(x @ w) * 2.0  # noqa: E731
    out, reports = compile_run(fn, x, w)
    assert sites(reports)[0].epilogue == ["relu", "scale"]
    assert rel_err(out, fn(x.double(), w.double())) < 1e-5


def test_cpu_graphs_are_reported_but_left_to_inductor_by_default(op_calls):
    x, w, b = randn(6, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
    out, reports = compile_run(fn, x, w, b, options={})
    (site,) = sites(reports)
    assert site.runs_on == "inductor" and "rewrite_on_cpu" in site.why
    assert op_calls.count == 0
    assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5


def test_training_step_gradients_match_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(64, 32))
    reference = torch.nn.Sequential(*[m for m in __import__("copy").deepcopy(model)])
    x = randn(8, 32)
    compiled = torch.compile(model, backend="helion_inductor", options={"rewrite_on_cpu": True})
    loss = compiled(x).square().mean()
    loss.backward()
    ref_loss = reference(x).square().mean()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    import helion_backend

    kinds = {r.kind for r in helion_backend.get_reports()}
    assert {"forward", "backward"} <= kinds


def test_operand_computed_from_the_gemm_stops_the_site():
    """The reachability check: a step whose operand depends on the GEMM is never fused."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    mm = graph.call_function(torch.ops.aten.mm.default, (x, w))
    derived = graph.call_function(torch.ops.aten.neg.default, (mm,))
    add = graph.call_function(torch.ops.aten.add.Tensor, (mm, derived))
    graph.output(add)
    site = GemmSite(anchor=mm, forms=frozenset({"mm"}), x=x, weight=w, weight_layout="kn", m=4, k=8, n=8,
                    dtype=torch.float32, device=torch.device("cpu"), gemm_input=x,
                    chain=[Step("residual", [add], operand=derived)])
    # Pretend nothing else reads mm, so only the reachability check can object.
    legal, why = legality._legal_prefix(site, {derived, add}, claimed=set())
    assert legal == [] and "cycle" in why


def test_a_failing_rewrite_leaves_the_site_to_inductor(monkeypatch, op_calls, no_compile_caches):
    """A bug in the rewrite costs the site its fusion, not the model: the report says why."""
    from helion_backend.compile.passes import rewrite

    def broken(*args, **kwargs):
        raise RuntimeError("injected rewrite failure")

    monkeypatch.setattr(rewrite, "_replace", broken)
    x, w, b = randn(4, 32), randn(48, 32), randn(48)
    fn = lambda x, w, b: F.gelu(F.linear(x, w, b))  # noqa: E731
    out, reports = compile_run(fn, x, w, b)
    assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5
    (site,) = sites(reports)
    assert site.runs_on == "inductor" and "injected rewrite failure" in site.why
    assert op_calls.count == 0


def test_run_time_fallbacks_are_noted_in_the_site_report():
    import helion_backend
    from helion_backend import report

    x, w = randn(4, 32), randn(48, 32)
    _, reports = compile_run(lambda x, w: torch.relu(x @ w.t()), x, w)
    (site,) = sites(reports)
    report.record_fallback(report.site_id(reports[0].graph, site.anchor), "M=4: Helion kernel failed (boom)")
    (site,) = sites(helion_backend.get_reports())
    assert site.fallbacks == ["M=4: Helion kernel failed (boom)"]
    assert "fallback: M=4: Helion kernel failed (boom)" in reports[0].summary()


def test_rows_padded_by_inductor_are_seen_through(op_calls):
    """On CUDA, Inductor's pad_mm pads an unaligned M (34 -> 40) and slices the product back: the site
    is the real M, fuses the epilogue past the slice, and multiplies the unpadded rows."""
    x, w, b = randn(34, 48), randn(48, 64), randn(64)

    def fn(x, w, b):
        padded = torch.constant_pad_nd(x, [0, 0, 0, 6])
        return F.gelu((padded @ w)[:-6, :] + b)  # as pad_mm slices it back

    out, reports = compile_run(fn, x, w, b, options={"rewrite_on_cpu": True, "max_helion_size": 64})
    (site,) = sites(reports)
    assert (site.m, site.epilogue, site.runs_on) == (34, ["bias", "gelu"], "reference"), site
    assert op_calls.count == 1
    assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5


@pytest.mark.parametrize("how", ["constant_pad", "cat_zeros"])
def test_addmm_whose_input_was_padded_too_reads_it_unpadded(how, op_calls):
    """pad_mm pads an addmm's [M, N] input with the rows (``cat`` with zeros): the site's residual is the
    input before its padding, and a slice that drops the padded rows must stay inside the site."""
    x, w, r = randn(10, 48), randn(48, 64), randn(10, 64)

    def fn(x, w, r):
        zeros = torch.zeros(6, 64, dtype=r.dtype)
        padded_r = torch.constant_pad_nd(r, [0, 0, 0, 6]) if how == "constant_pad" else torch.cat([r, zeros])
        return torch.addmm(padded_r, torch.constant_pad_nd(x, [0, 0, 0, 6]), w)[:-6, :].tanh()

    out, reports = compile_run(fn, x, w, r)
    (site,) = sites(reports)
    assert (site.m, site.epilogue) == (10, ["residual"]), site
    assert op_calls.count == 1
    assert rel_err(out, fn(x.double(), w.double(), r.double())) < 1e-5


def test_a_slice_that_keeps_other_rows_is_not_seen_through(op_calls):
    """A slice that keeps rows other than the unpadded ones: the GEMM is a site of the padded shape (and none
    of the epilogue past the slice fuses), never a wrong one. (Padding K and N: tests/test_padded_gemms.py.)"""
    x, w, b = randn(10, 48), randn(48, 64), randn(64)

    def fn(x, w, b):
        return F.relu((torch.constant_pad_nd(x, [0, 0, 0, 6]) @ w)[2:12] + b)

    out, reports = compile_run(fn, x, w, b)
    (site,) = sites(reports)
    assert site.m == 16 and site.epilogue == [], site
    assert rel_err(out, fn(x.double(), w.double(), b.double())) < 1e-5


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "two_sites"])
def test_a_site_reading_earlier_sites_results_reads_the_fused_ones(gated, op_calls, tmp_path):
    """A decoder layer's residual stream: the down projection reads the gate site's product as x and
    the attention output's residual sum as its residual, both replaced by earlier sites. It must read
    their fused results; holding the original nodes kept them alive, so the attention output and gate
    GEMMs ran a second time through cuBLAS (and the fused gate kernel was dropped as dead)."""
    h, i = 32, 64
    w_o, w_gate, w_up, w_down = randn(h, h), randn(i, h), randn(i, h), randn(h, i)

    def fn(x, a, w_o, w_gate, w_up, w_down):
        x = x + F.linear(a, w_o)
        return x + F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)

    args = (randn(4, h), randn(4, h), w_o, w_gate, w_up, w_down)
    options = {**(CPU_REWRITE if gated else WITHOUT_GATED), "debug_dir": str(tmp_path)}
    out, reports = compile_run(fn, *args, options=options)
    gate_up = [["silu", "up_mul"]] if gated else [["silu", "mul"], []]
    assert [s.epilogue for s in sites(reports)] == [["residual"], *gate_up, ["residual"]]
    assert op_calls.count == 2 + len(gate_up), op_calls.epilogues
    (after,) = tmp_path.glob("*/after.py")
    assert "aten.mm" not in after.read_text()
    assert rel_err(out, fn(*(t.double() for t in args))) < 1e-5


def test_a_site_whose_rule_stops_at_the_gemm_still_ends_past_the_unpadding_slice(op_calls):
    """Found by the GPU fuzzer: an addmm with a bias on padded rows, then a step outside the vocabulary.
    The rule keeps only the bias; cutting the chain there dropped the slice, so the fused op (real rows)
    replaced the padded product and the slice after it removed real rows (Inductor failed to compile)."""
    x, w, b, col = randn(5, 24), randn(24, 32), randn(32), randn(5, 1)

    def fn(x, w, b, col):
        return torch.addmm(b, torch.constant_pad_nd(x, [0, 0, 0, 3]), w)[:-3] + col

    out, reports = compile_run(fn, x, w, b, col)
    (site,) = sites(reports)
    assert (site.m, site.epilogue) == (5, ["bias"]), site
    assert op_calls.count == 1
    assert rel_err(out, fn(x.double(), w.double(), b.double(), col.double())) < 1e-5



def test_expanded_operand_of_a_float_product_stays_a_full_multiply():
    """A float GEMM's ``y * t.expand(M, N)`` is a full-shape ``mul`` (the float rules take no per-token scale);
    only an integer product reads such a scale broadcast (tests/test_quantized_sites.py, torchao's int8 form)."""
    w, column = randn(64, 32), randn(8, 1)

    def fn(x):
        return x @ w.t() * column.expand(8, 64)

    x = randn(8, 32)
    out, reports = compile_run(fn, x)
    (site,) = sites(reports)
    assert site.epilogue == ["mul"], site
    torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)
