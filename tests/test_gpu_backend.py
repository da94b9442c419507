"""The backend end to end on a CUDA GPU: Helion sites under cudagraph trees, static and dynamic M."""

import copy
import json

import helion
import pytest
import torch
import torch.nn.functional as F

import helion_backend
from helion_backend import tables

pytestmark = pytest.mark.gpu

K, N = 512, 768


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_weights(dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype, generator=g)
    return w, b


EPILOGUES = {
    "none": (lambda x, w, b, r: F.linear(x, w), []),
    "bias": (lambda x, w, b, r: F.linear(x, w, b), ["bias"]),
    "bias_gelu_tanh": (lambda x, w, b, r: F.gelu(F.linear(x, w, b), approximate="tanh"), ["bias", "gelu_tanh"]),
    "bias_gelu": (lambda x, w, b, r: F.gelu(F.linear(x, w, b)), ["bias", "gelu"]),
    "silu": (lambda x, w, b, r: F.silu(F.linear(x, w)), ["silu"]),
    "relu_scale": (lambda x, w, b, r: torch.relu(F.linear(x, w, b)) * 0.5, ["bias", "relu", "scale"]),
    "sigmoid_mul": (lambda x, w, b, r: torch.sigmoid(F.linear(x, w)) * r, ["sigmoid", "mul"]),
    "residual": (lambda x, w, b, r: F.linear(x, w, b) + r, ["bias", "residual"]),
}


@pytest.mark.parametrize("name", sorted(EPILOGUES))
@pytest.mark.parametrize("m", [1, 16, 33])
def test_static_m_sites_run_where_they_should_and_replay_correctly(name, m):
    fn, steps = EPILOGUES[name]
    w, b = make_weights()
    compiled = torch.compile(fn, backend="helion_inductor")  # CUDA graphs on by default
    for call in range(4):  # the first calls warm up and record; later ones replay the CUDA graph
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, N, device="cuda", dtype=torch.bfloat16)
        out = compiled(x, w, b, r)
        ref = fn(x.double(), w.double(), b.double(), r.double())
        assert rel_err(out, ref) <= 1e-2, (name, m, call)
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert site.epilogue == steps
    assert site.runs_on == ("helion" if m <= 32 else "inductor"), site


def test_dynamic_m_crosses_the_threshold_under_cudagraphs():
    w, b = make_weights()
    fn = lambda x, r: F.gelu(F.linear(x, w, b), approximate="tanh") + r  # noqa: E731
    compiled = torch.compile(fn, backend="helion_inductor")
    for m in (1, 8, 32, 33, 64, 512, 4, 32, 64, 2):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, N, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
        for _ in range(3):
            out = compiled(x, r)
        ref = F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh") + r.double()
        assert rel_err(out, ref) <= 1e-2, m
    sites = [s for rep in helion_backend.get_reports() for s in rep.sites]
    # Dynamo specializes M == 1 into a graph of its own; every other M shares the dynamic one.
    assert [s.runs_on for s in sites if s.m == "dynamic"] == ["helion"]
    assert all(s.runs_on == "helion" for s in sites if s.m == 1)


def test_three_d_mlp_block_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(K, N), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(N, K))
    model = model.cuda().to(torch.bfloat16).eval()
    compiled = torch.compile(model, backend="helion_inductor")
    x = torch.randn(2, 4, K, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
        ref = copy.deepcopy(model).double()(x.double())
    assert rel_err(out, ref) <= 1e-2
    runs = [s.runs_on for rep in helion_backend.get_reports() for s in rep.sites]
    assert runs == ["helion", "helion"]


def write_user_table(cache_dir, leads: dict[int, float], k: int = K, n: int = N) -> None:
    """A user config table measuring Helion ``leads[m]`` times faster than the fallback at (K, N, m)."""
    from helion_backend.kernels import configs

    entries = [{"dtype": "bfloat16", "k": k, "n": n, "m": m, "us": 10.0, "fallback_us": 10.0 * lead,
                "helion_wins": lead > 1, "config": dict(configs.default_config(m, k, n, torch.bfloat16))}
               for m, lead in leads.items()]
    folder = cache_dir / "configs"
    folder.mkdir(parents=True)
    (folder / f"{tables.gpu_key(torch.device('cuda'))}.json").write_text(json.dumps({"entries": entries}))
    configs.forget_tables()


@pytest.mark.default_placement
def test_measured_verdicts_place_static_and_dynamic_m(tmp_path, op_calls, no_compile_caches):
    """A config table that measured cuBLAS + Inductor winning at M=16 at this shape keeps M=16 with Inductor
    (static M, decided at compile time) and routes dynamic M=16 calls to the plain variant; M=4 runs Helion."""
    from helion_backend.kernels import configs

    write_user_table(tmp_path, {1: 1.3, 2: 1.2, 4: 1.2, 8: 1.2, 16: 0.9})
    options = {"cache_dir": str(tmp_path)}
    w, b = make_weights()
    fn = lambda x: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
    try:
        for m in (4, 16):
            torch._dynamo.reset()
            helion_backend.clear_reports()
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            out = torch.compile(fn, backend="helion_inductor", dynamic=False, options=options)(x)
            assert rel_err(out, F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")) <= 1e-2
            (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
            assert (site.runs_on, site.evidence) == ("helion" if m <= 8 else "inductor", {str(m): "exact"}), site
            if m > 8:
                assert "measured faster at M=16 (evidence exact" in site.why
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="helion_inductor", options=options)
        for m, fused in ((4, True), (16, False), (8, True)):
            calls = op_calls.count
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)  # only M: dynamic=True would make K and N symbolic too
            out = compiled(x)
            assert rel_err(out, F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")) <= 1e-2
            assert (op_calls.count > calls) == fused, m
    finally:
        configs.forget_tables()


@pytest.mark.default_placement
def test_an_untuned_shape_stays_with_inductor_by_default(tmp_path):
    """K x N = 512 x 768 is in no table, nor anything within 1.5x of it: the site runs cuBLAS + Inductor's
    epilogue, says so, and the manifest lists it for the tuner."""
    from helion_backend.manifest import read_manifest

    w, b = make_weights()
    fn = lambda x: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
    x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
    out = torch.compile(fn, backend="helion_inductor", options={"cache_dir": str(tmp_path)})(x)
    assert rel_err(out, F.gelu(F.linear(x.double(), w.double(), b.double()), approximate="tanh")) <= 1e-2
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert (site.runs_on, site.evidence) == ("inductor", {"8": "none"}), site
    assert "evidence none" in site.why
    (listed,) = read_manifest(tmp_path / "manifest.json")
    assert (listed.k, listed.n, listed.static_m) == (K, N, frozenset({8}))


@pytest.mark.expects_fallback
@pytest.mark.parametrize("fault", ["compile", "bad_config"])
def test_failing_helion_kernel_falls_back_with_a_warning(fault, monkeypatch, caplog):
    """A kernel that cannot compile (injected), or a config invalid for the shape, costs the site its
    fusion, not the model its output: one warning naming the site, a note in the report, right numbers."""
    from helion_backend.kernels import gemm
    from helion_backend.runtime import dispatch

    if fault == "compile":
        def broken(*args, **kwargs):
            raise RuntimeError("injected compile failure")

        monkeypatch.setattr(gemm, "compiled_kernel", broken)
    else:
        bad = helion.Config(block_sizes=[16, 24, 100], num_warps=4, num_stages=3, split_k=1)
        monkeypatch.setattr(gemm, "config_for", lambda *args, **kwargs: bad)
    monkeypatch.setattr(dispatch, "_FAILED", {})
    w, b = make_weights()
    fn = lambda x: F.silu(F.linear(x, w, b))  # noqa: E731
    compiled = torch.compile(fn, backend="helion_inductor")
    with caplog.at_level("WARNING", logger="helion_backend.runtime.dispatch"):
        for _ in range(3):  # warm-up, record, replay
            x = torch.randn(8, K, device="cuda", dtype=torch.bfloat16)
            out = compiled(x)
            assert rel_err(out, F.silu(F.linear(x.double(), w.double(), b.double()))) <= 1e-2
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert site.runs_on == "helion" and len(site.fallbacks) == 1, site
    warnings = [r.getMessage() for r in caplog.records if "runs its reference" in r.getMessage()]
    assert len(warnings) == 1 and site.anchor in warnings[0], warnings


@pytest.mark.parametrize("m", [1, 16, 33])
def test_gated_mlp_kernel_under_cuda_graphs(m):
    """The gated-MLP rule: gate and up in one Helion kernel, replayed under CUDA graphs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gate, w_up = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5 for _ in range(2))
    fn = lambda x: F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)  # noqa: E731
    helion_backend.clear_reports()
    compiled = torch.compile(fn, backend="helion_inductor")
    for _ in range(4):
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        out = compiled(x)
        ref = F.silu(x.double() @ w_gate.double().t()) * (x.double() @ w_up.double().t())
        assert rel_err(out, ref) <= 1e-2
    (site,) = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert site.rule == "gated_mlp" and site.runs_on == ("helion" if m <= 32 else "inductor"), site


class _HFRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: fp32, rounded back to the input dtype, then times the weight."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(size).normal_(1.0, 0.1))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rmsnorm(spelling: str) -> torch.nn.Module:
    """Hugging Face's norm ("hf") or ``nn.RMSNorm``, with a weight that is not all ones."""
    if spelling == "hf":
        return _HFRMSNorm(K)
    norm = torch.nn.RMSNorm(K, eps=1e-5)
    torch.nn.init.normal_(norm.weight, 1.0, 0.1)
    return norm


class _NormedQKV(torch.nn.Module):
    """An attention block's input norm read by q (with a bias), k and v; each GEMM takes it as a prologue."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.norm = _rmsnorm(spelling)
        self.q, self.k, self.v = torch.nn.Linear(K, N), torch.nn.Linear(K, N // 2, bias=False), \
            torch.nn.Linear(K, N // 2, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h), F.silu(self.k(h)), self.v(h) + 1


# Above the default (1): both ways of taking the rows' statistics (the K loop, a first pass) run.
NORMS_UP_TO_8 = {"rmsnorm_prologue_max_m": 8}


@pytest.mark.parametrize("spelling", ["hf", "nn_rmsnorm"])
@pytest.mark.parametrize("m", [1, 8, 32, 33])
def test_rmsnorm_prologue_under_cuda_graphs(m, spelling):
    """q/k/v in one launch with the norm fused (M <= 8: one row in the K loop, more in a first pass) or not
    (M = 32), or norm + GEMMs left to Inductor (M = 33), against float64, replayed under CUDA graphs on
    fresh inputs."""
    torch.manual_seed(0)
    model = _NormedQKV(spelling).cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model).double()
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor", options=NORMS_UP_TO_8)
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(1, m, K, device="cuda", dtype=torch.bfloat16) * 2
            outs, refs = compiled(x), reference(x.double())
            for out, ref in zip(outs, refs):
                assert rel_err(out, ref) <= 1e-2, (m, call)
    found = [s for rep in helion_backend.get_reports() for s in rep.sites]
    # The norm fuses up to rmsnorm_prologue_max_m; q, k and v share one launch where they run Helion.
    assert len(found) == 3 and all(s.prologue == (["rmsnorm"] if m <= 8 else []) for s in found), found
    assert all(s.runs_on == ("helion" if m <= 32 else "inductor") for s in found), found
    assert all(s.kernel == ("gemm_multi" if m <= 32 else "gemm") for s in found), found


class _QKV(torch.nn.Module):
    """q, k and v of the same rows, no norm, each with its own epilogue."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(K, N, bias=False), torch.nn.Linear(K, N // 4), \
            torch.nn.Linear(K, N // 4, bias=False)

    def forward(self, x, residual):
        return self.q(x), torch.relu(self.k(x)), self.v(x) + residual


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("m", [1, 4, 16, 32])
def test_shared_launch_under_cuda_graphs(m, merge, op_calls):
    """q, k and v in one Helion launch (or, with the option off, one each), against float64 on fresh
    inputs, replayed under CUDA graphs."""
    torch.manual_seed(0)
    model = _QKV().cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model).double()
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor", options={"merge_siblings": merge})
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            residual = torch.randn(m, N // 4, device="cuda", dtype=torch.bfloat16)
            for out, ref in zip(compiled(x, residual), reference(x.double(), residual.double())):
                assert rel_err(out, ref) <= 1e-2, (m, call)
    found = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert len(found) == 3 and all(s.runs_on == "helion" for s in found), found
    assert all(s.kernel == ("gemm_multi" if merge else "gemm") for s in found), found
    # Each op call (warm-up and recording; replays skip Python) runs all three sites, or one when unmerged.
    assert op_calls.launches > 0 and op_calls.count == (3 if merge else 1) * op_calls.launches


def test_rmsnorm_prologue_with_dynamic_m_crosses_the_threshold():
    """One dynamic-M compile: the fused variant at small M, unfused norm + cuBLAS above the limit."""
    torch.manual_seed(0)
    model = _NormedQKV("hf").cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model).double()
    compiled = torch.compile(model, backend="helion_inductor")
    with torch.no_grad():
        for m in (8, 33, 4, 64, 32, 2):
            x = torch.randn(1, m, K, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 1)
            for _ in range(3):
                outs = compiled(x)
            for out, ref in zip(outs, reference(x.double())):
                assert rel_err(out, ref) <= 1e-2, m
    dynamic = [s for rep in helion_backend.get_reports() for s in rep.sites if s.m == "dynamic"]
    assert len(dynamic) == 3 and all(s.prologue == ["rmsnorm"] and s.runs_on == "helion" for s in dynamic), dynamic
    assert all(s.kernel == "gemm_multi" for s in dynamic), dynamic


class _NormedGatedMLP(torch.nn.Module):
    """A Qwen3/Llama MLP with the decoder layer's post-attention norm before it."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.norm = _rmsnorm(spelling)
        self.gate, self.up = torch.nn.Linear(K, N, bias=False), torch.nn.Linear(K, N, bias=False)
        self.down = torch.nn.Linear(N, K, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("spelling", ["hf", "nn_rmsnorm"])
@pytest.mark.parametrize("m", [1, 8, 32, 33])
def test_gated_mlp_with_rmsnorm_prologue_under_cuda_graphs(m, spelling):
    """The gated-MLP rule: norm (M <= rmsnorm_prologue_max_m), gate and up in one Helion kernel (M <= 32),
    or left to Inductor (M = 33), against float64, replayed under CUDA graphs on fresh inputs."""
    torch.manual_seed(0)
    model = _NormedGatedMLP(spelling).cuda().to(torch.bfloat16).eval()
    reference = copy.deepcopy(model).double()
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor", options=NORMS_UP_TO_8)
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(1, m, K, device="cuda", dtype=torch.bfloat16) * 2
            assert rel_err(compiled(x), reference(x.double())) <= 1e-2, (m, call)
    gate, down = [s for rep in helion_backend.get_reports() for s in rep.sites]
    assert (gate.rule, gate.kernel, gate.epilogue) == ("gated_mlp", "gemm_glu", ["silu", "up_mul"]), gate
    assert gate.prologue == (["rmsnorm"] if m <= 8 else []), gate
    assert all(s.runs_on == ("helion" if m <= 32 else "inductor") for s in (gate, down)), (gate, down)


def test_the_rotary_product_of_a_hugging_face_decoder_stays_with_inductor():
    """Hugging Face's ``inv_freq @ position_ids`` (expanded views; an ``mm`` with K = 1 in the CUDA post-grad
    graph) ran on Helion and came out 256 times too large; it is Inductor's now, and exact."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda").float() / 64))
    position_ids = torch.arange(7, device="cuda")[None, :]

    def angles(inv_freq, position_ids):
        freqs = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1) @ position_ids[:, None, :].float()
        emb = torch.cat((freqs.transpose(1, 2), freqs.transpose(1, 2)), dim=-1)
        return emb.cos(), emb.sin()

    helion_backend.clear_reports()
    cos, sin = torch.compile(angles, backend="helion_inductor")(inv_freq, position_ids)
    freqs = (inv_freq.double()[:, None] @ position_ids.double()).t()
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    assert (cos.double() - emb.cos()).abs().max() < 1e-5 and (sin.double() - emb.sin()).abs().max() < 1e-5
    found = [s for r in helion_backend.get_reports() for s in r.sites]
    assert all(s.runs_on == "inductor" for s in found), [r.summary() for r in helion_backend.get_reports()]
