"""The option ``verify`` on the CPU: a site whose fast path is made wrong is caught on its first run.

On the CPU the fused ops run their reference, so these tests make Helion "available" for every tensor
(``dispatch._helion_runs_on``) and replace the kernel entries the dispatcher calls by fakes built on the
reference: a wrong one (its result times 1.01 for chosen sites) and a correct one that rounds differently
(computed in float64). The CUDA-graph path is in ``test_gpu_verify.py``.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import CPU_REWRITE, TOLERANCE, rel_err

import helion_backend
from helion_backend.options import VERIFY_ENV, BackendOptions
from helion_backend.report import site_id
from helion_backend.runtime import dispatch, verify
from helion_backend.tools import bisect_sites

ROOT = Path(__file__).resolve().parents[1]
WRONG_BY = 1.01  # a wrong kernel: 1% off everywhere (the reference's rel. error would be 1e-2)
VERIFY = {**CPU_REWRITE, "verify": True}


class TwoLayers(nn.Module):
    """Two linear + activation sites, told apart by their widths (K=64 -> N=48, K=48 -> N=32)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 48)
        self.down = nn.Linear(48, 32)

    def forward(self, x):
        return F.relu(self.down(F.relu(self.up(x))))


class FakeKernels:
    """Stands in for the Helion kernels: each call counted by its output width N; wrong (times
    :data:`WRONG_BY`) for the widths in ``wrong``, else computed in float64 and rounded."""

    def __init__(self, monkeypatch, wrong: set[int] = frozenset()) -> None:
        self.wrong = set(wrong)
        self.calls: Counter[int] = Counter()
        monkeypatch.setattr(dispatch, "_helion_runs_on", lambda x: True)
        monkeypatch.setattr(dispatch, "_helion_gemm", self.gemm)
        monkeypatch.setattr(dispatch, "_helion_multi_gemm", self.multi_gemm)

    def gemm(self, kernel, x, w_kn, steps, operands, scalars, out_dtype, config_dir=None, program=None, up_kn=None,
             *, weight_scale=None, norm=None, up_steps=(), frozen_weights=False):
        out = dispatch.unfused(x.double(), w_kn.double(), steps, [op.double() for op in operands], scalars,
                               torch.float64, program, up_kn, weight_scale, norm, up_steps)
        return self._result(out, out_dtype)

    def multi_gemm(self, x, w_kns, steps, operands, scalars, out_dtype, config_dir=None, norm=None,
                   kernel_family=None):
        outs = dispatch.unfused_multi(x.double(), [w.double() for w in w_kns], steps,
                                      [op.double() for op in operands], scalars, torch.float64, norm)
        return [self._result(out, out_dtype) for out in outs]

    def _result(self, out: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        n = out.shape[1]
        self.calls[n] += 1
        return (out * WRONG_BY if n in self.wrong else out).to(out_dtype)


@pytest.fixture(autouse=True)
def fresh_verify_state(monkeypatch):
    torch.manual_seed(0)  # the models' weights and inputs: the same every run
    monkeypatch.setattr(dispatch, "_FAILED", {})
    verify.reset()
    yield
    verify.reset()


def _float64(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).double()


def site_by_width(n: int):
    (site,) = [s for r in helion_backend.get_reports() for s in r.sites if s.n == n]
    return site


def run(model: nn.Module, options: dict, calls: int = 3, m: int = 4) -> list[float]:
    """Compile ``model`` with ``options``, run it on ``calls`` fresh inputs of ``m`` rows, and return each
    output's relative error against the float64 model."""
    compiled = torch.compile(model, backend="helion_inductor", options=options)
    errors = []
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(m, 64)
            errors.append(rel_err(compiled(x), _float64(model)(x.double())))
    return errors


def test_a_wrong_site_is_caught_warned_once_reported_and_runs_its_reference(monkeypatch, caplog):
    kernels = FakeKernels(monkeypatch, wrong={32})
    with caplog.at_level(logging.WARNING, logger="helion_backend"):
        errors = run(TwoLayers(), VERIFY)
    # From the first call on, the output is the unfused model's: the check returned the reference's result.
    assert max(errors) <= TOLERANCE[torch.float32], errors
    # The wrong kernel ran once (the checked run), then the site ran its reference; the correct one every call.
    assert kernels.calls == {32: 1, 48: 3}
    wrong, right = site_by_width(32), site_by_width(48)
    assert len(wrong.verified) == 1 and wrong.verified[0].startswith("M=4: diverged (rel. error 1.00e-02 > "
                                                                        "tolerance 1.0e-05)"), wrong.verified
    assert len(wrong.fallbacks) == 1 and "diverged from the reference" in wrong.fallbacks[0], wrong.fallbacks
    assert right.verified[0].startswith("M=4: ok (rel. error") and right.fallbacks == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert all(text in warnings[0] for text in (
        site_id(helion_backend.get_reports()[0].graph, wrong.anchor), "gemm kernel (M=4 K=48 N=32 float32)",
        "rel. error 1.00e-02 > tolerance 1.0e-05", "option verify", "every M")), warnings[0]
    assert "verified: M=4: diverged" in helion_backend.get_reports()[0].summary()


def test_a_correct_site_reports_ok_and_keeps_its_kernel(monkeypatch, caplog):
    kernels = FakeKernels(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="helion_backend"):
        errors = run(TwoLayers(), VERIFY)
    assert max(errors) <= TOLERANCE[torch.float32]
    assert kernels.calls == {32: 3, 48: 3}
    for n in (32, 48):
        site = site_by_width(n)
        assert site.fallbacks == [] and len(site.verified) == 1 and site.verified[0].startswith("M=4: ok")
    assert [check.m for check in verify.checks()] == [4, 4]  # once per site, not per call
    assert all(0 < check.error <= check.tolerance for check in verify.checks())  # it rounded differently
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_off_by_default_the_fast_path_is_returned_unchecked(monkeypatch):
    """Off, nothing checks: the wrong fast path's output goes through as is, and no reference runs."""
    assert BackendOptions().verify is False
    kernels = FakeKernels(monkeypatch, wrong={32})
    references = Counter()
    unfused = dispatch.unfused
    monkeypatch.setattr(dispatch, "unfused", lambda *a, **k: references.update(["call"]) or unfused(*a, **k))
    errors = run(TwoLayers(), CPU_REWRITE)
    assert all(abs(e - (WRONG_BY - 1)) < 1e-3 for e in errors), errors
    assert kernels.calls == {32: 3, 48: 3}
    # The fakes call dispatch.unfused themselves, once a call each: the op itself ran no reference.
    assert references["call"] == 6
    assert verify.checks() == [] and all(s.verified == [] for r in helion_backend.get_reports() for s in r.sites)


@pytest.mark.slow  # a dynamic M compiles two variants of the graph
def test_a_site_diverging_at_one_m_runs_its_reference_at_every_m(monkeypatch):
    kernels = FakeKernels(monkeypatch, wrong={32})
    model = TwoLayers()
    compiled = torch.compile(model, backend="helion_inductor", options=VERIFY)
    with torch.no_grad():
        for m in (4, 8):
            x = torch.randn(m, 64)
            torch._dynamo.mark_dynamic(x, 0)
            assert rel_err(compiled(x), _float64(model)(x.double())) <= TOLERANCE[torch.float32], m
    assert kernels.calls[32] == 1  # the first, checked run only
    assert kernels.calls[48] == 2  # the correct site is checked at each new M and keeps its kernel
    assert [(c.m, c.ok) for c in verify.checks() if c.site.endswith(site_by_width(48).anchor)] == \
        [(4, True), (8, True)]


def test_a_shared_launch_diverging_in_one_output_is_caught(monkeypatch):
    """q, k and v in one launch: one wrong output makes the launch run its reference."""
    class Qkv(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(64, 32), nn.Linear(64, 16, bias=False), nn.Linear(64, 16, bias=False)

        def forward(self, x):
            return torch.cat([self.q(x), self.k(x) * 2, self.v(x)], dim=-1)

    kernels = FakeKernels(monkeypatch, wrong={32})
    model = Qkv()
    errors = run(model, VERIFY)
    assert max(errors) <= TOLERANCE[torch.float32], errors
    reports = helion_backend.get_reports()
    assert {s.kernel for r in reports for s in r.sites} == {"gemm_multi"}, reports[0].summary()
    assert kernels.calls == {32: 1, 16: 2}
    (check,) = verify.checks()
    assert not check.ok and math.isclose(check.error, WRONG_BY - 1, rel_tol=1e-3)


def test_a_graph_served_from_the_fx_graph_cache_is_checked(monkeypatch, tmp_path):
    options = {**VERIFY, "cache_dir": str(tmp_path)}
    run(TwoLayers(), {**CPU_REWRITE, "cache_dir": str(tmp_path)}, calls=1)  # fills the caches, checks nothing
    assert verify.checks() == []
    torch._dynamo.reset()
    helion_backend.clear_reports()
    kernels = FakeKernels(monkeypatch, wrong={32})
    run(TwoLayers(), options)
    (report,) = helion_backend.get_reports()
    assert report.from_cache, report.summary()
    assert kernels.calls == {32: 1, 48: 3}
    assert [s.verified[0].split(" (")[0] for s in sorted(report.sites, key=lambda s: s.n)] == \
        ["M=4: diverged", "M=4: ok"]


def test_the_environment_variable_turns_it_on_and_the_option_wins(monkeypatch):
    monkeypatch.setenv(VERIFY_ENV, "1")
    assert BackendOptions().verify is True
    assert BackendOptions.from_user({"verify": False}).verify is False
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert BackendOptions().verify is False
    with pytest.raises(TypeError, match="option 'verify' must be bool, got 'yes'"):
        BackendOptions.from_user({"verify": "yes"})
    # It changes no rewrite: a graph compiled either way is one cache entry.
    assert BackendOptions(verify=True).fingerprint() == BackendOptions(verify=False).fingerprint()


def test_tolerances_follow_the_least_precise_dtype_and_tf32():
    assert verify.tolerance([torch.float32]) == verify.TOLERANCE[torch.float32]
    assert verify.tolerance([torch.bfloat16, torch.float32]) == verify.TOLERANCE[torch.bfloat16]
    assert verify.tolerance([torch.float8_e4m3fn, torch.bfloat16]) == verify.QUANTIZED_TOLERANCE
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed
        assert verify.tolerance([torch.float32]) == verify.TF32_TOLERANCE
    finally:
        torch.set_float32_matmul_precision(before)


def test_relative_error_counts_mismatched_non_finite_values_as_divergence():
    ref = torch.randn(8, 16)
    assert verify.relative_error(ref.clone(), ref) == 0.0
    assert math.isclose(verify.relative_error(ref * 1.5, ref), 0.5, rel_tol=1e-6)
    special = ref.clone()
    special[0, 0], special[1, 1] = math.nan, -math.inf
    assert verify.relative_error(special.clone(), special) == 0.0  # the same NaN and infinity: agreed
    assert verify.relative_error(ref, special) == math.inf  # the kernel lost a NaN
    flipped = special.clone()
    flipped[1, 1] = math.inf
    assert verify.relative_error(flipped, special) == math.inf
    overflowed = ref.clone()
    overflowed[2, 2] = math.inf
    assert verify.relative_error(overflowed, ref) == math.inf


# The bisect command, run as users run it: a subprocess on a plain script. A ``sitecustomize`` on its
# PYTHONPATH (a test hook outside the package) makes Helion "available" on the CPU and the N=32 site's
# kernel wrong, as FakeKernels does here.
WRONG_KERNEL_SITECUSTOMIZE = '''
from helion_backend.runtime import dispatch

def wrong_kernel(kernel, x, w_kn, steps, operands, scalars, out_dtype, config_dir=None, program=None,
                 up_kn=None, *, weight_scale=None, norm=None, up_steps=(), **kernel_options):
    out = dispatch.unfused(x, w_kn, steps, operands, scalars, out_dtype, program, up_kn, weight_scale, norm,
                           up_steps)
    return out * 1.01 if out.shape[1] == 32 else out

dispatch._helion_runs_on = lambda x: True
dispatch._helion_gemm = wrong_kernel
'''

USER_SCRIPT = '''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 48), nn.Linear(48, 32)

    def forward(self, x):
        return F.relu(self.down(F.relu(self.up(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


if __name__ == "__main__":
    model = Model()
    compiled = torch.compile(model, backend="helion_inductor", options={"rewrite_on_cpu": True})
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 64)
            torch.testing.assert_close(compiled(x), model(x))  # the diverging site ran its reference
    print("script ran with", sys.argv[1:])
'''


@pytest.mark.slow
def test_bisect_names_the_first_diverging_site_of_a_script(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(WRONG_KERNEL_SITECUSTOMIZE)
    script = tmp_path / "run_model.py"
    script.write_text(USER_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hooks), str(ROOT)]),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(VERIFY_ENV, None)  # bisect turns it on
    result = subprocess.run([sys.executable, "-m", "helion_backend", "bisect", str(script), "--steps", "2"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]  # a site diverged
    out = result.stdout
    assert "script ran with ['--steps', '2']" in out, out
    assert "the first fused site whose output diverges from its reference is graph_000:addmm_1" in out, out
    assert "anchor addmm_1 (aten.addmm.default), module block.down" in out, out
    assert "rule gemm_activation, kernel gemm: addmm -> bias -> relu" in out, out
    assert "m=4 k=48 n=32 float32; at M=4: rel. error 1.00e-02 > tolerance 1.0e-05" in out, out
    assert "other site(s) diverged" not in out and "(2 check(s) of 2 site(s) in all)" in out, out


def test_bisect_says_when_no_site_diverged_or_none_was_checked():
    ok = verify.Check(site="graph_000:addmm", m=4, error=1e-7, tolerance=1e-5)
    assert bisect_sites.summary([ok]) == ("helion_inductor bisect: no fused site diverged from its reference "
                                          "(1 check(s) of 1 site(s))")
    assert "no fused site ran a Helion kernel, so none was checked" in bisect_sites.summary([])
