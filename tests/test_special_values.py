"""NaN and ±Inf in the activation, weight, bias or residual of a fused site come out where eager puts them.

Each case plants NaN, +Inf and -Inf at known places of one operand (two infinities of opposite sign in
one row of the activation, so that the GEMM itself makes a NaN), compiles a site that fuses the whole
epilogue, and compares the output position by position: NaN where eager has NaN, +Inf and -Inf where it
has them, finite values as close to float64 as eager is.

The oracle is eager run in float64. Eager in fp32 or bf16 on the CPU is not one: there (torch 2.13, x86)
its vectorized GELU kernel returns NaN for +Inf while its scalar kernel, its float64 kernel and every
decomposition return +Inf, so the answer would depend on the tensor's size.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, DEVICE_OPTIONS, TOLERANCE, compile_run, rel_err, sites

M, K, N = 8, 16, 24
NAN, INF = float("nan"), float("inf")

# epilogue name -> (program over x, w, b, r; the steps its site must fuse; operands it reads)
EPILOGUES = {
    "bias": (lambda x, w, b, r: F.linear(x, w, b), ["bias"], ("x", "w", "b")),
    "bias_gelu": (lambda x, w, b, r: F.gelu(F.linear(x, w, b)), ["bias", "gelu"], ("x", "w", "b")),
    "residual": (lambda x, w, b, r: F.linear(x, w) + r, ["residual"], ("x", "w", "r")),
    "silu": (lambda x, w, b, r: F.silu(F.linear(x, w)), ["silu"], ("x", "w")),
}
CASES = [(name, where) for name, (_, _, operands) in EPILOGUES.items() for where in operands]


def plant(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` with NaN, +Inf and -Inf at fixed places; other entries keep their random values."""
    t = t.clone()
    if where == "x":  # rows 0-2: one special each; row 3: +Inf and -Inf, whose products cancel to NaN
        t[0, 1], t[1, 2], t[2, 3], t[3, 4], t[3, 5] = NAN, INF, -INF, INF, -INF
    elif where == "w":  # [N, K]: output columns 1-3 see one special each
        t[1, 0], t[2, 3], t[3, 4] = NAN, INF, -INF
    elif where == "b":
        t[1], t[2], t[3] = NAN, INF, -INF
    else:  # the residual, [M, N]
        t[0, 1], t[1, 2], t[2, 3] = NAN, INF, -INF
    return t


def special_masks(t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"nan": t.isnan(), "+inf": t == INF, "-inf": t == -INF}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name, where", CASES, ids=[f"{n}-{w}" for n, w in CASES])
def test_special_values_propagate_as_in_eager(name, where, dtype, op_calls):
    fn, steps, _ = EPILOGUES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(f"{name}-{where}-{dtype}".encode()))
    inputs = {
        "x": torch.randn(M, K, generator=gen, device=DEVICE),
        "w": torch.randn(N, K, generator=gen, device=DEVICE) / math.sqrt(K),
        "b": torch.randn(N, generator=gen, device=DEVICE),
        "r": torch.randn(M, N, generator=gen, device=DEVICE),
    }
    inputs[where] = plant(inputs[where], where)
    args = [inputs[k].to(dtype) for k in "xwbr"]

    out, reports = compile_run(fn, *args, options=DEVICE_OPTIONS)
    (site,) = sites(reports)
    assert site.epilogue == steps, reports[0].summary()
    if DEVICE.type == "cpu":
        assert site.runs_on == "reference" and op_calls.count == 1
    eager = fn(*args)
    reference = fn(*(a.double() for a in args))
    assert out.dtype == eager.dtype and out.shape == eager.shape

    expected = special_masks(reference)
    assert expected["nan"].any() and (expected["+inf"] | expected["-inf"]).any()  # the plants took effect
    for kind, mask in special_masks(out).items():
        where_out, where_ref = mask.nonzero().tolist(), expected[kind].nonzero().tolist()
        assert where_out == where_ref, f"{kind} at {where_out}, float64 eager at {where_ref}"
    finite = reference.isfinite()
    assert finite.sum() >= 2 * N  # whole rows untouched by the plants
    both = finite & eager.isfinite()  # eager's own error, where it has a value
    eager_err = rel_err(eager[both], reference[both])
    assert rel_err(out[finite], reference[finite]) <= max(TOLERANCE[dtype], 3 * eager_err)
