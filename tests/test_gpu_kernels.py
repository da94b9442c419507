"""The Helion GEMM + epilogue kernels on a CUDA GPU, against a float64 reference.

Outputs come from ``torch.empty``, so each call first fills the allocator's free blocks of the output's
size with NaN: an element the kernel fails to write shows up as NaN.
"""

from __future__ import annotations

import helion
import pytest
import torch

from helion_backend.kernels import configs, gemm
from helion_backend.kernels.gemm import gemm_epilogue_helion, glu_gemm_helion
from helion_backend.runtime.dispatch import flatten_operands
from helion_backend.semantics.epilogue import apply_epilogue, operand_kinds
from helion_backend.semantics.norm import RmsNormSpec, rms_norm
from helion_backend.tuning.candidates import GEMV_CANDIDATES, candidate_configs, gemv_rows
from helion_backend.vocabulary import EPILOGUE_STEPS, Operand

pytestmark = pytest.mark.gpu

K, N = 1000, 400  # multiples of no block size
EPILOGUE = ("bias", "gelu_tanh", "scale", "residual")
EVERY_STEP = (
    "bias",
    "gelu",
    "scale",
    "residual",
    "mul",
    "silu",
    "sigmoid",
    "relu",
    "gelu_tanh",
    "scale",
    "cast",
)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def float64_reference(x, w_kn, steps, operands, scalars) -> torch.Tensor:
    acc = x.double() @ w_kn.double()
    return apply_epilogue(acc, steps, [op.double() for op in operands].__getitem__, scalars)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def poison_allocator(m: int, n: int) -> None:
    """Leave NaN-filled free blocks of every output and split-K workspace size in the caching allocator."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    for splits in range(2, 9):
        torch.full((splits, m, n), float("nan"), dtype=torch.float32, device="cuda")


def inputs(m, k, n, dtype, layout, steps):
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    w_kn = (
        torch.randn(k, n, dtype=dtype, device="cuda")
        if layout == "kn"
        else torch.randn(n, k, dtype=dtype, device="cuda").t()
    )
    shapes = {Operand.ROW: (n,), Operand.COL: (m, 1), Operand.ELEMENT: (1,), Operand.FULL: (m, n)}
    operands = [torch.randn(shapes[kind], dtype=dtype, device="cuda") for kind in operand_kinds(steps)]
    scalars = [0.5 + i for i, s in enumerate(steps) if s == "scale"]
    return x, w_kn, operands, scalars


def with_split_k(config: helion.Config, split_k: int) -> helion.Config:
    return helion.Config(**{**config, "split_k": split_k})


def check(m, k, n, dtype, layout, steps, split_k=None, out_dtype=None, config=None, norm=None) -> None:
    """One call against the float64 reference (of the RMS-normalized rows with ``norm``); ``config`` None is the
    default config, ``split_k`` None keeps its split."""
    x, w_kn, operands, scalars = inputs(m, k, n, dtype, layout, steps)
    config = config or configs.default_config(m, k, n, dtype)
    if split_k is not None:
        config = with_split_k(config, split_k)
    poison_allocator(m, n)
    flat = flatten_operands(operands, steps, n)  # broadcast views, as the fused op passes them
    out = gemm_epilogue_helion(x, w_kn, steps, flat, scalars, out_dtype or dtype, config, norm=norm)
    assert out.shape == (m, n) and out.dtype == (out_dtype or dtype) and out.is_contiguous()
    assert not out.isnan().any()
    rows = x if norm is None else rms_norm(x, *norm)
    assert rel_err(out, float64_reference(rows, w_kn, steps, operands, scalars)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 24, 32, 33, 64, 512])
def test_transposed_weight(m, dtype, split_k):
    check(m, K, N, dtype, "nk", EPILOGUE, split_k)


@pytest.mark.parametrize("split_k", [1, 4])
@pytest.mark.parametrize("m", [1, 33, 512])
def test_plain_weight(m, split_k):
    check(m, K, N, torch.bfloat16, "kn", EPILOGUE, split_k)


GEMV_CONFIGS = candidate_configs(1, N, GEMV_CANDIDATES, **{configs.GEMV: True})


def config_id(config: helion.Config) -> str:
    return "x".join(map(str, config["block_sizes"])) + f"-split{config['split_k']}"


@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=config_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_form(m, dtype, config):
    """The sweep's GEMV tiles (``gemv``: no dot, N tiles down to one column), at one row and, as a table entry
    of one row would serve a lookup from more where no other entry exists, at five."""
    check(m, K, N, dtype, "nk", EPILOGUE, config=config)


@pytest.mark.parametrize("m", [3, 8])
@pytest.mark.parametrize("config", range(len(GEMV_CANDIDATES)))
def test_gemv_form_at_more_rows(m, config):
    """The sweep's GEMV tiles as it offers them at more rows (``gemv_rows``: an M block of M's next power of two,
    K blocks as many times shallower)."""
    (block,) = candidate_configs(m, N, gemv_rows(m, GEMV_CANDIDATES[config:config + 1]), **{configs.GEMV: True})
    check(m, K, N, torch.bfloat16, "nk", EPILOGUE, config=block)


def test_gemv_form_on_a_kn_weight():
    """The GEMV kernel reads the weight as [N, K]: a [K, N] one (GPT-2's Conv1D) is a strided view, read in place."""
    config = helion.Config(block_sizes=[16, 4, 512], num_warps=4, num_stages=1, **{configs.GEMV: True})
    check(1, K, N, torch.bfloat16, "kn", EPILOGUE, config=config)


@pytest.mark.parametrize("gemv", [False, True], ids=["dot", "gemv"])
def test_gemm_with_rmsnorm_at_one_row(gemv):
    """The RMSNorm prologue of the single GEMM at one row (its sums of squares from the K loop), dot or GEMV;
    against the graph's norm in float64 (the kernel rounds x * weight instead, within bf16's tolerance)."""
    norm = ((torch.randn(K, device="cuda") * 0.1 + 1).to(torch.bfloat16), RmsNormSpec(1e-6, True))
    config = helion.Config(**{**configs.default_config(1, K, N, torch.bfloat16), configs.GEMV: gemv})
    if gemv:
        config = helion.Config(**{**config, "block_sizes": [16, 4, 1024], "split_k": 1})
    check(1, K, N, torch.bfloat16, "nk", EPILOGUE, config=config, norm=norm)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("steps", [(), EVERY_STEP, *((s,) for s, k in EPILOGUE_STEPS.items() if not k.only_in)],
                         ids=str)
def test_each_step(steps, split_k):
    check(16, K, N, torch.bfloat16, "nk", steps, split_k)


@pytest.mark.parametrize("m, k, split_k", [(16, 5120, 4), (3, 1000, 8), (32, 1280, 4), (8, 8192, 16)])
def test_split_k_workspace_has_one_slice_per_split(m, k, split_k):
    """Every workspace slice the finishing pass sums must have been written (K = 1280, split_k = 4 runs three)."""
    check(m, k, N, torch.bfloat16, "nk", EPILOGUE, split_k)


def test_one_shape_under_two_split_factors():
    """The finishing pass shares its config across split factors: each must still sum every slice."""
    for split_k in (2, 4, 2):
        check(16, K, N, torch.bfloat16, "nk", EPILOGUE, split_k)


@pytest.mark.parametrize("split_k", [1, 4])
def test_fp32_dots_are_exact(split_k):
    """fp32 inputs must not silently run as TF32 (eager torch.mm does not by default)."""
    check(8, K, N, torch.float32, "nk", ("bias", "relu"), split_k)


def test_fp32_output_from_bf16_inputs():
    check(4, K, N, torch.bfloat16, "nk", ("bias", "cast"), 1, out_dtype=torch.float32)


@pytest.mark.parametrize(
    "m, k, n", [(1, 4096, 12288), (16, 4096, 12288), (16, 12288, 4096), (32, 4096, 4096)]
)
def test_default_configs_on_decode_shapes(m, k, n):
    check(m, k, n, torch.bfloat16, "nk", EPILOGUE)


@pytest.mark.parametrize("split_k", [1, 4])
def test_second_call_reuses_the_compiled_kernels(split_k):
    check(16, K, N, torch.bfloat16, "nk", EPILOGUE, split_k)
    compiled = len(gemm._COMPILED)
    check(16, K, N, torch.bfloat16, "nk", EPILOGUE, split_k)
    assert len(gemm._COMPILED) == compiled


@pytest.mark.parametrize("split_k", [1, 4])
def test_cuda_graph_replay(split_k):
    """Captured once, replayed on new values: how the backend runs under ``mode="reduce-overhead"``."""
    x, w_kn, operands, scalars = inputs(16, K, N, torch.bfloat16, "nk", EPILOGUE)
    config = with_split_k(configs.default_config(16, K, N, torch.bfloat16), split_k)
    gemm_epilogue_helion(x, w_kn, EPILOGUE, operands, scalars, torch.bfloat16, config)  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_epilogue_helion(x, w_kn, EPILOGUE, operands, scalars, torch.bfloat16, config)
    for t in (x, *operands):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, float64_reference(x, w_kn, EPILOGUE, operands, scalars)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("round_before_weight", [True, False])
@pytest.mark.parametrize("m", [1, 8, 32, 33])
def test_gated_kernel_with_rmsnorm(m, round_before_weight):
    """Gate and up on RMS-normalized bfloat16 rows, default config, stored in fp32 so that the norm's
    roundings show. The kernel's norm rounds x * weight where the graph rounds the normalized rows
    (and, for Hugging Face's spelling, their product with the weight again): against the exact norm in
    float64 it is at least as close as the unfused graph's activation is (within sampling noise: the
    errors of one row's outputs share that row's roundings, so small M launches repeat on fresh rows
    until at least 32 rows are compared)."""
    w_gate, w_up = (torch.randn(N, K, dtype=torch.bfloat16, device="cuda").t() / K**0.5 for _ in range(2))
    norm_weight = (torch.randn(K, device="cuda") * 0.1 + 1).to(torch.bfloat16)
    norm = (norm_weight, RmsNormSpec(1e-6, round_before_weight))
    steps = ("silu", "up_mul", "cast")

    def gated(rows: torch.Tensor) -> torch.Tensor:
        return apply_epilogue(rows @ w_gate.double(), steps, [].__getitem__, [], rows @ w_up.double())

    outs, exacts, unfused = [], [], []
    for _ in range(-(-32 // m)):
        x = torch.randn(m, K, dtype=torch.bfloat16, device="cuda") * 2
        poison_allocator(m, N)
        outs.append(glu_gemm_helion(x, w_gate, w_up, steps, [], [], torch.float32, norm=norm))
        exact_rows = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.double()
        exacts.append(gated(exact_rows))
        unfused.append(gated(rms_norm(x, *norm).double()))
    out, exact = torch.cat(outs), torch.cat(exacts)
    unfused_error = rel_err(torch.cat(unfused), exact)
    assert not out.isnan().any()
    assert rel_err(out, exact) <= max(1.25 * unfused_error, 1e-4), unfused_error


@pytest.mark.parametrize("m, k, n", [(1, 64, 7), (14, 64, 1), (1, 256, 1), (5, 3, 6), (3, 2, 1), (33, 17, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_and_size_one_dimensions_under_the_default_config(m, k, n, dtype):
    check(m, k, n, dtype, "nk", ("bias", "scale"))


def test_a_k_of_one_is_refused():
    """What the rotary embedding's product of frequencies by positions came to on the GPU: 256 times the
    product (a K block of copies of the one column) before the kernels refused a K of one."""
    with pytest.raises(ValueError, match="K=1"):
        check(32, 1, 7, torch.float32, "kn", ())
