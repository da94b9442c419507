"""Quantized linears on a CUDA GPU: the fused Helion kernels against the unfused quantized graph.

Each model is built with :mod:`helion_backend.layers.quantize` (the forms vLLM and torchao write), compiled with
the backend under CUDA graphs, and compared on fresh random inputs with (a) the same quantized module run
eagerly, unfused, where the fused kernel must reach 40 dB SQNR, and (b) the float module in float64,
which the fused kernel must match at least as well as the unfused graph does (up to 0.5 dB).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import helion
import helion.language as hl
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import sites, sqnr_db

import helion_backend
from helion_backend.layers.quantize import quantize

pytestmark = pytest.mark.gpu

K, N = 1024, 768
FAMILIES = {"fp8_dynamic": "gemm_fp8", "int8_dynamic": "gemm_int8", "int8_weight_only": "gemm_weight_only",
            "int4_weight_only": "gemm_int4", "fp8_block": "gemm_fp8_block"}
# Each format's prologue with fuse_activation_quant; by default Inductor quantizes the per-token formats' rows.
PROLOGUES = {"fp8_dynamic": ["quant_fp8_per_token"], "int8_dynamic": ["quant_int8_per_token"],
             "int8_weight_only": ["dequant_int8"], "int4_weight_only": ["dequant_int4"],
             "fp8_block": ["quant_fp8_per_group", "dequant_fp8_block"]}
PER_TOKEN = ("fp8_dynamic", "int8_dynamic")
FORMATS = [*((fmt, False) for fmt in sorted(FAMILIES)), *((fmt, True) for fmt in PER_TOKEN)]
FORMAT_IDS = [f"{fmt}-{'kernel_quant' if fused else 'default'}" for fmt, fused in FORMATS]


def prologue_of(fmt: str, fused: bool) -> list[str]:
    return PROLOGUES[fmt] if fused or fmt not in PER_TOKEN else []


class Block(nn.Module):
    """A linear with a bias, a GELU and a residual: the epilogue a quantized site must also fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh") + residual


def float_block() -> Block:
    torch.manual_seed(0)
    return Block().to(device="cuda", dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 24, 32, 33, 64])
@pytest.mark.parametrize("fmt, fused", FORMATS, ids=FORMAT_IDS)
def test_fused_quantized_linear_matches_the_unfused_graph(fmt, fused, m):
    """Every format by default (fp8/int8: the kernel reads the rows Inductor quantized), and fp8/int8 with
    ``fuse_activation_quant`` (the kernel quantizes them)."""
    reference = float_block()
    eager = quantize(copy.deepcopy(reference), fmt)
    helion_backend.clear_reports()
    compiled = torch.compile(copy.deepcopy(eager), backend="helion_inductor",
                             options={"fuse_activation_quant": fused})
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, N, device="cuda", dtype=torch.bfloat16)
            out = compiled(x, r)
            unfused = eager(x, r)
            exact = F.gelu(F.linear(x.double(), reference.proj.weight.double(), reference.proj.bias.double()),
                           approximate="tanh") + r.double()
            assert sqnr_db(unfused, out) >= 40
            assert sqnr_db(exact, out) >= sqnr_db(exact, unfused) - 0.5
    (site,) = sites(helion_backend.get_reports())
    assert site.kernel == FAMILIES[fmt]
    assert site.runs_on == ("helion" if m <= 32 else "inductor"), site.why
    assert not site.fallbacks, site.fallbacks  # the numerics above would also pass on the unfused reference
    if m <= 32:
        assert site.prologue == prologue_of(fmt, fused)
        assert ("act_scale" if fused else "token_scale") in site.epilogue or fmt not in PER_TOKEN, site.epilogue
        assert "gelu_tanh" in site.epilogue and site.epilogue[-1] == "residual", site.epilogue


@pytest.mark.parametrize("m", [1, 2, 8, 32])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quant_kernel_64_row_tiles(qdtype, split_k, m):
    """64-row tiles (Hopper's wgmma) on quantized rows, M below the block (one row runs as two)."""
    import helion

    from helion_backend.kernels.configs import PREQUANTIZE
    from helion_backend.kernels.quant_gemm import quant_gemm_helion
    from helion_backend.layers.quantize import Fp8DynamicLinear, Int8DynamicLinear
    from helion_backend.semantics.reference import reference

    torch.manual_seed(m)
    linear = nn.Linear(4096, 512).to(device="cuda", dtype=torch.bfloat16)
    module = (Fp8DynamicLinear if qdtype == torch.float8_e4m3fn else Int8DynamicLinear).from_linear(linear)
    program = _program_of(module)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    scale = module.weight_scale.reshape(-1).float()
    steps, operands = ("act_scale", "channel_scale", "bias"), [scale.expand(512), linear.bias.detach()]
    config = helion.Config(block_sizes=[64, 32, 512], num_warps=4, num_stages=3, split_k=split_k,
                           **{PREQUANTIZE: True})
    out = quant_gemm_helion(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program, config=config,
                            kernel_family="gemm_fp8" if qdtype == torch.float8_e4m3fn else "gemm_int8")
    assert out.shape == (m, 512)
    assert sqnr_db(reference(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program), out) >= 40


@pytest.mark.parametrize("tile", [(16, 1, 2048, 4), (16, 4, 1024, 4), (16, 8, 512, 8)], ids=str)
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quant_gemv_form_at_one_row(qdtype, tile):
    """``gemv`` on one quantized row (quantized first by its own kernel: the GEMV multiplies quantized rows),
    products in fp32, against the unfused quantized graph."""
    import helion

    from helion_backend.kernels.configs import GEMV
    from helion_backend.kernels.quant_gemm import quant_gemm_helion
    from helion_backend.layers.quantize import Fp8DynamicLinear, Int8DynamicLinear
    from helion_backend.semantics.reference import reference

    torch.manual_seed(2)
    n = 1008  # 16 x 63: fp8's _scaled_mm needs a multiple of 16, and no N tile above 16 divides it
    linear = nn.Linear(4096, n).to(device="cuda", dtype=torch.bfloat16)
    module = (Fp8DynamicLinear if qdtype == torch.float8_e4m3fn else Int8DynamicLinear).from_linear(linear)
    program = _program_of(module)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    scale = module.weight_scale.reshape(-1).float()
    steps, operands = ("act_scale", "channel_scale", "bias"), [scale.expand(n), linear.bias.detach()]
    block_m, block_n, block_k, warps = tile
    config = helion.Config(block_sizes=[block_m, block_n, block_k], num_warps=warps, num_stages=1, split_k=1,
                           **{GEMV: True})
    out = quant_gemm_helion(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program, config=config,
                            kernel_family="gemm_fp8" if qdtype == torch.float8_e4m3fn else "gemm_int8")
    assert out.shape == (1, n) and not out.isnan().any()
    assert sqnr_db(reference(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program), out) >= 40


def _swapped_configs():
    from helion_backend.kernels.configs import SWAP_AB
    from helion_backend.tuning.candidates import SWAPPED_CANDIDATES, candidate_configs

    return candidate_configs(32, 1008, SWAPPED_CANDIDATES, **{SWAP_AB: True})


@pytest.mark.parametrize("config", _swapped_configs(), ids=lambda c: "x".join(map(str, c["block_sizes"]))
                         + f"-w{c['num_warps']}-s{c['num_stages']}-k{c['split_k']}")
@pytest.mark.parametrize("m", [5, 32])
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quant_swapped_form(qdtype, m, config):
    """The sweep's ``swap_ab`` tiles (``w @ x.T``, transposed back for the epilogue) on quantized rows, split
    or not, with an N that no 64-wide block divides, against the unfused quantized graph."""
    from helion_backend.kernels.quant_gemm import quant_gemm_helion
    from helion_backend.layers.quantize import Fp8DynamicLinear, Int8DynamicLinear
    from helion_backend.semantics.reference import reference

    torch.manual_seed(3)
    n = 1008
    linear = nn.Linear(4096, n).to(device="cuda", dtype=torch.bfloat16)
    module = (Fp8DynamicLinear if qdtype == torch.float8_e4m3fn else Int8DynamicLinear).from_linear(linear)
    program = _program_of(module)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    scale = module.weight_scale.reshape(-1).float()
    steps, operands = ("act_scale", "channel_scale", "bias"), [scale.expand(n), linear.bias.detach()]
    out = quant_gemm_helion(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program, config=config,
                            kernel_family="gemm_fp8" if qdtype == torch.float8_e4m3fn else "gemm_int8")
    assert out.shape == (m, n) and not out.isnan().any()
    assert sqnr_db(reference(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program), out) >= 40


@pytest.mark.parametrize("m", [1, 8, 32])
def test_weight_only_swapped_form(m):
    """``swap_ab`` on float rows and an int8 weight (converted to the rows' dtype in the K loop)."""
    from helion_backend.kernels.quant_gemm import quant_gemm_helion
    from helion_backend.layers.quantize import Int8WeightOnlyLinear
    from helion_backend.semantics.reference import reference

    torch.manual_seed(4)
    linear = nn.Linear(4096, 1008).to(device="cuda", dtype=torch.bfloat16)
    module = Int8WeightOnlyLinear.from_linear(linear)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    steps = ("channel_scale", "bias")
    operands = [module.weight_scale.reshape(-1).float(), linear.bias.detach()]
    for config in _swapped_configs()[:4]:
        out = quant_gemm_helion(x, module.qweight.t(), steps, operands, [], torch.bfloat16, config=config,
                                kernel_family="gemm_weight_only")
        assert sqnr_db(reference(x, module.qweight.t(), steps, operands, [], torch.bfloat16), out) >= 40, config


@pytest.mark.parametrize("prequantize", [False, True], ids=["fused_scales", "prequantize"])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_quant_kernel_split_k(qdtype, split_k, prequantize):
    """Split-K rescales each split's partial sums by the per-token scale before the finishing pass;
    the activation is quantized inside the GEMM kernel, or once by a kernel of its own."""
    import helion

    from helion_backend.kernels.configs import PREQUANTIZE
    from helion_backend.kernels.quant_gemm import quant_gemm_helion
    from helion_backend.layers.quantize import Fp8DynamicLinear, Int8DynamicLinear
    from helion_backend.semantics.reference import reference

    torch.manual_seed(1)
    linear = nn.Linear(4096, 512).to(device="cuda", dtype=torch.bfloat16)
    module = (Fp8DynamicLinear if qdtype == torch.float8_e4m3fn else Int8DynamicLinear).from_linear(linear)
    program = _program_of(module)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    scale = module.weight_scale.reshape(-1).float()
    steps, operands = ("act_scale", "channel_scale", "bias"), [scale.expand(512), linear.bias.detach()]
    config = helion.Config(block_sizes=[16, 32, 256], num_warps=4, num_stages=3, split_k=split_k,
                           **{PREQUANTIZE: prequantize})
    out = quant_gemm_helion(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program, config=config,
                            kernel_family="gemm_fp8" if qdtype == torch.float8_e4m3fn else "gemm_int8")
    assert sqnr_db(reference(x, module.qweight.t(), steps, operands, [], torch.bfloat16, program), out) >= 40


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("block_k", [32, 64, 128, 256])
@pytest.mark.parametrize("group_size", [128, 32])
@pytest.mark.parametrize("paired_loads, zero_points", [(False, False), (True, False), (True, True)])
def test_int4_kernel_blocks_groups_and_split_k(paired_loads, zero_points, group_size, block_k, split_k):
    """The int4 kernel against the graph's dequantization: K blocks (in bytes) smaller and larger than a
    group, split-K partial sums finished by the epilogue pass, the activation read as two stride-2 views or
    as pairs (``paired_loads``), and the fixed zero point or one per group (``zero_points``)."""
    import helion

    from helion_backend.kernels.quant_gemm import int4_gemm_helion
    from helion_backend.layers.quantize import Int4WeightOnlyLinear
    from helion_backend.semantics.reference import dequantize_int4, reference

    torch.manual_seed(2)
    linear = nn.Linear(4096, 512).to(device="cuda", dtype=torch.bfloat16)
    layer = Int4WeightOnlyLinear.from_linear(linear, group_size=group_size, zero_points=zero_points)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    steps, operands = ("bias", "silu"), [layer.bias]
    config = helion.Config(block_sizes=[16, 32, block_k], num_warps=4, num_stages=3, split_k=split_k,
                           paired_loads=paired_loads)
    out = int4_gemm_helion(x, layer.packed.t(), layer.group_params, steps, operands, [], torch.bfloat16,
                           config=config)
    w_kn = dequantize_int4(layer.packed, layer.group_params, torch.bfloat16).t()
    assert sqnr_db(reference(x, w_kn, steps, operands, [], torch.bfloat16), out) >= 40


@helion.kernel(static_shapes=True, autotune_effort="none")
def _dequantize_int4(pairs: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     nibbles: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each byte's two int4 values, dequantized by ``nibbles`` with the scale and zero point beside it."""
    low, high = torch.empty_like(scales), torch.empty_like(scales)
    for tile_r, tile_c in hl.tile(pairs.size()):
        low[tile_r, tile_c], high[tile_r, tile_c] = nibbles(pairs[tile_r, tile_c], scales[tile_r, tile_c],
                                                            zeros[tile_r, tile_c])
    return low, high


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", [(16, 32), (64, 128), (128, 8)])
def test_int4_bit_dequantization_is_the_graphs_bit_for_bit(dtype, tile, zero_points):
    """The int4 kernels' PTX dequantization (``int4_dequantizer`` on CUDA) gives exactly the graph's values:
    nibble minus 8 (or minus its zero point), times the scale in the activation's dtype, for every byte value
    and fresh random scales over a wide range of magnitudes; the zero points are integers 0..15 and, for the
    subtraction's rounding, random values of any magnitude."""
    from helion_backend.kernels.int4_nibbles import int4_dequantizer

    torch.manual_seed(tile[0] + tile[1])
    pairs = torch.randint(0, 256, (256, 512), device="cuda", dtype=torch.uint8)
    pairs[0, :256] = torch.arange(256, device="cuda", dtype=torch.uint8)
    scales = (torch.randn(256, 512, device="cuda") * torch.exp2(torch.randint(-12, 6, (256, 512), device="cuda")))
    scales = scales.to(dtype)
    zeros = torch.randint(0, 16, (256, 512), device="cuda").to(dtype)
    zeros[128:] = (torch.randn(128, 512, device="cuda") * torch.exp2(torch.randint(-12, 4, (128, 512),
                                                                                   device="cuda"))).to(dtype)
    nibbles = int4_dequantizer(scales, zero_points)
    assert nibbles.__name__.endswith("_ptx")
    config = helion.Config(block_sizes=list(tile), num_warps=4)
    args = (pairs, scales, zeros, nibbles)
    low, high = _dequantize_int4.bind(args).compile_config(config)(*args)
    zero = zeros if zero_points else 8
    assert torch.equal(low, ((pairs & 15).to(dtype) - zero) * scales)
    assert torch.equal(high, ((pairs >> 4).to(dtype) - zero) * scales)


def _int4_candidate_matches_the_graph(candidate: tuple, m: int, n: int, seed: int, zero_points: bool = False,
                                      **keys: bool) -> None:
    """One tuner candidate of the int4 family (with its wrapper ``keys``) at [m, 4096] x [4096, n], bf16,
    groups of 128 (with ``zero_points``, one per group), the bias + GELU-tanh epilogue, against the graph's
    dequantization (>= 40 dB)."""
    import helion

    from helion_backend.kernels.quant_gemm import int4_gemm_helion
    from helion_backend.layers.quantize import Int4WeightOnlyLinear
    from helion_backend.semantics.reference import dequantize_int4, reference

    bm, bn, bk, warps, stages, split_k, indexing = candidate
    torch.manual_seed(seed)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(4096, n).to(device="cuda", dtype=torch.bfloat16),
                                             group_size=128, zero_points=zero_points)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    steps, operands = ("bias", "gelu_tanh"), [layer.bias]
    config = helion.Config(block_sizes=[bm, bn, bk], num_warps=warps, num_stages=stages, indexing=indexing,
                           split_k=split_k, **keys)
    out = int4_gemm_helion(x, layer.packed.t(), layer.group_params, steps, operands, [], torch.bfloat16,
                           config=config)
    w_kn = dequantize_int4(layer.packed, layer.group_params, torch.bfloat16).t()
    assert sqnr_db(reference(x, w_kn, steps, operands, [], torch.bfloat16), out) >= 40


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("candidate", range(14))
def test_int4_gemv_form_every_candidate(candidate, m):
    """Each of the tuner's int4 GEMV candidates (``gemv``: ``int4_gemv_kernel``) at one row and, as the tuner
    offers them at more (``gemv_rows``), at 3 and 8; the odd ones with zero points."""
    from helion_backend.tuning.candidates import INT4_GEMV_CANDIDATES, gemv_rows

    assert len(INT4_GEMV_CANDIDATES) == 14
    _int4_candidate_matches_the_graph(gemv_rows(m, INT4_GEMV_CANDIDATES[candidate:candidate + 1])[0], m, 1024,
                                      candidate + m, candidate % 2 == 1, gemv=True)


@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("candidate", range(12))
def test_int4_swapped_form_every_candidate(candidate, m):
    """Each of the tuner's swapped int4 candidates (``swap_ab``: ``swapped_int4_gemm_kernel``) at decode M; the
    odd ones with zero points."""
    from helion_backend.tuning.candidates import INT4_SWAPPED_CANDIDATES

    assert len(INT4_SWAPPED_CANDIDATES) == 12
    _int4_candidate_matches_the_graph(INT4_SWAPPED_CANDIDATES[candidate], m, 3072, candidate + m, candidate % 2 == 1,
                                      swap_ab=True)


@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("block_mn", [(16, 32), (16, 128), (32, 64)])
@pytest.mark.parametrize("prequantize_block_k", [None, 256, 512])
def test_block_fp8_kernel_blocks_and_split_k(prequantize_block_k, block_mn, split_k):
    """The block fp8 kernel against the graph's dequantize-then-multiply: N tiles narrower and wider than
    a weight block, and split-K (each split rescales its own blocks before the finishing pass); with
    ``prequantize``, groups dequantized first and K blocks of several groups."""
    import helion

    from helion_backend.kernels.quant_gemm import block_fp8_gemm_helion
    from helion_backend.layers.quantize import BlockFp8Linear
    from helion_backend.semantics.reference import dequantize_block_fp8, reference

    torch.manual_seed(3)
    linear = nn.Linear(4096, 512).to(device="cuda", dtype=torch.bfloat16)
    layer = BlockFp8Linear.from_linear(linear)
    program = _program_of(layer)
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    x[:, :128] *= 100  # groups of very different scales
    steps, operands = ("bias", "silu"), [layer.bias]
    blocks = {"block_sizes": list(block_mn)}
    if prequantize_block_k is not None:
        blocks = {"block_sizes": [*block_mn, prequantize_block_k], "prequantize": True}
    config = helion.Config(num_warps=4, num_stages=3, split_k=split_k, **blocks)
    out = block_fp8_gemm_helion(x, layer.qweight.t(), layer.weight_scale, steps, operands, [], torch.bfloat16,
                                program, config=config)
    x_dq, w_kn = dequantize_block_fp8(x, program, layer.qweight, layer.weight_scale)
    assert sqnr_db(reference(x_dq, w_kn, steps, operands, [], torch.bfloat16), out) >= 40


@pytest.mark.parametrize("m, bias, gelu", [*((m, bias, False) for m in (1, 8, 32, 36) for bias in (True, False)),
                                          (8, True, True)])
def test_block_fp8_scaled_mm_runs_as_the_block_fp8_kernel(m, bias, gelu):
    """Block fp8 through the blockwise ``_scaled_mm`` (bias added after it) is the same site as the
    hand-written form: the ``gemm_fp8_block`` kernel with both prologue steps, up to M = 32. The reference
    is the hand-written module of the same layer: cuBLASLt's blockwise kernel itself refuses an M that is
    not a multiple of 4 (torch 2.11, H200: CUBLAS_STATUS_NOT_SUPPORTED at M = 1 and 33), which the fused
    kernel does not."""
    from helion_backend.layers.quantize import BlockFp8Linear, _probe_blockwise_scaled_mm

    problem = _probe_blockwise_scaled_mm(torch.device("cuda"), torch.bfloat16)
    if problem is not None:
        pytest.skip(f"torch {torch.__version__} has no blockwise _scaled_mm on {torch.cuda.get_device_name()}: "
                    f"{problem}")
    torch.manual_seed(4)
    linear = nn.Linear(K, N, bias=bias).to(device="cuda", dtype=torch.bfloat16)
    activation = [nn.GELU(approximate="tanh")] if gelu else []
    model = nn.Sequential(BlockFp8Linear.from_linear(linear, use_scaled_mm=True), *activation).eval()
    hand_written = nn.Sequential(BlockFp8Linear.from_linear(linear), *activation).eval()
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor")
    with torch.no_grad():
        for _ in range(3):  # warm-up, record, replay
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            out = compiled(x)
            assert sqnr_db(hand_written(x), out) >= 40
    (site,) = sites(helion_backend.get_reports())
    assert (site.kernel, site.prologue) == (FAMILIES["fp8_block"], PROLOGUES["fp8_block"]), site
    assert site.epilogue == ["bias"] * bias + ["gelu_tanh"] * gelu, site.epilogue
    assert site.runs_on == ("helion" if m <= 32 else "inductor"), site.why
    assert not site.fallbacks, site.fallbacks


@pytest.mark.parametrize("dynamic", [None, True], ids=["mark_dynamic", "dynamic_true"])
@pytest.mark.parametrize("form", ["fp8_dynamic", "fp8_dynamic_kernel_quant", "fp8_block", "fp8_block_scaled_mm"])
def test_fp8_with_a_symbolic_token_count_runs_the_fused_kernel(form, dynamic):
    """A symbolic M (``mark_dynamic``, or ``dynamic=True``, which also lifts Python floats the forward reads)
    keeps the fp8 sites fused as with a static M (the per-token one reading the rows Inductor quantized, or
    with ``fuse_activation_quant`` quantizing them in its prologue): the Helion kernel up to M = 32, the
    unrewritten graph above (M = 64, a multiple of 4 as cuBLAS' blockwise ``_scaled_mm`` needs)."""
    from helion_backend.layers.quantize import BlockFp8Linear, _probe_blockwise_scaled_mm

    fmt = form.removesuffix("_scaled_mm").removesuffix("_kernel_quant")
    fused = form.endswith("_kernel_quant")
    if form.endswith("_scaled_mm") and (problem := _probe_blockwise_scaled_mm(torch.device("cuda"), torch.bfloat16)) is not None:
        pytest.skip(f"no blockwise _scaled_mm in torch {torch.__version__} here: {problem}")
    hand_written = quantize(float_block(), fmt)  # the reference (cuBLAS' blockwise kernel refuses M = 2)
    model = copy.deepcopy(hand_written)
    if form.endswith("_scaled_mm"):
        model.proj = BlockFp8Linear.from_linear(float_block().proj, use_scaled_mm=True)
    helion_backend.clear_reports()
    compiled = torch.compile(model, backend="helion_inductor", dynamic=dynamic,
                             options={"fuse_activation_quant": fused})
    with torch.no_grad():
        for m in (2, 8, 32, 64):  # not 1: Dynamo specializes a size of 1 (a graph of its own)
            x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
            r = torch.randn(m, N, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(r, 0)
            assert sqnr_db(hand_written(x, r), compiled(x, r)) >= 40, m
    (site,) = sites(helion_backend.get_reports())
    assert (site.m, site.kernel, site.prologue, site.runs_on) == (
        "dynamic", FAMILIES[fmt], prologue_of(fmt, fused), "helion"), site


def _program_of(module: nn.Module):
    """The program the matcher records for ``module``'s activation quantization."""
    from helion_backend.compile.trace import trace_sites

    x = torch.randn(4, module.in_features, device="cuda", dtype=torch.bfloat16)
    (site,) = trace_sites(module, x, fuse_activation_quant=True)
    assert site.quant_program is not None
    return site.quant_program


def test_zero_rows_and_saturation_behave_as_the_unfused_graph():
    """All-zero rows take the clamped scale (no NaN); huge values saturate to the format's max (the per-token
    formats with their rows quantized by Inductor and, with ``fuse_activation_quant``, by the kernel)."""
    reference = float_block()
    for fmt, fused in (("fp8_dynamic", False), ("fp8_dynamic", True), ("int8_dynamic", False),
                       ("int8_dynamic", True), ("fp8_block", False)):
        eager = quantize(copy.deepcopy(reference), fmt)
        compiled = torch.compile(copy.deepcopy(eager), backend="helion_inductor",
                                 options={"fuse_activation_quant": fused})
        x = torch.randn(4, K, device="cuda", dtype=torch.bfloat16)
        x[1] = 0
        x[2, :7] = 3e4
        r = torch.randn(4, N, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            out, unfused = compiled(x, r), eager(x, r)
        assert not out.isnan().any()
        assert sqnr_db(unfused, out) >= 40, (fmt, fused)


# --------------------------------------------------------------------------------------------------
# Quantized siblings (default options: rows quantized by Inductor): q/k/v in one launch, gate/up in one kernel.

SIB_D, SIB_KV, SIB_FF = 1024, 256, 3072
SIBLING_FAMILIES = {"fp8_dynamic": ("gemm_multi_fp8", "gemm_glu_fp8"), "int8_dynamic": ("gemm_multi_int8", "gemm_glu_int8")}


class DecoderGemms(nn.Module):
    """A decoder layer's GEMMs, decode-shaped: normed q/k/v, an output projection, a normed SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(SIB_D, SIB_D, bias=False), nn.Linear(SIB_D, SIB_KV, bias=False),
                                  nn.Linear(SIB_D, SIB_KV, bias=False))
        self.o = nn.Linear(SIB_D + 2 * SIB_KV, SIB_D, bias=False)
        self.gate, self.up = nn.Linear(SIB_D, SIB_FF, bias=False), nn.Linear(SIB_D, SIB_FF, bias=False)
        self.down = nn.Linear(SIB_FF, SIB_D, bias=False)

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = x + self.o(torch.cat([self.q(h), self.k(h), self.v(h)], -1))
        h = self.norm(a)
        return a + self.down(F.silu(self.gate(h)) * self.up(h))


@pytest.mark.parametrize("m", [1, 8, 32])
@pytest.mark.parametrize("fmt", sorted(SIBLING_FAMILIES))
def test_decoder_block_runs_qkv_and_gate_up_each_in_one_launch(fmt, m):
    """Placement (q/k/v one launch, gate/up one kernel, on Helion) and numerics: against the same quantized
    model compiled without the sibling fusions (40 dB) and the float model in float64 (no worse than the
    unfused compile by more than 0.5 dB)."""
    from helpers import WITHOUT_GATED

    multi, glu = SIBLING_FAMILIES[fmt]
    torch.manual_seed(m)
    base = DecoderGemms().to(device="cuda", dtype=torch.bfloat16).eval()
    model = quantize(copy.deepcopy(base), fmt)
    x = torch.randn(m, SIB_D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        helion_backend.clear_reports()
        out = torch.compile(model, backend="helion_inductor")(x.clone()).clone()
        found = sites(helion_backend.get_reports())
        torch._dynamo.reset()
        unfused = torch.compile(model, backend="helion_inductor", options={
            "builtin_rules": False, "rules": WITHOUT_GATED["rules"], "merge_siblings": False})(x.clone()).clone()
        exact = base.double()(x.double())
    kernels = sorted(s.kernel for s in found)
    assert kernels.count(multi) == 3 and kernels.count(glu) == 1, kernels
    assert all(s.runs_on == "helion" for s in found if s.kernel in (multi, glu)), [(s.kernel, s.runs_on) for s in found]
    assert not out.isnan().any()
    assert sqnr_db(unfused, out) >= 40
    assert sqnr_db(exact, out) >= sqnr_db(exact, unfused) - 0.5


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("m", [1, 16, 32])
def test_quantized_sibling_kernels_against_float64_with_poisoned_outputs(qdtype, m):
    """The shared launch and the gated kernel on quantized rows, each output against float64 of the same
    quantized operands; the allocator's memory is filled with NaN first, so an output tile left unwritten
    shows up."""
    from helion_backend.kernels.gemm import glu_gemm_helion
    from helion_backend.kernels.multi_gemm import multi_gemm_helion
    from helion_backend.runtime.dispatch import flatten_operands

    torch.manual_seed(m)
    k, widths = 1024, [1024, 256, 256]
    lim = 448.0 if qdtype == torch.float8_e4m3fn else 127.0

    def quantized(*shape):
        t = (torch.randn(*shape, device="cuda") * lim / 4).clamp(-lim, lim)
        return (t.round() if qdtype == torch.int8 else t).to(qdtype)

    xq, scale = quantized(m, k), torch.rand(m, 1, device="cuda") * 0.01 + 1e-3
    ws = [quantized(n, k).t() for n in widths]
    w_scales = [torch.rand(n, device="cuda") * 0.01 + 1e-3 for n in widths]
    own = ("token_scale", "channel_scale") if qdtype != torch.int8 else ("cast", "token_scale", "channel_scale")
    family = "fp8" if qdtype == torch.float8_e4m3fn else "int8"
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))  # poison what the next allocations reuse
    operands = [op for n, s in zip(widths, w_scales) for op in flatten_operands([scale, s], own, n)]
    outs = multi_gemm_helion(xq, ws, [own] * 3, operands, [], torch.bfloat16, kernel_family=f"gemm_multi_{family}")
    for out, w, s in zip(outs, ws, w_scales):
        ref = xq.double() @ w.double() * scale.double() * s.double()
        assert not out.isnan().any() and sqnr_db(ref, out) >= 40

    steps = (*own, "silu", "up_mul")
    (w_gate, w_up), (s_gate, s_up) = [quantized(3072, k).t() for _ in range(2)], [w_scales[1].repeat(12)] * 2
    ops = [*flatten_operands([scale, s_gate], own, 3072), *flatten_operands([scale, s_up], own, 3072)]
    torch.empty(64 << 20, device="cuda").fill_(float("nan"))
    out = glu_gemm_helion(xq, w_gate, w_up, steps, ops, [], torch.bfloat16, up_steps=own,
                          kernel_family=f"gemm_glu_{family}")
    gate = xq.double() @ w_gate.double() * scale.double() * s_gate.double()
    up = xq.double() @ w_up.double() * scale.double() * s_up.double()
    assert not out.isnan().any() and sqnr_db(F.silu(gate) * up, out) >= 40
