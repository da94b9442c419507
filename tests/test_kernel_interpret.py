"""The Helion GEMM + epilogue kernels on the CPU, through Triton's interpreter (``TRITON_INTERPRET=1``).

What the interpreter cannot run is left to ``test_gpu_kernels.py``: ``gelu`` and ``gelu_tanh`` lower to
libdevice ``erf``/``tanh``, which it lacks. Two interpreter bugs of Triton 3.6 are patched for these
tests only (see ``_interpreter_fixes``).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytest.importorskip("helion")

import helion  # noqa: E402
import triton.language as tl  # noqa: E402
from helion.runtime.kernel import BoundKernel  # noqa: E402
from helpers import Spread, diagonal, slow_except  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from helion_backend.kernels import configs, gemm, run_kernel  # noqa: E402
from helion_backend.kernels.gemm import gemm_epilogue_helion  # noqa: E402
from helion_backend.runtime.dispatch import flatten_operands  # noqa: E402
from helion_backend.semantics.epilogue import apply_epilogue, operand_kinds  # noqa: E402
from helion_backend.vocabulary import EPILOGUE_STEPS, Operand  # noqa: E402

# Triton fixes interpreted or compiled per function when it is decorated (its standard library when
# triton.language is imported), so the variable must be set before anything imports Triton, and a
# process with a GPU runs these kernels for real instead.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CPU-only run with TRITON_INTERPRET=1 set before Triton is imported",
)

NEEDS_LIBDEVICE = {"gelu", "gelu_tanh"}
# Steps every kernel family runs (``up_mul`` is the gated kernel's: test_gated_kernel_computes_both_projections).
INTERPRETABLE_STEPS = [s for s, kind in EPILOGUE_STEPS.items() if s not in NEEDS_LIBDEVICE and not kind.only_in]
# Small blocks keep the interpreter fast and make every test shape span several, partial, tiles.
BLOCKS = [16, 32, 32]


def _as_fp32(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
    if handle.dtype != tl.bfloat16:
        return handle
    data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
    return interpreter.TensorHandle(data, tl.float32)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_fixes():
    """Patch two interpreter bugs with their upstream fixes, and fail on any autotuning.

    - triton-lang/triton#9171: ``int()`` of a one-element array (dynamic loop bounds) raises on NumPy >= 2.4.
    - triton-lang/triton#11584: ``tl.dot`` of bfloat16 multiplies the raw uint16 bit patterns.
    - libdevice's ``rsqrt`` (the RMSNorm prologue), ``exp2`` and ``log2`` (decode attention) have no
      interpreter implementation; ``tl.math``'s have.
    """
    patch_tensor = interpreter._patch_lang_tensor
    create_dot = interpreter.InterpreterBuilder.create_dot

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def create_dot_fp32(self, a, b, *args):
        return create_dot(self, _as_fp32(a), _as_fp32(b), *args)

    def no_autotune(*args, **kwargs):
        raise AssertionError("a kernel autotuned")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_fp32)
        mp.setattr(BoundKernel, "autotune", no_autotune)
        mp.setattr(libdevice, "rsqrt", lambda v: tl.math.rsqrt(v))
        mp.setattr(libdevice, "exp2", lambda v: tl.math.exp2(v))
        mp.setattr(libdevice, "log2", lambda v: tl.math.log2(v))
        yield


def float64_reference(x, w_kn, steps, operands, scalars) -> torch.Tensor:
    acc = x.double() @ w_kn.double()
    return apply_epilogue(acc, steps, [op.double() for op in operands].__getitem__, scalars)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def weight(k: int, n: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """A [K, N] weight, or the transposed view of an [N, K] (nn.Linear) one."""
    return torch.randn(k, n, dtype=dtype) if layout == "kn" else torch.randn(n, k, dtype=dtype).t()


def operands_for(steps, m: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Fresh random operands; full ones are transposed views, to exercise strided loads."""
    shapes = {Operand.ROW: (n,), Operand.ELEMENT: (1,), Operand.COL: (m, 1)}
    return [
        torch.randn(n, m, dtype=dtype).t() if kind is Operand.FULL else torch.randn(shapes[kind], dtype=dtype)
        for kind in operand_kinds(steps)
    ]


def run(m, k, n, dtype, layout, steps, split_k, out_dtype=None, scalars=None, config=None):
    x = torch.randn(m, k, dtype=dtype)
    w_kn = weight(k, n, layout, dtype)
    operands = operands_for(steps, m, n, dtype)
    scalars = scalars if scalars is not None else [0.5 + i for i, s in enumerate(steps) if s == "scale"]
    config = config or helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1, split_k=split_k)
    flat = flatten_operands(operands, steps, n)  # broadcast views, as the fused op passes them
    out = gemm_epilogue_helion(x, w_kn, steps, flat, scalars, out_dtype or dtype, config)
    return out, float64_reference(x, w_kn, steps, operands, scalars)


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
ALL_INTERPRETABLE = ("bias", "relu", "scale", "residual", "mul", "silu", "scale", "sigmoid")


@pytest.mark.parametrize("m, dtype, layout, split_k",
                         diagonal([1, 3, 16, 33], [torch.float32, torch.bfloat16], ["kn", "nk"], [1, 4]))
def test_shapes_layouts_and_split_k(m, dtype, layout, split_k):
    out, ref = run(m, 100, 72, dtype, layout, ALL_INTERPRETABLE, split_k)
    assert out.shape == (m, 72) and out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("m, dtype, layout, block_n", diagonal(
    [1, 3], Spread([(torch.float32, "nk"), (torch.bfloat16, "nk"), (torch.bfloat16, "kn")]), [1, 16]))
def test_gemv_form_matches_float64(m, dtype, layout, block_n):
    """``gemv`` (``gemv_kernel``): products summed over K after the loop, N tiles down to one column, partial
    K and N tiles. A linear epilogue, so that no error is squashed."""
    config = helion.Config(block_sizes=[16, block_n, 32], num_warps=4, num_stages=1, **{configs.GEMV: True})
    out, ref = run(m, 300, 40, dtype, layout, ("bias", "scale", "residual"), 1, config=config)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


def test_gemv_form_with_split_k_is_refused():
    """The GEMV kernel has no K split: a config asking for both is an error, not a silent single pass."""
    config = helion.Config(block_sizes=[16, 8, 32], num_warps=4, num_stages=1, split_k=2, **{configs.GEMV: True})
    with pytest.raises(ValueError, match=r"GEMV form \(config key 'gemv'\) has no split-K, got split_k=2"):
        gemm_epilogue_helion(torch.randn(1, 64), torch.randn(64, 32), (), [], [], torch.float32, config)


@pytest.mark.parametrize("split_k", [1, pytest.param(2, marks=pytest.mark.slow)])  # split-K: in the shapes test
# Every step also runs in test_shapes_layouts_and_split_k (ALL_INTERPRETABLE): a few alone by default.
@pytest.mark.parametrize("steps", [(), *((s,) if s in {"bias", "relu", "residual"} else
                                       pytest.param((s,), marks=pytest.mark.slow) for s in INTERPRETABLE_STEPS)],
                         ids=str)
def test_each_step(steps, split_k):
    out, ref = run(5, 70, 40, torch.bfloat16, "nk", steps, split_k)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("k, split_k, splits", [(600, 4, 3), pytest.param(1536, 2, 2, marks=pytest.mark.slow),
                                               pytest.param(1280, 4, 3, marks=pytest.mark.slow)])
def test_split_k_workspace_slices(k, split_k, splits):
    """Splits span whole 256-element K runs, so there may be fewer than asked; each slice is written."""
    assert gemm.num_k_splits(k, split_k) == splits
    out, ref = run(6, k, 40, torch.float32, "nk", ("bias", "silu"), split_k)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_one_shape_under_two_split_factors():
    """The finishing pass shares its config across split factors: each must still sum every slice."""
    for split_k in (2, 4, 2):
        out, ref = run(4, 1024, 40, torch.float32, "nk", ("bias", "relu"), split_k)
        assert rel_err(out, ref) <= TOLERANCE[torch.float32], split_k


def test_out_dtype_differs_from_inputs():
    out, ref = run(3, 64, 48, torch.bfloat16, "nk", ("bias", "cast"), 1, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) <= 1e-5


def test_default_config_splits_decode_shape():
    """M=2, K=2048, N=64 is one output tile: the default config splits K, and stays correct."""
    m, k, n = 2, 2048, 64
    config = configs.default_config(m, k, n, torch.bfloat16)
    assert config["split_k"] > 1
    out, ref = run(m, k, n, torch.bfloat16, "nk", ("bias", "silu", "residual"), None, config=config)
    assert rel_err(out, ref) <= TOLERANCE[torch.bfloat16]


def test_run_kernel_uses_the_default_config():
    x, w_kn, bias = torch.randn(3, 64), torch.randn(48, 64).t(), torch.randn(48)
    out = run_kernel("gemm", x, w_kn, ("bias", "relu"), [bias], [], torch.float32)
    assert rel_err(out, float64_reference(x, w_kn, ("bias", "relu"), [bias], [])) <= 1e-5


def test_compiles_once_and_scalars_are_runtime_values():
    steps = ("bias", "scale", "residual")
    out_a, ref_a = run(4, 40, 24, torch.float32, "nk", steps, 1, scalars=[2.0])
    compiled = len(gemm._COMPILED)
    out_b, ref_b = run(4, 40, 24, torch.float32, "nk", steps, 1, scalars=[-3.0])
    assert len(gemm._COMPILED) == compiled
    assert rel_err(out_a, ref_a) <= 1e-5 and rel_err(out_b, ref_b) <= 1e-5


@pytest.mark.parametrize(
    "steps, operands, scalars, match",
    [
        (("bias",), [], [], "1 tensor operand"),
        (("scale",), [], [], "1 scalar"),
        (("bias",), [torch.randn(3)], [], r"shape \(8,\)"),
        (("residual",), [torch.randn(8)], [], r"shape \(2, 8\)"),
        (("nope",), [], [], "unknown epilogue step"),
    ],
)
def test_rejects_malformed_epilogue_arguments(steps, operands, scalars, match):
    with pytest.raises(ValueError, match=match):
        gemm_epilogue_helion(torch.randn(2, 4), torch.randn(4, 8), steps, operands, scalars, torch.float32)


# --------------------------------------------------------------------------------------------------
# Quantized kernels: the activation quantization is recorded from a traced function, as the matcher
# records it from a model's graph, and the kernel must compute what the unfused graph computes.


def program_from(quantize_fn, x: torch.Tensor, w_kn: torch.Tensor):
    """The program the backend records for ``quantize_fn(x) -> (x_quantized, scale)`` before an int8 GEMM."""
    from helion_backend.compile.trace import trace_sites

    def linear(x):
        quantized, scale = quantize_fn(x)
        return torch._int_mm(quantized, w_kn).to(torch.float32) * scale

    (site,) = trace_sites(linear, x, fuse_activation_quant=True)
    assert site.quant_program is not None, site
    return site.quant_program


def int8_per_token(x):
    """W8A8's quantization, truncating instead of rounding: the interpreter lacks libdevice's rint
    (the rounding form runs in test_gpu_kernels.py), and its fp8 loads are wrong, so fp8 runs there too."""
    amax, _ = x.abs().max(dim=-1, keepdim=True)
    scale = (amax.to(torch.float32) * (1 / 127.0)).clamp(min=1e-5)
    return (x.to(torch.float32) * scale.reciprocal()).clamp(-128, 127).to(torch.int8), scale


QUANT_STEPS = ("act_scale", "channel_scale", "bias", "relu")


@pytest.mark.parametrize("split_k, prequantize", diagonal([1, 2], [False, True]))
def test_dynamic_int8_kernel_matches_the_unfused_graph(split_k, prequantize):
    """The activation quantized in every output tile, or once by its own kernel (``prequantize``)."""
    from helion_backend.kernels.configs import PREQUANTIZE
    from helion_backend.kernels.quant_gemm import quant_gemm_helion
    from helion_backend.semantics.reference import reference

    m, k, n = 5, 600, 40
    x = torch.randn(m, k)
    w_kn = torch.randint(-128, 128, (n, k), dtype=torch.int8).t()
    program = program_from(int8_per_token, x, w_kn)
    operands = [torch.rand(n) + 0.5, torch.randn(n)]
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1, split_k=split_k,
                           **{PREQUANTIZE: prequantize})
    out = quant_gemm_helion(x, w_kn, QUANT_STEPS, operands, [], torch.float32, program, config=config)
    ref = reference(x, w_kn, QUANT_STEPS, operands, [], torch.float32, program)
    assert rel_err(out, ref.double()) <= 1e-5


@pytest.mark.parametrize("split_k, m, block_m", diagonal([1, 2], Spread([(5, 16), (1, 64)])))
def test_int8_kernel_on_rows_quantized_before_it(split_k, m, block_m):
    """The default compile's int8 site: rows Inductor quantized, multiplied as they are in one launch (the
    shipped configs' ``prequantize`` has nothing to quantize), their [M, 1] scale applied by ``token_scale``
    after the int32 -> fp32 cast, in the graph's order. One row under a 64-row block runs as two identical
    rows (so that the block holds), the per-row scale with it."""
    from helion_backend.kernels.configs import PREQUANTIZE
    from helion_backend.kernels.gemm import record_launches
    from helion_backend.kernels.quant_gemm import lowp_gemm_kernel, quant_gemm_helion
    from helion_backend.runtime.dispatch import flatten_operands
    from helion_backend.semantics.reference import reference

    k, n = 600, 40
    xq, scale = int8_per_token(torch.randn(m, k))
    w_kn = torch.randint(-128, 128, (n, k), dtype=torch.int8).t()
    steps = ("cast", "token_scale", "channel_scale", "bias", "relu")
    operands = flatten_operands([scale, torch.rand(n) + 0.5, torch.randn(n)], steps, n)
    config = helion.Config(block_sizes=[block_m, *BLOCKS[1:]], num_warps=4, num_stages=1, split_k=split_k,
                           **{PREQUANTIZE: True})
    with record_launches() as launches:
        out = quant_gemm_helion(xq, w_kn, steps, operands, [], torch.float32, None, config=config,
                                kernel_family="gemm_int8")
    gemms = [launch for launch in launches if launch.kernel.name != "epilogue_kernel"]
    assert [launch.kernel for launch in gemms] == [lowp_gemm_kernel]
    assert gemms[0].args[0].shape[0] == max(m, 2) and out.shape == (m, n) and out.is_contiguous()
    ref = reference(xq, w_kn, steps, operands, [], torch.float32)
    assert rel_err(out, ref.double()) <= 1e-5


@pytest.mark.parametrize("quantized_by", slow_except({"inductor", "program_prequantize"},
                                                  ["inductor", "program", "program_prequantize"]))
def test_int8_gemv_form_on_quantized_rows(quantized_by):
    """``gemv`` on int8: rows quantized before the call (the default compile's site), or by the site's own
    program, which the GEMV form always runs first, in its own kernel, whether or not ``prequantize`` says so."""
    from helion_backend.kernels.configs import GEMV, PREQUANTIZE
    from helion_backend.kernels.gemm import gemv_kernel, record_launches
    from helion_backend.kernels.quant_gemm import quant_gemm_helion, quantize_rows_kernel
    from helion_backend.runtime.dispatch import flatten_operands
    from helion_backend.semantics.reference import reference

    k, n = 600, 40
    x = torch.randn(1, k)
    w_kn = torch.randint(-128, 128, (n, k), dtype=torch.int8).t()
    channel, bias = torch.rand(n) + 0.5, torch.randn(n)
    config = helion.Config(block_sizes=[16, 4, 64], num_warps=4, num_stages=1, split_k=1,
                           **{GEMV: True, PREQUANTIZE: quantized_by == "program_prequantize"})
    if quantized_by == "inductor":
        rows, scale = int8_per_token(x)
        steps = ("cast", "token_scale", "channel_scale", "bias", "relu")
        args = (rows, w_kn, steps, flatten_operands([scale, channel, bias], steps, n), [], torch.float32, None)
    else:
        program = program_from(int8_per_token, x, w_kn)
        args = (x, w_kn, QUANT_STEPS, [channel, bias], [], torch.float32, program)
    with record_launches() as launches:
        out = quant_gemm_helion(*args, config=config, kernel_family="gemm_int8")
    expected = [gemv_kernel] if quantized_by == "inductor" else [quantize_rows_kernel, gemv_kernel]
    assert [launch.kernel for launch in launches] == expected
    assert rel_err(out, reference(*args).double()) <= 1e-5


@pytest.mark.parametrize("rows, m, split_k, layout", diagonal(["int8", "weight_only"], [5, 40], [1, 2], ["nk", "kn"]))
def test_swapped_kernel_matches_the_unfused_graph(rows, m, split_k, layout):
    """``swap_ab``: ``w @ x.T`` in [N block, M block] tiles, transposed back for the epilogue, which reads its
    per-row and per-column operands the right way round; M over several row blocks, partial tiles on both
    sides, a split K, the weight stored [N, K] (``nn.Linear``'s) or [K, N]. int8 rows Inductor quantized
    (int32 products), or float rows by an int8 weight."""
    from helion_backend.kernels.configs import SWAP_AB
    from helion_backend.kernels.gemm import record_launches
    from helion_backend.kernels.quant_gemm import quant_gemm_helion, swapped_lowp_gemm_kernel
    from helion_backend.runtime.dispatch import flatten_operands
    from helion_backend.semantics.reference import reference

    k, n = 600, 80
    w_kn = torch.randint(-128, 128, (n, k), dtype=torch.int8).t()
    w_kn = w_kn if layout == "nk" else w_kn.contiguous()
    channel, bias = torch.rand(n) + 0.5, torch.randn(n)
    if rows == "int8":
        x, scale = int8_per_token(torch.randn(m, k))
        steps, family = ("cast", "token_scale", "channel_scale", "bias", "relu"), "gemm_int8"
        operands = flatten_operands([scale, channel, bias], steps, n)
    else:
        x, steps, family, operands = torch.randn(m, k), ("channel_scale", "bias", "relu"), "gemm_weight_only", [
            channel, bias]
    config = helion.Config(block_sizes=[16, 64, 128], num_warps=4, num_stages=1, split_k=split_k,
                           **{SWAP_AB: True})
    with record_launches() as launches:
        out = quant_gemm_helion(x, w_kn, steps, operands, [], torch.float32, None, config=config,
                                kernel_family=family)
    gemms = [launch.kernel for launch in launches if launch.kernel.name != "epilogue_kernel"]
    assert gemms == [swapped_lowp_gemm_kernel] and out.shape == (m, n) and out.is_contiguous()
    assert rel_err(out, reference(x, w_kn, steps, operands, [], torch.float32).double()) <= 1e-5


def test_swapped_kernel_quantizes_the_rows_first():
    """A site that quantizes its own rows (``fuse_activation_quant``) runs the swapped form on rows quantized by
    their own kernel first, whether or not the config says ``prequantize``."""
    from helion_backend.kernels.configs import SWAP_AB
    from helion_backend.kernels.gemm import record_launches
    from helion_backend.kernels.quant_gemm import (
        quant_gemm_helion,
        quantize_rows_kernel,
        swapped_lowp_gemm_kernel,
    )
    from helion_backend.semantics.reference import reference

    m, k, n = 5, 600, 80
    x = torch.randn(m, k)
    w_kn = torch.randint(-128, 128, (n, k), dtype=torch.int8).t()
    program = program_from(int8_per_token, x, w_kn)
    operands = [torch.rand(n) + 0.5, torch.randn(n)]
    config = helion.Config(block_sizes=[16, 64, 128], num_warps=4, num_stages=1, split_k=1, **{SWAP_AB: True})
    with record_launches() as launches:
        out = quant_gemm_helion(x, w_kn, QUANT_STEPS, operands, [], torch.float32, program, config=config,
                                kernel_family="gemm_int8")
    assert [launch.kernel for launch in launches] == [quantize_rows_kernel, swapped_lowp_gemm_kernel]
    assert rel_err(out, reference(x, w_kn, QUANT_STEPS, operands, [], torch.float32, program).double()) <= 1e-5


@pytest.mark.parametrize("gemv", [False, True], ids=["dot", "gemv"])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_weight_only_int8_kernel(layout, gemv):
    from helion_backend.kernels.quant_gemm import quant_gemm_helion

    m, k, n = 1 if gemv else 3, 300, 40
    x = torch.randn(m, k)
    w = torch.randint(-128, 128, (k, n) if layout == "kn" else (n, k), dtype=torch.int8)
    w_kn = w if layout == "kn" else w.t()
    scale, bias = torch.rand(n), torch.randn(n)
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1, split_k=1, **{configs.GEMV: gemv})
    steps = ("channel_scale", "bias", "silu")
    out = quant_gemm_helion(x, w_kn, steps, [scale, bias], [], torch.float32, config=config,
                            kernel_family="gemm_weight_only")
    assert rel_err(out, float64_reference(x, w_kn.double(), steps, [scale, bias], [])) <= 1e-5


@pytest.mark.parametrize("dtype, layout", diagonal([torch.float32, torch.bfloat16], ["kn", "nk"]))
def test_gated_kernel_computes_both_projections(dtype, layout):
    """``silu(x @ w_gate) * (x @ w_up) + residual`` from one pass over x."""
    from helion_backend.kernels.gemm import glu_gemm_helion

    m, k, n = 5, 100, 72
    x = torch.randn(m, k, dtype=dtype)
    w_gate, w_up = weight(k, n, layout, dtype), weight(k, n, layout, dtype)
    residual = torch.randn(m, n, dtype=dtype)
    steps = ("silu", "up_mul", "residual")
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1)
    out = glu_gemm_helion(x, w_gate, w_up, steps, [residual], [], dtype, config=config)
    up = x.double() @ w_up.double()
    ref = apply_epilogue(x.double() @ w_gate.double(), steps, [residual.double()].__getitem__, [], up)
    assert rel_err(out, ref) <= TOLERANCE[dtype]


def test_a_step_of_another_kernel_family_is_refused():
    x, w_kn = torch.randn(4, 64), torch.randn(64, 32)
    with pytest.raises(ValueError, match="'up_mul' runs only in the gemm_glu, gemm_glu_fp8, gemm_glu_int8 kernels, not in gemm"):
        gemm_epilogue_helion(x, w_kn, ("silu", "up_mul"), [], [], torch.float32)


# (K, group size): K blocks of 32 bytes that cross the groups' borders (scales gathered per byte) and end
# partial at 300 bytes, or that divide the groups (one row of scales a step, ``group_steps``).
INT4_SHAPES = [(600, 40), (640, 64)]


def _group_steps(launch) -> bool:
    """The ``group_steps`` constant an int4 kernel was launched with (it comes before ``nibbles``)."""
    return launch.args[-3].value


@pytest.mark.parametrize("k, group", INT4_SHAPES)
@pytest.mark.parametrize("dtype, split_k, paired_loads, zero_points",
                         diagonal([torch.float32, torch.float16], [1, 2], [False, True], [False, True]))
def test_int4_weight_only_kernel_dequantizes_as_the_graph(dtype, split_k, paired_loads, zero_points, k, group):
    """Packed bytes and group scales (and zero points) read in the K loop; the reference dequantizes with the
    graph's ops. K spans several K blocks (of 32 bytes), crossing the groups' borders or within them
    (``INT4_SHAPES``); the activation's even and odd columns read as two views or (``paired_loads``) as pairs
    split in registers.
    float16, not bfloat16: the interpreter's bfloat16 arithmetic works on raw bit patterns (the
    dequantization is elementwise math in the activation's dtype; test_gpu_quant.py runs bfloat16)."""
    import torch.nn as nn

    from helion_backend.kernels.gemm import record_launches
    from helion_backend.kernels.quant_gemm import int4_gemm_helion
    from helion_backend.layers.quantize import Int4WeightOnlyLinear
    from helion_backend.semantics.reference import dequantize_int4, reference

    torch.manual_seed(split_k)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(k, 40).to(dtype), group_size=group, zero_points=zero_points)
    x = torch.randn(5, k, dtype=dtype)
    steps, operands = ("bias", "silu"), [layer.bias]
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1, split_k=split_k,
                           paired_loads=paired_loads)
    with record_launches() as launches:
        out = int4_gemm_helion(x, layer.packed.t(), layer.group_params, steps, operands, [], dtype, config=config)
    assert _group_steps(launches[0]) == (group == 64)
    w_kn = dequantize_int4(layer.packed, layer.group_params, dtype).t()
    assert rel_err(out, reference(x, w_kn, steps, operands, [], torch.float64)) <= TOLERANCE[dtype]
    assert rel_err(out, torch.nn.functional.silu(layer(x).double())) <= TOLERANCE[dtype]


@pytest.mark.parametrize("k, group", INT4_SHAPES)
@pytest.mark.parametrize("m, block_m, block_n, zero_points", [(1, 16, 1, False), (1, 16, 4, True), (3, 16, 8, False),
                                                             (3, 16, 8, True), (4, 4, 8, True), (8, 8, 2, False)])
def test_int4_gemv_form_dequantizes_as_the_graph(m, block_m, block_n, zero_points, k, group):
    """``gemv`` on int4 (``int4_gemv_kernel``): the layer's [N, K/2] bytes and [N, K/G] scales (and zero
    points) read along K,
    each byte's two products summed after the loop; K blocks of 32 bytes across or within the groups
    (``INT4_SHAPES``), N tiles of one column up. The tuner offers it up to ``GEMV_MAX_M`` rows with an M block of
    M's next power of two (``gemv_rows``); it is right at any M and M block."""
    import torch.nn as nn

    from helion_backend.kernels.gemm import record_launches
    from helion_backend.kernels.quant_gemm import int4_gemm_helion, int4_gemv_kernel
    from helion_backend.layers.quantize import Int4WeightOnlyLinear
    from helion_backend.semantics.reference import dequantize_int4, reference

    torch.manual_seed(m + block_m + block_n)
    dtype = torch.float16  # the interpreter's bfloat16 arithmetic works on raw bit patterns (see above)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(k, 24).to(dtype), group_size=group, zero_points=zero_points)
    x = torch.randn(m, k, dtype=dtype)
    steps, operands = ("bias", "silu"), [layer.bias]
    config = helion.Config(block_sizes=[block_m, block_n, 32], num_warps=4, num_stages=1, gemv=True)
    with record_launches() as launches:
        out = int4_gemm_helion(x, layer.packed.t(), layer.group_params, steps, operands, [], dtype, config=config)
    assert [launch.kernel for launch in launches] == [int4_gemv_kernel]
    assert _group_steps(launches[0]) == (group == 64)
    w_kn = dequantize_int4(layer.packed, layer.group_params, dtype).t()
    assert rel_err(out, reference(x, w_kn, steps, operands, [], torch.float64)) <= TOLERANCE[dtype]
    assert rel_err(out, torch.nn.functional.silu(layer(x).double())) <= TOLERANCE[dtype]


@pytest.mark.parametrize("k, group", INT4_SHAPES)
@pytest.mark.parametrize("m, split_k, zero_points", [(1, 1, True), (5, 1, False), (5, 2, False), (5, 2, True)])
def test_int4_swapped_form_dequantizes_as_the_graph(m, split_k, zero_points, k, group):
    """``swap_ab`` on int4 (``swapped_int4_gemm_kernel``): the [N, K/2] bytes dequantized as the dot's first
    operand times x's pairs transposed, the tile transposed back for the epilogue; K blocks of 32 bytes
    across or within the groups (``INT4_SHAPES``), and split-K finishes in the epilogue kernel."""
    import torch.nn as nn

    from helion_backend.kernels.gemm import record_launches
    from helion_backend.kernels.quant_gemm import int4_gemm_helion, swapped_int4_gemm_kernel
    from helion_backend.layers.quantize import Int4WeightOnlyLinear
    from helion_backend.semantics.reference import dequantize_int4, reference

    torch.manual_seed(m + split_k)
    dtype = torch.float16  # the interpreter's bfloat16 arithmetic works on raw bit patterns (see above)
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(k, 24).to(dtype), group_size=group, zero_points=zero_points)
    x = torch.randn(m, k, dtype=dtype)
    steps, operands = ("bias", "silu"), [layer.bias]
    config = helion.Config(block_sizes=[16, 16, 32], num_warps=4, num_stages=1, split_k=split_k, swap_ab=True)
    with record_launches() as launches:
        out = int4_gemm_helion(x, layer.packed.t(), layer.group_params, steps, operands, [], dtype, config=config)
    assert launches[0].kernel is swapped_int4_gemm_kernel
    assert _group_steps(launches[0]) == (group == 64)
    w_kn = dequantize_int4(layer.packed, layer.group_params, dtype).t()
    assert rel_err(out, reference(x, w_kn, steps, operands, [], torch.float64)) <= TOLERANCE[dtype]


def test_int4_zero_points_read_from_a_strided_view():
    """Scales and zero points held apart ([2, N, K/G], seen as [N, K/G, 2], so neither half is contiguous)
    are read where they are, by their strides."""
    import torch.nn as nn

    from helion_backend.kernels.quant_gemm import int4_gemm_helion
    from helion_backend.layers.quantize import Int4WeightOnlyLinear
    from helion_backend.semantics.reference import dequantize_int4, reference

    torch.manual_seed(5)
    dtype = torch.float16
    layer = Int4WeightOnlyLinear.from_linear(nn.Linear(640, 24).to(dtype), group_size=64, zero_points=True)
    apart = layer.scales_and_zeros.permute(2, 0, 1).contiguous()  # [2, N, K/G]
    params = apart.permute(1, 2, 0)
    assert torch.equal(params, layer.scales_and_zeros) and not params.is_contiguous()
    x = torch.randn(3, 640, dtype=dtype)
    for extra in ({}, {"swap_ab": True}, {"gemv": True}):
        config = helion.Config(block_sizes=[16, 8, 32], num_warps=4, num_stages=1, split_k=1, **extra)
        out = int4_gemm_helion(x, layer.packed.t(), params, (), [], [], dtype, config=config)
        w_kn = dequantize_int4(layer.packed, params, dtype).t()
        assert rel_err(out, reference(x, w_kn, (), [], [], torch.float64)) <= TOLERANCE[dtype], extra


def test_int4_kernel_refuses_scales_that_do_not_fit():
    from helion_backend.kernels.quant_gemm import int4_gemm_helion

    x, packed = torch.randn(2, 64), torch.zeros(32, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="even group size"):
        int4_gemm_helion(x, packed, torch.ones(8, 3), (), [], [], torch.float32)
    with pytest.raises(ValueError, match="scales in x's dtype"):
        int4_gemm_helion(x, packed, torch.ones(8, 2, dtype=torch.bfloat16), (), [], [], torch.float32)
    with pytest.raises(ValueError, match=r"\[N, K/G, 2\] with zero points"):
        int4_gemm_helion(x, packed, torch.ones(8, 2, 3), (), [], [], torch.float32)


def fp8_exact_activation(m: int, k: int, group: int) -> torch.Tensor:
    """An activation whose quantization per group is exact: fp8 values, each group's amax 448, times a
    power-of-two scale per group. The interpreter's float -> fp8 conversion does not round as CUDA's
    does (the GPU tests cover that); on these values it has nothing to round."""
    values = (torch.randn(m, k) * 50).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    values[:, ::group] = 448.0
    exponents = torch.randint(-6, 3, (m, k // group)).float()
    return (values.reshape(m, k // group, group) * torch.exp2(exponents)[..., None]).reshape(m, k)


@pytest.mark.parametrize("prequantize, split_k, m", diagonal([False, True], [1, 2], [1, 5]))
def test_block_fp8_kernel_scales_each_block_product(prequantize, split_k, m):
    """Per-group activation scales and per-block weight scales applied to each 128-wide block's fp8
    product; K = 640 gives five groups (split-K: 512 + 128), N = 256 two weight blocks along N. One row
    runs as two (Helion 1.4 cannot compile the group amax of one), the residual's row with it. With
    ``prequantize`` the groups are dequantized first and the weight scaled in the K loop: K blocks of 256
    (the last one partial) and an N block of 256, capped at one weight block."""
    import torch.nn as nn

    from helion_backend.compile.trace import trace_sites
    from helion_backend.kernels.quant_gemm import block_fp8_gemm_helion
    from helion_backend.layers.quantize import FP8_BLOCK, BlockFp8Linear
    from helion_backend.semantics.reference import dequantize_block_fp8, reference

    torch.manual_seed(split_k)
    layer = BlockFp8Linear.from_linear(nn.Linear(640, 256))
    x = fp8_exact_activation(m, 640, FP8_BLOCK)
    (site,) = trace_sites(layer, x)
    assert site.prologue[0].name == "quant_fp8_per_group", site.prologue
    steps, operands = ("bias", "residual", "relu"), [layer.bias, torch.randn(m, 256)]
    extra = {"block_sizes": [16, 256, 256], "prequantize": True} if prequantize else {"block_sizes": [16, 32]}
    config = helion.Config(num_warps=4, num_stages=1, split_k=split_k, **extra)
    out = block_fp8_gemm_helion(x, layer.qweight.t(), layer.weight_scale, steps, operands, [], torch.float32,
                                site.quant_program, config=config)
    assert out.shape == (m, 256) and out.is_contiguous()
    x_dq, w_kn = dequantize_block_fp8(x, site.quant_program, layer.qweight, layer.weight_scale)
    assert torch.equal(x_dq, x)  # the activation was chosen so that its quantization is exact
    assert rel_err(out, reference(x_dq, w_kn, steps, operands, [], torch.float64)) <= 1e-5
    assert rel_err(out, torch.relu(layer(x) + operands[1]).double()) <= 1e-5


# --------------------------------------------------------------------------------------------------
# RMSNorm prologue: the norm is recorded from a traced module, as the matcher records it from a model.


class _HFRMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: fp32, rounded back to the input dtype, then times the weight."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(size, dtype=dtype) * 0.1 + 1)

    def forward(self, x):
        h = x.to(torch.float32)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


# One row takes its sums of squares from the GEMM's K loop, more rows from a first pass (norm.ONE_PASS_MAX_M).
NORM_ROWS = [1, 5]


@pytest.mark.parametrize("dtype, spelling, gemv, split_k, m", diagonal(
    [torch.float32, torch.bfloat16],
    Spread([("hf", False, 1), ("hf", False, 2), ("nn_rmsnorm", False, 1), ("nn_rmsnorm", False, 2), ("hf", True, 1)]),
    NORM_ROWS))
def test_rmsnorm_prologue_kernel_matches_the_unfused_graph(dtype, split_k, spelling, m, gemv):
    """Rows normalized over all of K (several partial K blocks, split or not), then multiplied (by a dot, or
    as a GEMV)."""
    from helion_backend.compile.trace import trace_sites
    from helion_backend.semantics.norm import rms_norm
    from helion_backend.semantics.reference import reference

    k, n = 300, 40
    norm = _HFRMSNorm(k, dtype) if spelling == "hf" else torch.nn.RMSNorm(k, eps=1e-5, dtype=dtype)
    linear = torch.nn.Linear(k, n, bias=False, dtype=dtype)
    x = torch.randn(m, k, dtype=dtype) * 3
    (site,) = trace_sites(torch.nn.Sequential(norm, linear), x)
    spec = site.rms_norm.spec
    assert spec.round_before_weight == (spelling == "hf" and dtype != torch.float32)
    w_kn, steps, operands = linear.weight.detach().t(), ("relu", "residual"), [torch.randn(m, n, dtype=dtype)]
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1, split_k=split_k, **{configs.GEMV: gemv})
    with torch.no_grad():
        out = gemm_epilogue_helion(x, w_kn, steps, operands, [], dtype, config, norm=(norm.weight, spec))
        ref = reference(rms_norm(x, norm.weight, spec), w_kn, steps, operands, [], dtype)
    assert rel_err(out, ref.double()) <= TOLERANCE[dtype]


def test_rmsnorm_weight_of_the_wrong_length_is_refused():
    from helion_backend.semantics.norm import RmsNormSpec

    with pytest.raises(ValueError, match=r"RMSNorm weight must be a float \[64\] vector"):
        gemm_epilogue_helion(torch.randn(4, 64), torch.randn(64, 32), (), [], [], torch.float32,
                             norm=(torch.randn(32), RmsNormSpec(1e-6, False)))


# GEMMs of one activation in one launch (kernels/multi_gemm.py).
MULTI_EPILOGUES = [("bias", "relu"), ("scale",), ("residual", "scale", "sigmoid")]


@pytest.mark.parametrize("dtype, outputs, norm, m", diagonal(
    [torch.float32, torch.bfloat16], [2, 3], Spread([(False, 5), (True, 5), (True, 1)])))
def test_multi_gemm_kernel_runs_each_output_with_its_own_epilogue(dtype, outputs, norm, m):
    """Every output against float64, each with its own width, layout, operands and scalars (read from the
    shared lists at its own offsets); with a norm, the rows normalized in the same pass for all of them."""
    from helion_backend.kernels.multi_gemm import multi_gemm_helion
    from helion_backend.semantics.norm import RmsNormSpec, rms_norm

    torch.manual_seed(outputs)
    k, widths = 300, [72, 40, 24][:outputs]
    x = torch.randn(m, k, dtype=dtype) * 2
    w_kns = [weight(k, n, layout, dtype) for n, layout in zip(widths, ["nk", "kn", "nk"])]
    steps = MULTI_EPILOGUES[:outputs]
    operands = [operands_for(s, m, n, dtype) for s, n in zip(steps, widths)]
    scalars = [[0.5 + i + 0.25 * j for i, step in enumerate(s) if step == "scale"] for j, s in enumerate(steps)]
    spec = (torch.randn(k, dtype=dtype) * 0.1 + 1, RmsNormSpec(1e-6, dtype != torch.float32)) if norm else None
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1)
    outs = multi_gemm_helion(x, w_kns, steps, [op for ops in operands for op in ops], sum(scalars, []), dtype,
                             config, norm=spec)
    rows = rms_norm(x, *spec) if norm else x
    assert len(outs) == outputs
    for out, w_kn, s, ops, scs in zip(outs, w_kns, steps, operands, scalars):
        assert out.shape == (m, w_kn.shape[1]) and out.dtype == dtype
        assert rel_err(out, float64_reference(rows, w_kn, s, ops, scs)) <= TOLERANCE[dtype]


def test_multi_gemm_kernel_refuses_operands_its_epilogues_do_not_read():
    from helion_backend.kernels.multi_gemm import multi_gemm_helion

    x, w = torch.randn(4, 64), torch.randn(64, 32)
    with pytest.raises(ValueError, match=r"read 1 tensor operand\(s\) and 0 scalar\(s\), got 2 and 0"):
        multi_gemm_helion(x, [w, w], [("bias",), ()], [torch.randn(32), torch.randn(32)], [], torch.float32)
    with pytest.raises(ValueError, match="expected 2 to 3 weights"):
        multi_gemm_helion(x, [w], [()], [], [], torch.float32)


def gated_norm_case(m: int, k: int, n: int, dtype: torch.dtype, round_before_weight: bool):
    """Fresh inputs of a normalized gated MLP, ``silu(norm(x) @ w_gate) * (norm(x) @ w_up) + residual``
    stored in fp32 (so that the norm's roundings are not hidden by the output's), and its float64 result
    on the activation normalized as the graph does it."""
    from helion_backend.semantics.norm import RmsNormSpec, rms_norm

    x = torch.randn(m, k, dtype=dtype) * 3
    w_gate, w_up = weight(k, n, "nk", dtype), weight(k, n, "nk", dtype)
    norm = (torch.randn(k, dtype=dtype) * 0.1 + 1, RmsNormSpec(1e-5, round_before_weight))
    steps, operands = ("silu", "up_mul", "residual", "cast"), [torch.randn(m, n, dtype=dtype)]
    normed = rms_norm(x, *norm).double()
    ref = apply_epilogue(normed @ w_gate.double(), steps, [operands[0].double()].__getitem__, [],
                         normed @ w_up.double())
    return (x, w_gate, w_up, steps, operands, [], torch.float32), norm, ref


# Against float64 on the activation normalized as the graph does it. The kernel rounds x * weight to
# bfloat16 instead (one rounding where the graph has two), which the interpreter truncates where CUDA
# rounds to nearest even: a few 1e-3.
GATED_NORM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype, round_before_weight, m", diagonal([torch.float32, torch.bfloat16], [True, False], [1, 19]))
def test_gated_kernel_with_rmsnorm_matches_float64(dtype, round_before_weight, m):
    """Both projections read the rows normalized over all of K, in the same pass: M, N and K each span
    several tiles, the last one partial."""
    from helion_backend.kernels.gemm import glu_gemm_helion

    args, norm, ref = gated_norm_case(m, 100, 72, dtype, round_before_weight)
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1)
    out = glu_gemm_helion(*args, config=config, norm=norm)
    assert rel_err(out, ref) <= GATED_NORM_TOLERANCE[dtype]


def test_run_kernel_gives_the_gated_kernel_its_norm():
    args, norm, ref = gated_norm_case(5, 300, 40, torch.bfloat16, True)
    x, w_gate, w_up, *rest = args
    out = run_kernel("gemm_glu", x, w_gate, *rest, up_kn=w_up, norm=norm)
    assert rel_err(out, ref) <= GATED_NORM_TOLERANCE[torch.bfloat16]


def test_float16_rows_are_refused_by_the_norm_kernels():
    """x * weight, which the kernels' norm multiplies before it scales, can overflow float16 where the
    normalized rows do not (x = 3e4, weight = 4): every kernel with the prologue refuses float16."""
    from helion_backend.kernels.multi_gemm import multi_gemm_helion
    from helion_backend.semantics.norm import RmsNormSpec

    x, w = torch.randn(4, 64, dtype=torch.float16), torch.randn(64, 32, dtype=torch.float16)
    norm = (torch.full((64,), 4.0, dtype=torch.float16), RmsNormSpec(1e-6, True))
    refused = r"RMSNorm prologue runs on \(torch.bfloat16, torch.float32\) rows, got torch.float16"
    with pytest.raises(ValueError, match=refused):
        gemm_epilogue_helion(x, w, (), [], [], torch.float16, norm=norm)
    with pytest.raises(ValueError, match=refused):
        multi_gemm_helion(x, [w, w], [(), ()], [], [], torch.float16, norm=norm)
    with pytest.raises(ValueError, match=refused):
        run_kernel("gemm_glu", x, w, (), [], [], torch.float16, up_kn=w, norm=norm)


ATTENTION_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def attention_case(rows: int, kv_len: int, dtype: torch.dtype, mask_kind: str):
    """q [2, 3, rows, 32] over a cache stored [B, L, H, D] (strided views), each sequence with its own length."""
    q = torch.randn(2, 3, rows, 32, dtype=dtype)
    k, v = (torch.randn(2, kv_len, 3, 32, dtype=dtype).transpose(1, 2) for _ in range(2))
    keep = (torch.arange(kv_len)[None, :] < torch.tensor([kv_len // 3, kv_len - 5])[:, None]).view(2, 1, 1, kv_len)
    mask = {"none": None, "bool": keep,
            "bias": torch.randn(2, 3, rows, kv_len, dtype=dtype).masked_fill(~keep, float("-inf"))}[mask_kind]
    double_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=double_mask, scale=0.2)
    return (q, k, v, mask), ref


@pytest.mark.parametrize("rows, dtype, mask_kind, split_kv", slow_except({
    (5, torch.bfloat16, "bias", 4)}, [
    *((5, torch.bfloat16, mask_kind, split_kv) for mask_kind in ("none", "bool", "bias") for split_kv in (1, 4)),
    (1, torch.float32, "bool", 4),
    (5, torch.float32, "bias", 1),
]))
def test_decode_attention_kernel_matches_float64(rows, dtype, mask_kind, split_kv):
    """Cache chunks of 64 over L = 200 (the last one partial), blocks of 32: every chunk and block boundary."""
    from helion_backend.kernels.attention import decode_attention_helion

    args, ref = attention_case(rows, 200, dtype, mask_kind)
    config = helion.Config(block_sizes=[32, 64, 16], split_kv=split_kv, num_warps=4, num_stages=1)
    out = decode_attention_helion(*args, scale=0.2, config=config)
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) <= ATTENTION_TOLERANCE[dtype]


def test_decode_attention_kernel_refuses_a_one_position_cache():
    from helion_backend.kernels.attention import decode_attention_helion

    (q, k, v, _), _ = attention_case(1, 1, torch.float32, "none")
    with pytest.raises(ValueError, match="length of 1"):
        decode_attention_helion(q, k, v, None, scale=0.2)


@pytest.mark.slow  # as the attention cases below: the kernel against float64 above runs by default
@pytest.mark.parametrize("rows, out_layout", [(3, "rows_outer"), (1, "contiguous")])
def test_decode_attention_kernel_grouped_query_heads(rows, out_layout):
    """6 query heads over 2 key/value heads: a key/value head's 3 query heads (x rows) are its kernel rows.
    Three rows with a per-row mask make the mask's grouped view a copy, and an output stored [B, R, H, D]
    cannot be viewed grouped: the result is copied into it."""
    from helion_backend.kernels.attention import decode_attention_helion

    q = torch.randn(2, 6, rows, 32, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 150, 32, dtype=torch.bfloat16) for _ in range(2))
    keep = torch.rand(2, 1, rows, 150) < 0.7
    out = torch.empty(2, rows, 6, 32, dtype=torch.bfloat16).transpose(1, 2) if out_layout == "rows_outer" else None
    config = helion.Config(block_sizes=[32, 64, 16], split_kv=2, num_warps=4, num_stages=1)
    got = decode_attention_helion(q, k, v, keep, config=config, out=out)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep, enable_gqa=True)
    assert got.shape == ref.shape and (out is None or got is out)
    assert rel_err(got, ref) <= ATTENTION_TOLERANCE[torch.bfloat16]


@pytest.mark.slow
@pytest.mark.parametrize("split_kv", [1, 4])
def test_decode_attention_row_with_nothing_to_attend_is_zero(split_kv):
    """As PyTorch's attention (its safe softmax): zeros, not NaN, from one chunk or from several."""
    from helion_backend.kernels.attention import decode_attention_helion

    q, k, v = torch.randn(1, 2, 2, 16), torch.randn(1, 2, 130, 16), torch.randn(1, 2, 130, 16)
    keep = torch.ones(1, 2, 2, 130, dtype=torch.bool)
    keep[0, 1, 1] = False
    config = helion.Config(block_sizes=[32, 64, 16], split_kv=split_kv, num_warps=4, num_stages=1)
    out = decode_attention_helion(q, k, v, keep, config=config)
    assert torch.equal(out[0, 1, 1], torch.zeros(16))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=keep))


@pytest.mark.slow
@pytest.mark.parametrize("masked_bias", [-3.0, -65536.0])
@pytest.mark.parametrize("split_kv", [1, 4])
def test_decode_attention_masked_positions_add_a_finite_bias(split_kv, masked_bias):
    """A boolean mask with a finite ``masked_bias`` computes the bias ``where(keep, 0, masked_bias)``: masked
    positions still count (a fully masked row attends to all of them), just less. With cuDNN's -65536 the
    kernel skips reading masked positions, and the fully masked row must still attend to every one (its
    fp32 logits and log-sum-exps near -94548 keep 2^-7 of absolute precision, about 0.5% of a probability,
    as in the graph: hence the looser bound)."""
    from helion_backend.kernels.attention import decode_attention_helion

    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 130, 16), torch.randn(1, 2, 130, 16)
    keep = torch.rand(1, 2, 3, 130) < 0.5
    keep[0, 1, 2] = False
    config = helion.Config(block_sizes=[32, 64, 16], split_kv=split_kv, num_warps=4, num_stages=1)
    out = decode_attention_helion(q, k, v, keep, config=config, masked_bias=masked_bias)
    bias = torch.where(keep, 0.0, masked_bias).double()
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias)
    tolerance = ATTENTION_TOLERANCE[torch.float32] if masked_bias == -3.0 else 1e-2
    assert rel_err(out, ref) <= tolerance
    unmasked = F.scaled_dot_product_attention(q[0, 1, 2:].double(), k[0, 1].double(), v[0, 1].double())
    assert rel_err(out[0, 1, 2:], unmasked) <= tolerance


@pytest.mark.slow
@pytest.mark.parametrize("split_kv, masked_bias", [(1, float("-inf")), (4, float("-inf")), (1, -65536.0)])
def test_decode_attention_does_not_read_positions_no_row_keeps(split_kv, masked_bias):
    """A static cache past each sequence's length: NaN there (never written) must not reach the output, as
    it would if the kernel read those positions (a probability of 0 times NaN is NaN). With a finite fill a
    row that keeps none of a chunk attends to all of it, so its program reads the chunk (and with a split
    cache, a chunk past every sequence is such a chunk: one chunk here)."""
    from helion_backend.kernels.attention import decode_attention_helion

    kv_len, lengths = 200, torch.tensor([70, 131])
    q = torch.randn(2, 2, 3, 16)
    k, v = torch.randn(2, 2, kv_len, 16), torch.randn(2, 2, kv_len, 16)
    keep = (torch.arange(kv_len) < lengths[:, None]).view(2, 1, 1, kv_len).expand(2, 2, 3, kv_len).clone()
    for t in (k, v):  # what no row keeps holds NaN
        t[0, :, 70:] = float("nan")
        t[1, :, 131:] = float("nan")
    # Row 1 of (batch 1, head 0) keeps nothing: with a finite fill its program reads that head's whole cache,
    # which therefore holds numbers.
    keep[1, 0, 1] = False
    k[1, 0, 131:], v[1, 0, 131:] = torch.randn(kv_len - 131, 16), torch.randn(kv_len - 131, 16)
    config = helion.Config(block_sizes=[32, 64, 16], split_kv=split_kv, num_warps=4, num_stages=1)
    out = decode_attention_helion(q, k, v, keep, config=config, masked_bias=masked_bias)
    clean_k, clean_v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    mask = torch.where(keep, 0.0, masked_bias).double()
    ref = F.scaled_dot_product_attention(q.double(), clean_k.double(), clean_v.double(), attn_mask=mask)
    if masked_bias == float("-inf"):  # PyTorch's safe softmax: a row with nothing to attend to is zeros
        ref[1, 0, 1] = 0.0
    assert not out.isnan().any()
    # A fully masked row's fp32 logits near the fill keep 2^-7 of absolute precision, as in the graph.
    assert rel_err(out, ref) <= (ATTENTION_TOLERANCE[torch.float32] if masked_bias == float("-inf") else 1e-2)

@pytest.mark.slow

def test_decode_attention_combine_tiles_the_head_dimension():
    """Nine chunks of 4 rows of D = 128 overflow one combine program's tile: D is split (two programs per
    row block), and every column is still merged."""
    from helion_backend.kernels.attention import (
        COMBINE_TILE_ELEMENTS,
        combine_config,
        decode_attention_helion,
    )

    config = combine_config(9, 4, 128)
    block_r, block_d = config["block_sizes"]
    assert (block_r, block_d) == (4, 64) and 9 * block_r * block_d <= COMBINE_TILE_ELEMENTS
    q, k, v = torch.randn(1, 2, 4, 128), torch.randn(1, 2, 1100, 128), torch.randn(1, 2, 1100, 128)
    keep = torch.rand(1, 1, 4, 1100) < 0.8
    attention_config = helion.Config(block_sizes=[64, 64, 16], split_kv=16, num_warps=4, num_stages=1)
    out = decode_attention_helion(q, k, v, keep, config=attention_config)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep)
    assert rel_err(out, ref) <= ATTENTION_TOLERANCE[torch.float32]


@pytest.mark.parametrize("batch_heads, kv_len, split", [(8, 1024, 16), (64, 1024, 8), (256, 1024, 2), (8, 100, 2)])
def test_decode_attention_default_config_fills_the_gpu(batch_heads, kv_len, split):
    """About 512 programs (four an SM of an H200), never chunks shorter than 64 positions."""
    from helion_backend.kernels.attention import default_config

    assert default_config(batch_heads, 4, kv_len)["split_kv"] == split


# --------------------------------------------------------------------------------------------------
# The code cache (helion_backend/code_cache.py): a later process loads the generated code instead of binding.

CACHE_CASE = (4, 64, 48, torch.float32, "nk", ("bias", "relu"))  # m, k, n, dtype, layout, steps


@pytest.fixture
def code_cache_dir(tmp_path, monkeypatch):
    """An empty code cache and a fresh process for the test; the process's own cache again afterwards."""
    from helion_backend import code_cache
    from helion_backend.options import BackendOptions

    new_process(monkeypatch)
    code_cache.configure(BackendOptions(cache_dir=str(tmp_path)))
    yield tmp_path / "kernels"
    code_cache.configure(BackendOptions())


def new_process(monkeypatch) -> None:
    """What a new process starts from: no compiled kernel in memory, no bound kernel, no imported module."""
    from torch._inductor.codecache import PyCodeCache

    monkeypatch.setattr(gemm, "_COMPILED", {})
    monkeypatch.setattr(PyCodeCache, "modules_no_attr", {})
    gemm.gemm_kernel.reset()
    gemm.epilogue_kernel.reset()


def recorded_binds(monkeypatch) -> list[str]:
    """The names of the kernels bound from now on (Helion traces a kernel when it binds it)."""
    binds, bind = [], helion.Kernel.bind

    def recording(self, args):
        binds.append(self.name)
        return bind(self, args)

    monkeypatch.setattr(helion.Kernel, "bind", recording)
    return binds


def test_a_new_process_runs_the_stored_code_without_binding(code_cache_dir, monkeypatch):
    """Split-K stores both kernels; a new process, where binding fails, loads them and computes the right
    result on fresh inputs."""
    steps = ("bias", "silu", "residual")
    run(5, 300, 40, torch.float32, "nk", steps, 2)
    assert sorted(p.name.split("-")[0] for p in code_cache_dir.iterdir()) == ["epilogue_kernel", "gemm_kernel"]
    new_process(monkeypatch)

    def no_bind(self, args):
        raise AssertionError(f"{self.name} was bound")

    monkeypatch.setattr(helion.Kernel, "bind", no_bind)
    out, ref = run(5, 300, 40, torch.float32, "nk", steps, 2)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]


def test_another_signature_or_config_misses(code_cache_dir, monkeypatch):
    m, k, n, dtype, layout, steps = CACHE_CASE
    run(*CACHE_CASE, 1)
    new_process(monkeypatch)
    binds = recorded_binds(monkeypatch)
    run(*CACHE_CASE, 1)
    assert binds == []
    run(m + 1, k, n, dtype, layout, steps, 1)  # shape
    run(m, k, n, dtype, "kn", steps, 1)  # strides
    run(m, k, n, dtype, layout, ("bias", "sigmoid"), 1)  # epilogue
    run(*CACHE_CASE, 1, config=helion.Config(block_sizes=[16, 16, 32], num_warps=4, num_stages=1, split_k=1))
    assert binds == ["gemm_kernel"] * 4
    assert len(list(code_cache_dir.iterdir())) == 5


def test_the_key_covers_the_sources_versions_device_and_settings(code_cache_dir):
    import triton

    from helion_backend import code_cache
    from helion_backend.environment import package_digest

    x = torch.randn(2, 8)
    key = code_cache.entry(gemm.gemm_kernel, ("gemm_kernel", "signature"), (x,)).key
    for part in (package_digest(), code_cache._helion_digest(), triton.__version__, torch.__version__,
                 "('device', ('cpu',))", "('dot_precision', \"'ieee'\")"):
        assert part in key
    assert "autotune_random_seed" not in key  # autotuning's settings differ between processes


def _damage(text: str, how: str) -> str:
    entry = json.loads(text)
    if how == "truncated":
        return text[: len(text) // 2]
    if how == "edited_source":  # the checksum no longer matches: never run code that is not what was stored
        entry["source"] = entry["source"].replace("maximum", "minimum")
    elif how == "unloadable_source":
        entry["source"] = "def gemm_kernel(:\n"
        entry["sha256"] = hashlib.sha256(entry["source"].encode()).hexdigest()
    elif how == "other_key":
        entry["key"] += " "
    return json.dumps(entry)


@pytest.mark.parametrize("how", slow_except({"edited_source"},
                                         ["truncated", "edited_source", "unloadable_source", "other_key"]))
def test_a_damaged_entry_warns_binds_and_is_replaced(code_cache_dir, monkeypatch, caplog, how):
    run(*CACHE_CASE, 1)
    (path,) = code_cache_dir.iterdir()
    path.write_text(_damage(path.read_text(), how))
    new_process(monkeypatch)
    binds = recorded_binds(monkeypatch)
    with caplog.at_level("WARNING", logger="helion_backend.code_cache"):
        out, ref = run(*CACHE_CASE, 1)
    assert rel_err(out, ref) <= TOLERANCE[torch.float32]
    assert binds == ["gemm_kernel"] and f"ignoring the kernel code cache entry {path}" in caplog.text
    new_process(monkeypatch)
    run(*CACHE_CASE, 1)
    assert binds == ["gemm_kernel"]  # the fresh entry replaced the damaged one


def test_the_code_cache_can_be_turned_off(code_cache_dir, monkeypatch):
    from helion_backend import code_cache
    from helion_backend.options import BackendOptions

    run(*CACHE_CASE, 1)
    code_cache.configure(BackendOptions(cache_dir=str(code_cache_dir.parent), code_cache=False))
    new_process(monkeypatch)
    binds = recorded_binds(monkeypatch)
    run(*CACHE_CASE, 1)
    m, k, n, dtype, layout, steps = CACHE_CASE
    run(m + 1, k, n, dtype, layout, steps, 1)
    assert binds == ["gemm_kernel"] * 2 and len(list(code_cache_dir.iterdir())) == 1


# Quantized siblings on rows quantized before the kernel (the default compile): q/k/v in one launch, gate/up
# in one kernel. int8 here (the interpreter loads fp8 wrongly; test_gpu_quant.py runs fp8), no split-K.
def _int8_rows(m: int, k: int):
    xq, scale = int8_per_token(torch.randn(m, k))
    return xq, scale


def _int8_weight(k: int, n: int):
    return torch.randint(-128, 128, (n, k), dtype=torch.int8).t(), torch.rand(n) * 0.01 + 0.001


@pytest.mark.parametrize("outputs", [2, 3])
def test_quantized_multi_gemm_kernel_rescales_each_output(outputs):
    from helion_backend.kernels.multi_gemm import multi_gemm_helion
    from helion_backend.runtime.dispatch import flatten_operands
    from helion_backend.semantics.reference import unfused_multi

    m, k, widths = 5, 300, [72, 40, 24][:outputs]
    xq, scale = _int8_rows(m, k)
    weights = [_int8_weight(k, n) for n in widths]
    steps = [("cast", "token_scale", "channel_scale", "relu"), ("cast", "token_scale", "channel_scale"),
             ("cast", "token_scale", "channel_scale", "bias")][:outputs]
    operands = []
    for s, n, (_, w_scale) in zip(steps, widths, weights):
        operands += flatten_operands([scale, w_scale, *([torch.randn(n)] if "bias" in s else [])], s, n)
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1)
    w_kns = [w for w, _ in weights]
    outs = multi_gemm_helion(xq, w_kns, steps, operands, [], torch.float32, config, kernel_family="gemm_multi_int8")
    refs = unfused_multi(xq, w_kns, steps, operands, [], torch.float32)
    for out, ref in zip(outs, refs):
        assert rel_err(out, ref.double()) <= 1e-5


def test_quantized_gated_kernel_rescales_both_projections():
    """``silu(rescale(xq @ wq_gate)) * rescale_up(xq @ wq_up)``: each accumulator by its own channel scale."""
    from helion_backend.kernels.gemm import glu_gemm_helion
    from helion_backend.runtime.dispatch import flatten_operands
    from helion_backend.semantics.reference import reference

    m, k, n = 5, 300, 72
    xq, scale = _int8_rows(m, k)
    (w_gate, s_gate), (w_up, s_up) = _int8_weight(k, n), _int8_weight(k, n)
    steps, up_steps = ("cast", "token_scale", "channel_scale", "silu", "up_mul"), ("cast", "token_scale", "channel_scale")
    operands = [*flatten_operands([scale, s_gate], steps, n), *flatten_operands([scale, s_up], up_steps, n)]
    config = helion.Config(block_sizes=BLOCKS, num_warps=4, num_stages=1)
    out = glu_gemm_helion(xq, w_gate, w_up, steps, operands, [], torch.float32, config=config, up_steps=up_steps,
                          kernel_family="gemm_glu_int8")
    ref = reference(xq, w_gate, steps, operands, [], torch.float32, None, w_up, up_steps)
    gate = xq.double() @ w_gate.double() * scale.double() * s_gate.double()
    up = xq.double() @ w_up.double() * scale.double() * s_up.double()
    assert rel_err(ref, F.silu(gate) * up) <= 1e-5  # the reference applies each projection's own scales
    assert rel_err(out, ref.double()) <= 1e-5


def test_quantized_sibling_kernels_refuse_mismatched_operands():
    from helion_backend.kernels.gemm import glu_gemm_helion
    from helion_backend.kernels.multi_gemm import multi_gemm_helion

    xq, _ = _int8_rows(4, 64)
    w, _ = _int8_weight(64, 32)
    with pytest.raises(ValueError, match="multiplies torch.int8 rows by torch.int8 weights"):
        multi_gemm_helion(xq.float(), [w, w], [(), ()], [], [], torch.float32, kernel_family="gemm_multi_int8")
    with pytest.raises(ValueError, match="unknown shared-launch family"):
        multi_gemm_helion(xq, [w, w], [(), ()], [], [], torch.float32, kernel_family="gemm_glu_int8")
    with pytest.raises(ValueError, match=r"read 1 tensor operand\(s\) and 0 scalar\(s\), got 0 and 0"):
        glu_gemm_helion(xq, w, w, ("silu", "up_mul"), [], [], torch.float32, up_steps=("channel_scale",),
                        kernel_family="gemm_glu_int8")


@pytest.mark.parametrize("m, k, n, dtype", diagonal(
    Spread([(1, 64, 7), (14, 64, 1), (5, 3, 6), (3, 2, 1)]), [torch.float32, torch.bfloat16]))
def test_tiny_and_size_one_dimensions_match_float64(m, k, n, dtype):
    out, ref = run(m, k, n, dtype, "kn", ("scale",), split_k=1)
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("m, n", [(32, 7), (1, 1)])
def test_a_k_of_one_is_refused(m, n):
    """Helion tiles a static K of one as a full K block of copies of its column (the product times the
    block size, as a rotary embedding's ``inv_freq @ position_ids`` came out on the GPU): refused, so the
    fused op falls back instead of returning it."""
    with pytest.raises(ValueError, match="K=1"):
        run(m, 1, n, torch.float32, "kn", (), split_k=1)
