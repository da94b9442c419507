"""RMSNorm feeding a GEMM fuses as the ``rmsnorm`` prologue: which sites take it, which do not and why,
and that the rewritten graph (the reference path, ``rewrite_on_cpu``) computes what eager does."""

from __future__ import annotations

import helpers
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import NORMS_FUSED, compile_run, diagonal, rel_err, sites

import helion_backend
from helion_backend.compile.trace import trace_sites
from helion_backend.options import BackendOptions
from helion_backend.semantics.norm import RmsNormSpec, parse_spec, rms_norm

# The norm fuses at every M these tests use (the bound has a test of its own).
CPU_REWRITE = {**helpers.CPU_REWRITE, **NORMS_FUSED}
WITHOUT_GATED = {**helpers.WITHOUT_GATED, **NORMS_FUSED}
D, KV, FF = 64, 32, 96
# Eager against the rewritten graph: the norm is bit-identical, the GEMM and epilogue round differently.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class HFRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm/Qwen3RMSNorm (and benchmarks/decode.py's): fp32, cast back, weight *."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size).normal_(1.0, 0.1))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def nn_rmsnorm(size: int, eps: float | None = 1e-5) -> nn.RMSNorm:
    norm = nn.RMSNorm(size, eps=eps)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    return norm


class Block(nn.Module):
    """A Llama-style decoder block without attention's softmax: q/k/v and gate/up read normalized rows."""

    def __init__(self, norm=HFRMSNorm, post_norm=None) -> None:
        super().__init__()
        self.input_norm, self.post_norm = norm(D), (post_norm or norm)(D)
        self.q, self.k, self.v = nn.Linear(D, D, bias=False), nn.Linear(D, KV, bias=False), nn.Linear(D, KV, bias=False)
        self.o = nn.Linear(D, D, bias=False)
        self.gate, self.up, self.down = (nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False),
                                         nn.Linear(FF, D, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_norm(x)
        kv = self.k(h) * self.v(h)
        x = x + self.o(self.q(h) * torch.cat([kv, kv], -1))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("dtype, norm", diagonal([torch.float32, torch.bfloat16], [HFRMSNorm, nn_rmsnorm]))
def test_block_fuses_the_norms_into_qkv_and_gate_up_and_matches_eager(norm, dtype):
    torch.manual_seed(0)
    model = Block(norm).to(dtype).eval()
    x = torch.randn(2, 4, D, dtype=dtype)
    with torch.no_grad():
        expected = model(x)
        # Without the gated rules, so that gate and up are sites of their own, each with the norm.
        got, reports = compile_run(model, x, options=WITHOUT_GATED)
        fresh = torch.randn(2, 4, D, dtype=dtype)  # the compiled graph, not a constant, on new inputs
        assert rel_err(torch.compile(model, backend="helion_inductor",
                                     options=WITHOUT_GATED)(fresh), model(fresh)) <= TOLERANCE[dtype]
    assert rel_err(got, expected) <= TOLERANCE[dtype]
    found = sites(reports)
    assert len(found) == 7 and all(s.runs_on == "reference" for s in found)
    normed = sorted((s.k, s.n) for s in found if s.prologue == ["rmsnorm"])
    # q, k, v read the input norm; gate and up the post-attention norm; o and down read no norm.
    assert normed == sorted([(D, D), (D, KV), (D, KV), (D, FF), (D, FF)]), [r.summary() for r in reports]
    assert all(s.prologue == [] for s in found if s.k == FF or (s.k, s.n, s.epilogue) == (D, D, ["residual"]))


def test_sites_carry_each_norms_own_eps():
    """Two norms with different eps: each site's fused norm uses the eps its own norm adds."""
    torch.manual_seed(0)
    model = Block(lambda d: HFRMSNorm(d, 1e-6), post_norm=lambda d: HFRMSNorm(d, 1e-2)).eval()
    x = torch.randn(1, 3, D) * 0.05  # small rows, so that eps matters
    found = trace_sites(model, x)
    eps = {site.anchor.name: site.rms_norm.spec.eps for site in found if site.rms_norm is not None}
    assert sorted(set(eps.values())) == [1e-6, 1e-2] and len(eps) == 5
    with torch.no_grad():
        got, _ = compile_run(model, x, options=CPU_REWRITE)
        assert rel_err(got, model(x)) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spellings_record_the_rounding_they_do(dtype):
    """Hugging Face rounds to the input dtype before the weight multiply; F.rms_norm multiplies in fp32."""
    x = torch.randn(4, D, dtype=dtype)
    for norm, rounds in ((HFRMSNorm(D), True), (nn_rmsnorm(D), False)):
        linear = nn.Linear(D, KV, bias=False)
        model = nn.Sequential(norm, linear).to(dtype)
        (site,) = trace_sites(model, x)
        assert [s.name for s in site.prologue] == ["rmsnorm"]
        assert site.rms_norm.spec.round_before_weight == (rounds and dtype != torch.float32)


def test_nn_rmsnorm_default_eps_is_the_dtype_epsilon():
    (site,) = trace_sites(nn.Sequential(nn_rmsnorm(D, eps=None), nn.Linear(D, KV)), torch.randn(3, D))
    assert site.rms_norm.spec.eps == torch.finfo(torch.float32).eps


def _single_site_note(fn, *args) -> str:
    (site,) = trace_sites(fn, *args)
    assert not site.prologue, site.prologue
    (note,) = [n for n in site.notes if n.startswith("RMSNorm not fused")]
    return note


W, G = torch.randn(KV, D), torch.randn(D)


def test_eps_added_in_two_places_is_not_fused():
    def fn(x):
        h = x.float()
        return F.linear(G * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6 + 1e-5)), W)

    # Decompositions fold nothing here: the rsqrt reads (mean + eps1) + eps2, which the kernel does not compute.
    assert "not mean(x^2) + eps" in _single_site_note(fn, torch.randn(3, D))


def test_norm_over_another_dim_is_not_fused():
    def fn(x):
        return F.linear(G * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)), W)

    assert "reduces over dim [0]" in _single_site_note(fn, torch.randn(3, D))


def test_norm_in_low_precision_is_not_fused():
    def fn(x):
        return F.linear(G.bfloat16() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), W.bfloat16())

    assert "computes in bfloat16" in _single_site_note(fn, torch.randn(3, D, dtype=torch.bfloat16))


def test_normalized_value_with_another_reader_stays_unfused_and_correct():
    norm, linear = HFRMSNorm(D), nn.Linear(D, KV, bias=False)

    def fn(x):
        h = norm(x)
        return linear(h), h.sum(-1)

    x = torch.randn(2, 3, D)
    assert "also read by" in _single_site_note(fn, x)
    with torch.no_grad():
        (out, total), reports = compile_run(fn, x, options=CPU_REWRITE)
        ref_out, ref_total = fn(x)
    (site,) = sites(reports)
    assert site.prologue == [] and any("also read by" in n for n in site.notes)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(total, ref_total) <= 1e-5


@pytest.mark.slow
def test_dynamic_m_fuses_and_every_size_matches_eager(op_calls):
    """A dynamic token count: small M runs the fused op (the prologue in its reference), large M the plain
    Inductor variant with the norm unfused; both compute what eager does."""
    torch.manual_seed(0)
    model = Block().eval()
    compiled = torch.compile(model, backend="helion_inductor", options={**WITHOUT_GATED, "max_helion_size": 8})
    with torch.no_grad():
        for tokens in (3, 40, 5):
            x = torch.randn(1, tokens, D)
            torch._dynamo.mark_dynamic(x, 1)
            before = op_calls.count
            assert rel_err(compiled(x), model(x)) <= 1e-5, tokens
            assert (op_calls.count > before) == (tokens <= 8), tokens
    found = sites(helion_backend.get_reports())
    assert found and all(not isinstance(s.m, int) for s in found)
    assert sum(s.prologue == ["rmsnorm"] for s in found) == 5


def test_eps_lifted_to_an_input_by_dynamic_true_is_not_fused():
    """``dynamic=True`` makes the norm's eps a graph input: the kernel takes eps as a constant, so the norm
    stays unfused, the note says why, and the result is still eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(HFRMSNorm(D), nn.Linear(D, KV, bias=False)).eval()
    x = torch.randn(1, 3, D)
    with torch.no_grad():
        got, reports = compile_run(model, x, options=CPU_REWRITE, dynamic=True)
        assert rel_err(got, model(x)) <= 1e-5
    (site,) = sites(reports)
    assert site.prologue == [] and any("eps is a graph input" in n for n in site.notes), site.notes


def test_reference_is_eager_bit_for_bit():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, D, dtype=dtype)
        norm = HFRMSNorm(D).to(dtype)
        spec = RmsNormSpec(norm.variance_epsilon, dtype != torch.float32)
        with torch.no_grad():
            assert torch.equal(rms_norm(x, norm.weight, spec), norm(x))
            torch_norm = nn_rmsnorm(D, 1e-5).to(dtype)
            assert torch.equal(rms_norm(x, torch_norm.weight, RmsNormSpec(1e-5, False)), torch_norm(x))


def test_spec_round_trips_and_bad_specs_are_refused():
    spec = RmsNormSpec(9.999999974752427e-07, True)
    assert parse_spec(spec.to_json()) == spec
    for bad in ("", "{}", '{"eps": "1", "round_before_weight": true}', '{"eps": 1e-6}'):
        with pytest.raises(ValueError, match="norm_spec"):
            parse_spec(bad)


def test_a_higher_ranked_rule_without_the_prologue_wins_and_the_norm_stays(tmp_path):
    """A user's rule that ranks above the shipped ones keeps the site; the norm is not fused there."""
    rules = tmp_path / "mine.toml"
    rules.write_text('[[rule]]\nname = "my_silu"\nanchor = ["linear"]\nepilogue = ["silu"]\npriority = 100\n')
    model = nn.Sequential(HFRMSNorm(D), nn.Linear(D, KV, bias=False), nn.SiLU()).eval()
    x = torch.randn(2, 3, D)
    with torch.no_grad():
        got, reports = compile_run(model, x, options={**WITHOUT_GATED, "rules": [*WITHOUT_GATED["rules"], str(rules)]})
        assert rel_err(got, model(x)) <= 1e-5
    (site,) = sites(reports)
    assert site.rule == "my_silu" and site.prologue == []
    assert any("rule my_silu ranks higher" in n for n in site.notes), site.notes


def test_a_norm_whose_input_an_earlier_site_took_on_ends_that_site_and_fuses(op_calls):
    """The last layer's residual sum has one reader, the final norm's float cast, so the down projection's
    site would end with that cast, the sum inside it. The cast only feeds the norm: the down site ends at
    the sum instead, and the lm_head's prologue reads it and casts it itself (the down GEMM still runs
    once; nothing is left to a kernel of its own)."""
    torch.manual_seed(3)
    norm = HFRMSNorm(D).to(torch.bfloat16)
    w_down, w_head = torch.randn(D, FF, dtype=torch.bfloat16) / FF**0.5, torch.randn(KV, D, dtype=torch.bfloat16)

    def fn(h, r):
        return F.linear(norm(r + F.linear(h, w_down)), w_head)

    h, r = torch.randn(4, FF, dtype=torch.bfloat16), torch.randn(4, D, dtype=torch.bfloat16)
    with torch.no_grad():
        out, reports = compile_run(fn, h, r, options=CPU_REWRITE)
        expected = fn(h, r)
    down, head = sites(reports)
    assert down.epilogue == ["residual"] and head.prologue == ["rmsnorm"], (down, head)
    assert any("rmsnorm prologue of the next site reads it and takes cast itself" in n for n in down.notes), down.notes
    assert not any("unfused GEMM runs as well" in note for site in (down, head) for note in site.notes)
    assert op_calls.count == 2
    assert rel_err(out, expected) <= TOLERANCE[torch.bfloat16]


def test_a_norm_whose_input_an_earlier_site_cannot_end_at_is_not_fused(op_calls, tmp_path):
    """Where the earlier site, ended at the norm's input, would fit no rule (here the only residual rule
    takes the cast too), it keeps its epilogue: the norm stays unfused, the lm_head reads its result, and
    the report says why."""
    torch.manual_seed(4)
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rule]]\nname = "residual_then_cast"\nanchor = ["mm", "linear"]\n'
                     'epilogue = ["residual", "cast"]\n\n'
                     '[[rule]]\nname = "normed"\nanchor = ["mm", "linear"]\nprologue = ["rmsnorm?"]\n'
                     'epilogue = ["bias?"]\npriority = -1\n')
    norm = HFRMSNorm(D).to(torch.bfloat16)
    w_down, w_head = torch.randn(D, FF, dtype=torch.bfloat16) / FF**0.5, torch.randn(KV, D, dtype=torch.bfloat16)

    def fn(h, r):
        return F.linear(norm(r + F.linear(h, w_down)), w_head)

    h, r = torch.randn(4, FF, dtype=torch.bfloat16), torch.randn(4, D, dtype=torch.bfloat16)
    options = {**CPU_REWRITE, "builtin_rules": False, "rules": [str(rules)]}
    with torch.no_grad():
        out, reports = compile_run(fn, h, r, options=options)
        expected = fn(h, r)
    down, head = sites(reports)
    assert (down.rule, down.epilogue, head.prologue) == ("residual_then_cast", ["residual", "cast"], []), (down, head)
    assert any("rmsnorm not fused: its input" in note for note in head.notes), head.notes
    assert op_calls.count == 2
    assert rel_err(out, expected) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("m, limit, fused", [(9, 8, False), (8, 8, True), (9, 16, True), (2, None, False),
                                             (1, None, True)])
def test_the_norm_fuses_only_up_to_rmsnorm_prologue_max_m(m, limit, fused):
    """Above the option's M (default 1) the norm's own kernel is faster than every output tile computing
    its rows' statistics: the norm stays a kernel of its own, with a note."""
    torch.manual_seed(0)
    model = nn.Sequential(HFRMSNorm(D), nn.Linear(D, FF, bias=False)).eval()
    x = torch.randn(m, D)
    options = {"rewrite_on_cpu": True, **({} if limit is None else {"rmsnorm_prologue_max_m": limit})}
    limit = BackendOptions().rmsnorm_prologue_max_m if limit is None else limit
    with torch.no_grad():
        got, reports = compile_run(model, x, options=options)
        assert rel_err(got, model(x)) <= TOLERANCE[torch.float32]
    (site,) = sites(reports)
    assert site.runs_on == "reference" and site.prologue == (["rmsnorm"] if fused else [])
    assert any(f"M={m} > rmsnorm_prologue_max_m={limit}" in n for n in site.notes) != fused, site.notes


def test_float16_rows_keep_the_norm_unfused_and_say_why():
    """The kernels multiply x by the norm's weight before they scale the rows, which can overflow float16
    where the normalized rows do not (rows of 1e4, weight 4): the norm stays a kernel of its own, and the
    model still matches eager."""
    torch.manual_seed(0)
    model = nn.Sequential(HFRMSNorm(D), nn.Linear(D, FF, bias=False)).to(torch.float16).eval()
    with torch.no_grad():
        model[0].weight.fill_(4.0)
    x = torch.randn(4, D, dtype=torch.float16) * 1e4
    with torch.no_grad():
        got, reports = compile_run(model, x, options=CPU_REWRITE)
        expected = model(x)
    (site,) = sites(reports)
    assert site.runs_on == "reference" and site.prologue == [], site
    assert any("float16 rows times the norm's weight could overflow" in n for n in site.notes), site.notes
    assert torch.isfinite(expected).all() and rel_err(got, expected) <= 2e-3


# --------------------------------------------------------------------------------------------------
# The gated MLP rules: the gate/up pair's kernel runs the norm for both projections.


class NormedMLP(nn.Module):
    """A Llama/Qwen3 decoder layer's MLP half: the post-attention norm, gate and up, silu * up, down, residual."""

    def __init__(self, norm=HFRMSNorm) -> None:
        super().__init__()
        self.norm = norm(D)
        self.gate, self.up = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down = nn.Linear(FF, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("dtype, norm, lead", diagonal([torch.float32, torch.bfloat16], [HFRMSNorm, nn_rmsnorm],
                                                      [(5,), (2, 3)]))
def test_gated_pair_fuses_the_norm_and_matches_eager(dtype, norm, lead, op_calls):
    torch.manual_seed(0)
    model = NormedMLP(norm).to(dtype).eval()
    compiled = torch.compile(model, backend="helion_inductor", options=CPU_REWRITE)
    with torch.no_grad():
        for _ in range(2):  # the compiled graph, not a constant, on fresh inputs
            x = torch.randn(*lead, D, dtype=dtype)
            assert rel_err(compiled(x), model(x)) <= TOLERANCE[dtype]
    gate, down = sites(helion_backend.get_reports())
    assert (gate.rule, gate.kernel, gate.prologue, gate.epilogue) == ("gated_mlp", "gemm_glu", ["rmsnorm"],
                                                                      ["silu", "up_mul"]), gate
    assert not any(note.startswith("RMSNorm not fused") for note in gate.notes), gate.notes
    assert (down.prologue, down.epilogue) == ([], ["residual"]), down
    assert op_calls.count == 4  # two calls of the gated op and of the down projection's: gate and up are one


def test_gated_pair_of_differently_normalized_activations_is_not_formed():
    """Gate and up must read the same normalized rows for the kernel's one norm to serve both: with the
    up projection reading the raw rows, or rows of another norm, each projection keeps its own site."""
    torch.manual_seed(1)
    model, other = NormedMLP().eval(), HFRMSNorm(D)
    for up_input in (lambda x: x, other):
        def fn(x, up_input=up_input):
            return F.silu(model.gate(model.norm(x))) * model.up(up_input(x))

        x = torch.randn(4, D)
        with torch.no_grad():
            got, reports = compile_run(fn, x, options=CPU_REWRITE)
            assert rel_err(got, fn(x)) <= TOLERANCE[torch.float32]
        gate, up = sites(reports)
        assert gate.rule != "gated_mlp" and gate.prologue == ["rmsnorm"], gate
        assert up.prologue == ([] if up_input is not other else ["rmsnorm"]), up


def test_gated_pair_whose_normalized_value_has_another_reader_reads_it():
    torch.manual_seed(3)
    model = NormedMLP().eval()

    def fn(x):
        h = model.norm(x)
        return F.silu(model.gate(h)) * model.up(h), h.sum(-1)

    x = torch.randn(4, D)
    with torch.no_grad():
        (got, total), reports = compile_run(fn, x, options=CPU_REWRITE)
        expected, expected_total = fn(x)
    assert rel_err(got, expected) <= 1e-5 and rel_err(total, expected_total) <= 1e-5
    (gate,) = sites(reports)
    assert (gate.rule, gate.prologue) == ("gated_mlp", []), gate
    assert sum(note.startswith("RMSNorm not fused: the normalized value is also read by") for note in gate.notes) == 1, \
        gate.notes


def test_gated_rule_without_a_prologue_reads_the_normalized_activation(tmp_path):
    """A gated rule that takes no prologue still fuses the pair (it ranks above the rules that take the
    norm); the norm then runs before the kernel, and the site's note says so."""
    rules = tmp_path / "gated.toml"
    rules.write_text('[[rule]]\nname = "my_gated"\nanchor = ["linear"]\nkernel = "gemm_glu"\n'
                     'epilogue = ["silu", "up_mul"]\npriority = 50\n')
    torch.manual_seed(2)
    model = NormedMLP().eval()
    x = torch.randn(2, 3, D)
    with torch.no_grad():
        got, reports = compile_run(model, x, options={**WITHOUT_GATED, "rules": [*WITHOUT_GATED["rules"], str(rules)]})
        assert rel_err(got, model(x)) <= TOLERANCE[torch.float32]
    gate, _ = sites(reports)
    assert (gate.rule, gate.prologue) == ("my_gated", []), gate
    assert any("rule my_gated ranks higher and takes no prologue" in note for note in gate.notes), gate.notes


def test_a_pair_that_does_not_fuse_keeps_the_gate_site_as_matched(tmp_path):
    """A user's rule above the gated one takes the gate alone, without the norm: the pairing that fails
    must leave that site as it was, not bring the norm back under a rule that takes none."""
    rules = tmp_path / "mine.toml"
    rules.write_text('[[rule]]\nname = "my_silu"\nanchor = ["linear"]\nepilogue = ["silu"]\npriority = 100\n')
    torch.manual_seed(4)
    model = NormedMLP().eval()
    x = torch.randn(2, 3, D)
    with torch.no_grad():
        got, reports = compile_run(model, x, options={**CPU_REWRITE, "rules": [str(rules)]})
        assert rel_err(got, model(x)) <= TOLERANCE[torch.float32]
    gate = next(s for s in sites(reports) if s.rule == "my_silu")
    assert gate.prologue == [] and any("rule my_silu ranks higher" in note for note in gate.notes), gate
