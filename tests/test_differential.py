"""Seeded random programs around a GEMM: compiled with the rewrite on the CPU, compared with float64.

A small differential check of the whole pipeline (matcher, legality, rewrite, reference op): chains of
steps inside and outside the vocabulary, both weight layouts, 2-D and 3-D activations, shared
intermediates, dtype promotion. Each program must match float64 as closely as eager does.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import TORCH_ACTIVATIONS, compile_run, sites

UNARY = {
    **TORCH_ACTIVATIONS,
    "tanh": torch.tanh,  # not in the vocabulary: must stop the site, not be mis-fused
    "div": lambda v: v / 3.0,
    "clamp": lambda v: v.clamp(-1.0, 1.0),
    "square": lambda v: v * v,
}
STEPS = ("unary", "bias", "residual", "mul", "scale", "shared", "cast")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def random_program(seed: int):
    rng = random.Random(seed)
    dtype = rng.choice(list(TOLERANCE))
    m, k, n = rng.choice([1, 3, 8]), rng.choice([16, 24]), rng.choice([8, 32])
    lead = rng.choice([(), (2,)])
    layout = rng.choice(["linear", "kn", "kn_strided"])
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    w = randn(n, k) if layout == "linear" else randn(k, n) if layout == "kn" else randn(n, k).t()
    args = (randn(*lead, m, k), w, randn(n, dt=rng.choice([dtype, torch.float32])), randn(*lead, m, n))
    plan = [(rng.choice(STEPS), rng.choice(sorted(UNARY))) for _ in range(rng.randint(0, 4))]

    def program(x, w, b, r):
        h = F.linear(x, w) if layout == "linear" else x @ w
        extra = []
        for step, unary in plan:
            if step == "unary":
                h = UNARY[unary](h)
            elif step == "bias":
                h = h + b
            elif step == "residual":
                h = h + r
            elif step == "mul":
                h = h * r
            elif step == "scale":
                h = h * 0.75
            elif step == "shared":
                extra.append(h * 2.0)  # a second user of the running value
            else:
                h = h.float()
        return (h, *extra)

    return program, args, dtype


def rel_err(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("seed", range(40))
def test_random_program_matches_float64_like_eager(seed, op_calls):
    program, args, dtype = random_program(seed)
    out, reports = compile_run(program, *args)
    reference = program(*(a.double() for a in args))
    eager = program(*args)
    assert len(out) == len(reference)
    for got, ref, eag in zip(out, reference, eager):
        assert got.dtype == eag.dtype and got.shape == eag.shape
        assert rel_err(got, ref) <= max(TOLERANCE[dtype], 3 * rel_err(eag, ref)), (seed, reports[0].summary())
    # Every GEMM in these programs is a site, and every site runs the fused op.
    assert len(sites(reports)) == 1 and op_calls.count == 1
