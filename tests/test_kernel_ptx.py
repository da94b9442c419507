"""What Triton makes of the GEMV kernel, the swapped one-byte GEMM and the int4 GEMM for Hopper (sm_90),
compiled on the CPU: no GPU is needed to read their PTX, and the PTX shows what the interpreter cannot, where
the GEMV's K loop waits, which tensor-core instruction the GEMM runs and how int4 dequantizes.

The generated code comes from Helion under the interpreter (as in ``test_kernel_interpret.py``); the
compile runs in a child process without ``TRITON_INTERPRET``, which patches ``triton.language`` process-wide.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("helion")

import helion  # noqa: E402

from helion_backend.kernels.gemm import gemv_kernel, gemv_kernel_args, tile_epilogue  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CPU-only run with TRITON_INTERPRET=1 set before Triton is imported",
)

# Compiles each generated module's kernel for sm_90 and prints, per module, the PTX instruction counts. A
# module's entry gives its pointer types, its constexpr arguments' values and its stages.
COMPILE = r"""
import collections, importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
counts = {}
for path, kernel in json.loads(sys.argv[1]).items():
    spec = importlib.util.spec_from_file_location("generated", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (fn,) = [getattr(module, name) for name in dir(module) if name.startswith("_helion_")]
    names = list(fn.arg_names)
    constants = kernel["constants"]
    signature = {name: "constexpr" if name in constants else kernel["pointers"].get(name, "i32") for name in names}
    # The launcher specializes pointers aligned to 16 bytes; without it no load is vectorized.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if signature[name].startswith("*")}
    constexprs = {(i,): constants[name] for i, name in enumerate(names) if name in constants}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": kernel["num_stages"]})
    lines = compiled.asm["ptx"].splitlines()
    # The K loop: from its header label to the branch back to it (none where LLVM unrolled it fully).
    header = next((i for i, line in enumerate(lines) if "Loop Header" in line), None)
    if header is not None:
        label = lines[header].split(":")[0]
        back = next(i for i in range(header + 1, len(lines))
                    if "bra" in lines[i] and lines[i].rstrip(";").endswith(label))
    # Each instruction's opcode (inline asm puts several on a line), past its guard (``@%p1 ld.global.b16``).
    instructions = lambda part: (i.split() for line in part for i in line.split(";") if i.split())
    opcodes = lambda part: collections.Counter(words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
                                               for words in instructions(part))
    counts[path] = {"all": opcodes(lines), "loop": None if header is None else opcodes(lines[header + 1:back])}
print(json.dumps(counts))
"""
PTX_TYPES = {torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv", torch.int8: "*i8"}
M, N, K, BLOCK_K = 1, 256, 4096, 512  # eight K steps
DTYPES = [(dtype, dtype) for dtype in PTX_TYPES]  # rows and weights alike (the fp8 and int8 ones quantized)


def _random(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randint(-100, 100, shape, dtype=dtype) if dtype == torch.int8 else torch.randn(*shape).to(dtype)


def _ptx_counts(kernels: dict[str, dict]) -> dict[str, dict]:
    """``COMPILE``'s opcode counts of each module in ``kernels`` (path -> pointers, constants, stages), from
    one child process."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(kernels)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def gemv_ptx(tmp_path_factory) -> dict[tuple[str, str], dict[str, int]]:
    """The PTX opcode counts of the GEMV at one row, for bf16, fp8 and int8 rows and weights, at [16, 4, 512]
    blocks, whole and in the K loop: one child process compiles all three."""
    folder = tmp_path_factory.mktemp("gemv_ptx")
    config = helion.Config(block_sizes=[16, 4, BLOCK_K], num_warps=4, num_stages=1, indexing="pointer")
    kernels = {}
    for x_dtype, w_dtype in DTYPES:
        out = torch.empty(M, N, dtype=torch.bfloat16)
        args = gemv_kernel_args(_random(x_dtype, M, K), _random(w_dtype, N, K).t(), out, [], [], tile_epilogue(()))
        path = folder / f"{x_dtype}_{w_dtype}.py".replace("torch.", "")
        path.write_text(gemv_kernel.bind(args).to_triton_code(config))
        pointers = {"x_rows": PTX_TYPES[x_dtype], "w_nk": PTX_TYPES[w_dtype], "out": "*bf16"}
        kernels[str(path)] = {"pointers": pointers, "constants": {}, "num_stages": 1}
    counts = _ptx_counts(kernels)
    return {(str(x), str(w)): counts[str(folder / f"{x}_{w}.py".replace("torch.", ""))] for x, w in DTYPES}


def _k_steps(counts: dict[str, dict[str, int] | None]) -> list[dict[str, int]]:
    """The opcode counts of each K step: the loop body, or, where LLVM unrolled the loop, the whole kernel
    spread over its K / BLOCK_K steps (rounded up, so a count after the loop reads as at most one a step)."""
    if counts["loop"] is not None:
        return [counts["loop"]]
    steps = K // BLOCK_K
    return [{op: -(-n // steps) for op, n in counts["all"].items()}]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8], ids=str)
def test_the_gemv_k_loop_takes_no_barrier(gemv_ptx, dtype):
    """Rows and weights of one dtype: x is read through its stride-0 [M, N, K] view in the weight tile's
    layout, so no K step converts a tile through shared memory. Broadcasting an [M, K] x tile took four
    barriers and a shared-memory round trip every step (bf16, fp8, int8 alike)."""
    counts = gemv_ptx[str(dtype), str(dtype)]
    (step,) = _k_steps(counts)
    allowed = 0 if counts["loop"] is not None else 1  # unrolled: the store's one conversion, after the loop
    shared = {op: n for op, n in step.items() if op.startswith(("bar.sync", "st.shared", "stmatrix", "ldmatrix"))}
    assert all(n <= allowed for n in shared.values()), shared
    assert step.get("ld.global.v4.b32", 0) >= 2, step  # x and w by 16-byte loads


def test_the_int8_gemv_multiplies_in_int32(gemv_ptx):
    """int8 x int8 products are integer multiply-adds, exact, with no int-to-float conversion per element."""
    counts = gemv_ptx[str(torch.int8), str(torch.int8)]["all"]
    products = counts.get("mad.lo.s32", 0) + counts.get("mul.lo.s32", 0)  # the first step's multiply
    assert products >= 4 * K // 128, counts  # 4 x 512 products a step over 128 threads
    assert not any(op.startswith("cvt.rn.f32.s") for op in counts), counts
    assert counts.get("fma.rn.f32", 0) == 0, counts


@pytest.mark.parametrize("dtype, mma", [pytest.param(torch.float8_e4m3fn, "f32.e4m3.e4m3", marks=pytest.mark.slow),
                                        pytest.param(torch.int8, "s32.s8.s8", marks=pytest.mark.slow)], ids=str)
def test_the_swapped_gemm_puts_the_weight_on_wgmmas_64_rows(dtype, mma, tmp_path):
    """``swap_ab`` at 8 rows, 16 x 64 x 256 blocks: wgmma's 64-row side holds 64 weight rows and its N side
    the 16-row block of tokens (``m64n16``), in the one-byte type, with no conversion of the inputs; the plain
    dot needs a 64-row block of x for Hopper's wgmma."""
    from helion_backend.kernels.quant_gemm import swapped_lowp_gemm_kernel

    rows, n, k, stages = 8, 1024, 4096, 4
    config = helion.Config(block_sizes=[16, 64, 256], num_warps=4, num_stages=stages, split_k=1, indexing="pointer")
    out = torch.empty(1, rows, n, dtype=torch.bfloat16)
    args = (_random(dtype, rows, k), _random(dtype, n, k), out, [], [], tile_epilogue(()))
    bound = swapped_lowp_gemm_kernel.bind(args)
    path = tmp_path / "swapped.py"
    path.write_text(bound.to_triton_code(config))
    # The split's K extent is the kernel's one constexpr argument (one split: all of K).
    pointers = {"x": PTX_TYPES[dtype], "w_nk": PTX_TYPES[dtype], "out": "*bf16"}
    (split,) = [name for name in _kernel_arguments(path) if name.startswith("_BLOCK_SIZE")]
    counts = _ptx_counts({str(path): {"pointers": pointers, "constants": {split: k}, "num_stages": stages}})
    ops = counts[str(path)]["all"]
    assert any(op.startswith(f"wgmma.mma_async.sync.aligned.m64n16k32.{mma}") for op in ops), ops
    assert not any(op.startswith(("cvt.rn.f16x2.e4m3x2", "cvt.rn.f32.s8", "ldmatrix")) for op in ops), ops


def _kernel_arguments(path: Path) -> list[str]:
    """The argument names of the generated module's Triton kernel."""
    header = re.search(r"def _helion_\w+\(([^)]*)\)", path.read_text()).group(1)
    return [argument.split(":")[0].strip() for argument in header.split(",")]


@pytest.mark.parametrize("block_k, zero_points", [(64, False), (128, False), (64, True),
                                                   pytest.param(128, True, marks=pytest.mark.slow)])
def test_the_int4_k_loop_dequantizes_by_bit_operations(block_k, zero_points, tmp_path):
    """``int4_gemm_kernel`` with the PTX dequantization the wrapper picks on CUDA for bf16 (8 rows, 16 x 64 x
    ``block_k`` bytes, pairs split in registers): each K step makes its bf16 weights with prmt, lop3 and
    packed bf16x2 FMAs, two values an instruction, and no integer-to-float conversion or scalar bf16
    arithmetic. Where the K block lies in one group (64 bytes, groups of 128, ``group_steps``) the step
    loads its scales once; gathered per byte they took one 2-byte load per byte a thread. With zero points
    (one [N, K/G, 2] tensor of scales and zero points) a byte takes one more FMA and its group's zero point;
    without, the zero points the kernel is passed (the scales again) are never loaded."""
    import helion.language as hl

    from helion_backend.kernels.int4_nibbles import int4_nibbles_bf16_ptx, int4_zero_point_nibbles_bf16_ptx
    from helion_backend.kernels.quant_gemm import _steps_within_groups, int4_gemm_kernel

    rows, n, k, group, stages = 8, 1024, 4096, 128, 3
    config = helion.Config(block_sizes=[16, 64, block_k], num_warps=4, num_stages=stages, split_k=1,
                           indexing="pointer")
    group_steps = _steps_within_groups(config, group // 2)
    assert group_steps == (block_k == 64)
    x = torch.randn(rows, k).to(torch.bfloat16)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    if zero_points:
        params = torch.randn(n, k // group, 2).to(torch.bfloat16)
        scales, zeros = params[:, :, 0], params[:, :, 1]
    else:
        scales = zeros = torch.randn(n, k // group).to(torch.bfloat16)
    nibbles = int4_zero_point_nibbles_bf16_ptx if zero_points else int4_nibbles_bf16_ptx
    out = torch.empty(1, rows, n, dtype=torch.bfloat16)
    args = (x.reshape(rows, k // 2, 2), packed.t(), scales.t(), zeros.t(), out, [], [], hl.constexpr(True),
            hl.constexpr(group_steps), nibbles, tile_epilogue(()))
    path = tmp_path / "int4.py"
    path.write_text(int4_gemm_kernel.bind(args).to_triton_code(config))
    # The split's K extent (all of K) and the pairs' width are the kernel's constexpr arguments.
    constants = {name: k // 2 if name.startswith("_BLOCK_SIZE") else 2
                 for name in _kernel_arguments(path) if name.startswith(("_BLOCK_SIZE", "_RDIM_SIZE"))}
    pointers = {"x_pairs": "*bf16", "packed": "*u8", "scales": "*bf16", "zeros": "*bf16", "out": "*bf16"}
    counts = _ptx_counts({str(path): {"pointers": pointers, "constants": constants, "num_stages": stages}})
    (step,) = _k_steps(counts[str(path)])
    bytes_a_thread = 64 * block_k // 128  # a [block_k, 64] tile of bytes over 128 threads
    fmas_a_byte = 3 if zero_points else 2  # (zero point,) scale
    assert step.get("fma.rn.bf16x2", 0) == fmas_a_byte * bytes_a_thread, step
    assert step.get("lop3.b32", 0) == bytes_a_thread, step  # two values' mantissas set at once
    assert not any(op.startswith(("cvt.rn.bf16", "cvt.rn.f32.u", "sub.bf16", "mul.bf16")) for op in step), step
    tensors_a_group = 2 if zero_points else 1  # scales (and zero points)
    group_loads = step.get("ld.global.b16", 0)
    assert group_loads <= 2 * tensors_a_group if group_steps else group_loads == tensors_a_group * bytes_a_thread, step
