"""``epilogue(x @ w)`` as one Helion GEMM whose fp32 accumulator goes through the shared epilogue in registers.

One kernel source serves every epilogue: the steps reach device code inside a callable argument, which
Helion keys by its code object plus its closure (a tuple of step names, keyed by value). Tensor operands
and scalars are list arguments: Helion passes each element as its own kernel argument, so scalars are
runtime values (no recompilation per value) and the number of operands is not capped.

Split-K is the ``split_k`` tunable. The GEMM kernel writes ``out[split, m, n]``: with ``split_k == 1``
``out`` is the result seen as [1, M, N], and the kernel applies the epilogue and stores it once. With
``split_k > 1`` each K split stores its fp32 partial sum in its own slice of a workspace (no zero fill, no
atomics, so three launches become two), and :func:`epilogue_kernel` sums the slices and applies the
epilogue (not linear, so never to partial sums).

At a few rows the config key ``gemv`` runs :func:`gemv_kernel` instead: no tensor-core dot, no split-K, N tiles
down to one column (what Inductor's tuned reduction does with a one-row ``mm`` under max-autotune).

Nothing here autotunes: every call runs an explicit config (given, or from :mod:`.configs`), compiled once
per argument layout, epilogue and config.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import NamedTuple

from .helion_import import helion  # isort: skip  (first: it defers scikit-learn)
import helion.language as hl
import torch
from helion.autotuner import PowerOfTwoFragment

from helion_backend import code_cache
from helion_backend.kernels.configs import EPILOGUE_CONFIG, GEMV, PREQUANTIZE, config_for, split_key
from helion_backend.kernels.family import family

# Device code reaches ``apply_epilogue`` as an attribute of this module object, never as a bare name:
# Helion replaces the globals of any function it traces by name with fakes, and the step table that
# ``apply_epilogue`` reads holds Enum members it cannot fake. A module attribute is taken as is, so the
# epilogue runs with its real globals (and its float constants become literals in the kernel).
from helion_backend.semantics import epilogue as epilogue_module
from helion_backend.semantics import norm as norm_module
from helion_backend.semantics.epilogue import num_scalars, operand_kinds, split_per_output
from helion_backend.semantics.norm import RmsNormSpec
from helion_backend.vocabulary import (
    DEFAULT_KERNEL_FAMILY,
    EPILOGUE_STEPS,
    GLU_FAMILY,
    KERNEL_FAMILIES,
    MEMBER_FAMILY,
    RULE_DTYPES,
    Operand,
)

SUPPORTED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# (acc, operands, scalars, tile_m, tile_n) -> the epilogue applied to the fp32 accumulator tile.
TileEpilogue = Callable[..., torch.Tensor]


# autotune_effort="none": even a bare call (no config bound) runs a default config instead of tuning.
# dot_precision="ieee": fp32 inputs get exact fp32 dots, as eager torch.mm does by default (no TF32).
@helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")
def gemm_kernel(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: TileEpilogue,
) -> None:
    """``out[0] = epilogue(x @ w)`` when ``split_k == 1``; else ``out[s] = x @ w`` over K split ``s``."""
    m, k = x.size()
    n = w.size(1)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    # Written out here, not called from num_k_splits(): Helion takes a block size only from an inline expression.
    k_per_split = helion.cdiv(helion.cdiv(k, split_k), 256) * 256
    for tile_m, tile_n, tile_split in hl.tile([m, n, k], block_size=[None, None, k_per_split]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        for tile_k in hl.tile(tile_split.begin, tile_split.end):
            acc = torch.addmm(acc, x[tile_m, tile_k], w[tile_k, tile_n])
        # Triton specializes an int argument equal to 1 as a constant, so with split_k == 1 the branch
        # is resolved at compile time; the tile id is then 0.
        if split_k == 1:
            acc = epilogue(acc, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = acc.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")
def rmsnorm_gemm_kernel(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: TileEpilogue,
) -> None:
    """:func:`gemm_kernel` on RMS-normalized rows of x (see :mod:`helion_backend.semantics.norm`): the dot reads x
    times the norm's weight and the accumulator is scaled by each row's rstd at the end. The rows' sums
    of squares come from a first pass over x, or, for a few rows, from the K loop; then a K split adds
    the squares of the rest of K in two more loops (empty without split-K). One K block size serves every
    loop, registered first, so its config is ``gemm_kernel``'s with the block sizes rotated
    (:func:`norm_kernel_config`)."""
    m, k = x.size()
    n = w.size(1)
    block_k = hl.register_block_size(k)
    split_k = hl.register_tunable("split_k", PowerOfTwoFragment(1, 64, 1))
    k_per_split = helion.cdiv(helion.cdiv(k, split_k), 256) * 256
    for tile_m, tile_n, tile_split in hl.tile([m, n, k], block_size=[None, None, k_per_split]):
        acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
        sum_of_squares = hl.zeros([tile_m, 1], dtype=torch.float32)
        squares = hl.zeros([tile_m, block_k], dtype=torch.float32)
        if m > norm_module.ONE_PASS_MAX_M:
            for tile_k in hl.tile(k, block_size=block_k):
                sum_of_squares = sum_of_squares + norm_module.squares(x[tile_m, tile_k]).sum(-1, keepdim=True)
        for tile_k in hl.tile(tile_split.begin, tile_split.end, block_size=block_k):
            x_tile = x[tile_m, tile_k]
            if m <= norm_module.ONE_PASS_MAX_M:
                squares = squares + norm_module.squares(x_tile)
            acc = torch.addmm(acc, norm_module.weighted_rows(x_tile, norm_weight[tile_k]), w[tile_k, tile_n])
        if m <= norm_module.ONE_PASS_MAX_M:
            for tile_k in hl.tile(0, tile_split.begin, block_size=block_k):
                squares = squares + norm_module.squares(x[tile_m, tile_k])
            for tile_k in hl.tile(tile_split.end, k, block_size=block_k):
                squares = squares + norm_module.squares(x[tile_m, tile_k])
        acc = norm_module.scale_rows(acc, sum_of_squares + squares.sum(-1, keepdim=True), k, eps)
        if split_k == 1:
            acc = epilogue(acc, operands, scalars, tile_m, tile_n)
        out[tile_split.id, tile_m, tile_n] = acc.to(out.dtype)


@helion.kernel(static_shapes=True, autotune_effort="none")
def gemv_kernel(
    x_rows: torch.Tensor,
    norm_rows: torch.Tensor | None,
    eps: float,
    w_nk: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: TileEpilogue,
) -> None:
    """``out = epilogue(x @ w_nk.T)`` without a tensor-core dot, for decode's one row (the config key
    :data:`.configs.GEMV` selects it): each K step multiplies an x tile by a [N block, K block] weight tile
    elementwise into a 3-D accumulator, and K is summed once, after the loop. A dot pads one row to 16 and
    needs N tiles of 16 or more; here N tiles go down to one column, so even a narrow weight spreads over
    every SM without split-K, and no step waits on a cross-thread reduction. The weight is read as [N, K]
    (an nn.Linear weight as it is), so its loads run along contiguous K.

    ``x_rows`` is x seen as [M, N, K], stride 0 along N (:func:`gemv_helion` makes the view), so that each
    thread loads the x values it multiplies, in the weight tile's layout. Broadcasting an [M, K] tile
    instead takes a layout conversion through shared memory, with barriers, in every K step (the PTX of
    that form). fp8 and float products are taken in fp32; int8 x int8 ones in int32, exactly, as the
    tensor cores would (an int-to-float conversion per element is what int8 would otherwise wait on).
    With ``norm_rows`` (the RMSNorm's weight as [N, K], stride 0 along N) x's rows are RMS-normalized,
    their squares summed in the same K loop, which covers all of K. Block sizes in ``gemm_kernel``'s
    order, [M, N, K]; no split-K."""
    m, n, k = x_rows.size()
    acc_dtype = torch.int32 if x_rows.dtype == torch.int8 and w_nk.dtype == torch.int8 else torch.float32
    block_m, block_n, block_k = hl.register_block_size(m), hl.register_block_size(n), hl.register_block_size(k)
    for tile_m, tile_n in hl.tile([m, n], block_size=[block_m, block_n]):
        products = hl.zeros([tile_m, tile_n, block_k], dtype=acc_dtype)
        squares = hl.zeros([tile_m, tile_n, block_k], dtype=torch.float32)
        for tile_k in hl.tile(k, block_size=block_k):
            x_tile = x_rows[tile_m, tile_n, tile_k]
            if norm_rows is not None:
                squares = squares + norm_module.squares(x_tile)
                x_tile = norm_module.weighted_rows(x_tile, norm_rows[tile_n, tile_k][None, :, :])
            w_tile = w_nk[tile_n, tile_k].to(acc_dtype)
            products = products + x_tile.to(acc_dtype) * w_tile[None, :, :]
        acc = products.sum(-1).to(torch.float32)
        if norm_rows is not None:
            acc = norm_module.scale_rows(acc, squares.sum(-1), k, eps)
        out[tile_m, tile_n] = epilogue(acc, operands, scalars, tile_m, tile_n).to(out.dtype)


# One source, two kernels (as multi_gemm_kernel): float inputs with exact fp32 dots, and fp8/int8 inputs
# (``lowp_glu_gemm_kernel``, below) with Triton's default.
def glu_gemm_kernel(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    w: torch.Tensor,
    w_up: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: TileEpilogue,
    up_epilogue: TileEpilogue,
) -> None:
    """``out = epilogue(x @ w, up=up_epilogue(x @ w_up))``: a gated MLP's gate and up projections in one
    pass over x, both accumulators in registers, only the epilogue's result stored (no split-K: two
    workspaces would cost what the fusion saves). With ``norm_weight`` x's rows are RMS-normalized as in
    :func:`rmsnorm_gemm_kernel`; Helion specializes a None argument, so without it the norm's ops vanish
    at compile time. Quantized x and weights (fp8, int8) accumulate in fp32 or int32, and ``up_epilogue``
    rescales the up projection by its own scales (float inputs: no steps). The block sizes are registered
    in ``gemm_kernel``'s order, [M, N, K]."""
    m, k = x.size()
    n = w.size(1)
    acc_dtype = torch.int32 if x.dtype == torch.int8 else torch.float32
    block_m, block_n, block_k = hl.register_block_size(m), hl.register_block_size(n), hl.register_block_size(k)
    for tile_m, tile_n in hl.tile([m, n], block_size=[block_m, block_n]):
        acc = hl.zeros([tile_m, tile_n], dtype=acc_dtype)
        acc_up = hl.zeros([tile_m, tile_n], dtype=acc_dtype)
        # The norm's statistics, as in rmsnorm_gemm_kernel (written out: Helion traces a called function's
        # ops, not its loops).
        sum_of_squares = hl.zeros([tile_m, 1], dtype=torch.float32)
        squares = hl.zeros([tile_m, block_k], dtype=torch.float32)
        if norm_weight is not None and m > norm_module.ONE_PASS_MAX_M:
            for tile_k in hl.tile(k, block_size=block_k):
                sum_of_squares = sum_of_squares + norm_module.squares(x[tile_m, tile_k]).sum(-1, keepdim=True)
        for tile_k in hl.tile(k, block_size=block_k):
            x_tile = x[tile_m, tile_k]
            if norm_weight is not None:
                if m <= norm_module.ONE_PASS_MAX_M:
                    squares = squares + norm_module.squares(x_tile)
                x_tile = norm_module.weighted_rows(x_tile, norm_weight[tile_k])
            acc = hl.dot(x_tile, w[tile_k, tile_n], acc=acc)
            acc_up = hl.dot(x_tile, w_up[tile_k, tile_n], acc=acc_up)
        gate, up = acc.to(torch.float32), acc_up.to(torch.float32)
        if norm_weight is not None:
            sum_of_squares = sum_of_squares + squares.sum(-1, keepdim=True)
            gate = norm_module.scale_rows(gate, sum_of_squares, k, eps)
            up = norm_module.scale_rows(up, sum_of_squares, k, eps)
        up = up_epilogue(up, operands, scalars, tile_m, tile_n)
        out[tile_m, tile_n] = epilogue(gate, operands, scalars, tile_m, tile_n, up).to(out.dtype)


lowp_glu_gemm_kernel = helion.kernel(static_shapes=True, autotune_effort="none")(glu_gemm_kernel)
glu_gemm_kernel = helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")(glu_gemm_kernel)


@helion.kernel(static_shapes=True, autotune_effort="none")
def epilogue_kernel(
    partial_sums: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: TileEpilogue,
) -> None:
    """``out = epilogue(partial_sums.sum(0))`` for the fp32 [splits, M, N] sums that split-K left (or one
    product of another GEMM, [1, M, N] in any float dtype, summed in fp32)."""
    m, n = out.size()
    for tile_m, tile_n in hl.tile([m, n]):
        acc = partial_sums[:, tile_m, tile_n].to(torch.float32).sum(0)
        out[tile_m, tile_n] = epilogue(acc, operands, scalars, tile_m, tile_n).to(out.dtype)


def num_k_splits(k: int, split_k: int) -> int:
    """How many K splits ``gemm_kernel`` runs: each spans whole runs of 256 (so that deep K blocks stay
    unmasked), so there may be fewer than ``split_k`` (K = 1280, split_k = 4: 512 + 512 + 256)."""
    return helion.cdiv(k, helion.cdiv(helion.cdiv(k, split_k), 256) * 256)


def split_k_target(out: torch.Tensor, k: int, split_k: int) -> torch.Tensor:
    """Where a GEMM kernel writes: ``out`` seen as [1, M, N], or with ``split_k > 1`` a fresh fp32
    workspace [splits, M, N] for the partial sums (every split writes its whole slice: no zero fill)."""
    if split_k == 1:
        return out.unsqueeze(0)
    m, n = out.shape
    return torch.empty((num_k_splits(k, split_k), m, n), dtype=torch.float32, device=out.device)


def finish_split_k(target: torch.Tensor, out: torch.Tensor, split_k: int, sig: Signature,
                   operands: list[torch.Tensor], scalars: list[float], epilogue: TileEpilogue) -> torch.Tensor:
    """``out``; after a split GEMM, first the sum of ``target``'s partial sums through the epilogue."""
    if split_k > 1:
        run_epilogue_pass(target, out, sig, operands, scalars, epilogue)
    return out


def run_epilogue_pass(partial_sums: torch.Tensor, out: torch.Tensor, sig: Signature, operands: list[torch.Tensor],
                      scalars: list[float], epilogue: TileEpilogue) -> None:
    """:func:`epilogue_kernel` over ``partial_sums`` ([splits, M, N], any float dtype) into ``out``."""
    args = (partial_sums, out, operands, scalars, epilogue)
    compiled_kernel(epilogue_kernel, args, (sig, partial_sums.dtype), EPILOGUE_CONFIG, partial_sums.shape[0])(*args)


def tile_epilogue(steps: tuple[str, ...], after: tuple[str, ...] = ()) -> TileEpilogue:
    """The device-side epilogue for ``steps``, reading its operands and scalars after those of the steps
    ``after`` (a launch of several outputs passes every output's in one list). Its closure holds only
    these step names, so Helion keys it by value (it would turn an int offset into a symbol)."""

    def epilogue(
        acc: torch.Tensor,
        operands: list[torch.Tensor],
        scalars: list[float],
        tile_m: hl.Tile,
        tile_n: hl.Tile,
        up: torch.Tensor | None = None,
    ) -> torch.Tensor:
        first_operand, first_scalar = len(epilogue_module.operand_kinds(after)), epilogue_module.num_scalars(after)

        def load_operand(i: int) -> torch.Tensor:
            operand = operands[first_operand + i]
            return operand[tile_n] if operand.ndim == 1 else operand[tile_m, tile_n]

        return epilogue_module.apply_epilogue(acc, steps, load_operand, scalars[first_scalar:], up)

    return epilogue


# Config keys that mean the same in a kernel with the RMSNorm's extra loop and loads as in the kernel the
# config was made for; the others (per-loop and per-load lists) are sized for that kernel's loops and are
# left to their defaults.
_NORM_CONFIG_KEYS = ("num_warps", "num_stages", "split_k", "pid_type", "l2_groupings")


def _norm_safe_keys(config: helion.Config) -> dict[str, object]:
    return {key: config[key] for key in _NORM_CONFIG_KEYS if key in config}


@functools.cache  # on every launch
def norm_kernel_config(config: helion.Config) -> helion.Config:
    """``gemm_kernel``'s config for :func:`rmsnorm_gemm_kernel`: the K block size comes first there."""
    block_m, block_n, block_k = config["block_sizes"]
    return helion.Config(block_sizes=[block_k, block_m, block_n], **_norm_safe_keys(config))


def gemm_config_of_norm_kernel(config: helion.Config) -> helion.Config:
    """A config of :func:`rmsnorm_gemm_kernel` in ``gemm_kernel``'s layout, as config tables store it: the
    inverse of :func:`norm_kernel_config` (which keeps only the keys that mean the same in both kernels)."""
    block_k, block_m, block_n = config["block_sizes"]
    return helion.Config(block_sizes=[block_m, block_n, block_k], **_norm_safe_keys(config))


class Layout(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        return cls(t.dtype, tuple(t.shape), t.stride(), t.device)


class Signature(NamedTuple):
    """What a call's compiled kernels depend on besides the config (Helion specializes on static shapes)."""

    x: Layout
    w: Layout
    operands: tuple[Layout, ...]
    num_scalars: int
    steps: tuple[str, ...]
    out_dtype: torch.dtype
    # A fused RMSNorm's weight (the kernels' norm does not depend on the spec's rounding).
    norm: Layout | None = None

    @classmethod
    def of(cls, x: torch.Tensor, w_kn: torch.Tensor, operands: list[torch.Tensor], scalars: list[float],
           steps: tuple[str, ...], out_dtype: torch.dtype,
           norm: tuple[torch.Tensor, RmsNormSpec] | None) -> Signature:
        return cls(Layout.of(x), Layout.of(w_kn), tuple(map(Layout.of, operands)), len(scalars), steps, out_dtype,
                   None if norm is None else Layout.of(norm[0]))


def check_gemm_shapes(x: Layout, w: Layout) -> None:
    """x [M, K] and w_kn [K, N], with K > 1: Helion 1.4 drops the mask of a tiled dimension whose static size
    is one, so a K of one would be read as a full K block of copies of its one column and summed (the result
    times the block size). The compile side never sends such a site (``passes.placement.MIN_KERNEL_K``)."""
    if len(x.shape) != 2 or len(w.shape) != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"expected x [M, K] and w_kn [K, N], got {x.shape} and {w.shape}")
    if x.shape[1] == 1:
        raise ValueError(f"K=1 (x {x.shape}, w_kn {w.shape}) is an outer product, not a GEMM: Helion's tiling of "
                         "a size-one K is wrong, so the kernels refuse it")


@functools.cache
def check_signature(sig: Signature) -> None:
    """Reject, once per signature, what the kernel would compute wrongly or fail on deep inside Helion."""
    check_gemm_shapes(sig.x, sig.w)
    if sig.x.dtype != sig.w.dtype or sig.x.dtype not in SUPPORTED_INPUT_DTYPES:
        raise ValueError(
            f"x and w_kn must share one of {SUPPORTED_INPUT_DTYPES}, got {sig.x.dtype}, {sig.w.dtype}"
        )
    if sig.norm is not None:
        check_norm_weight(sig.norm, sig.x)
    check_operands(sig)


def check_norm_weight(weight: Layout, x: Layout) -> None:
    """An RMSNorm weight is a float [K] vector on x's device (any stride: the kernel indexes it), and x's
    dtype one the kernels' norm cannot overflow in."""
    if x.dtype not in norm_module.FUSED_DTYPES:
        raise ValueError(f"the RMSNorm prologue runs on {norm_module.FUSED_DTYPES} rows, got {x.dtype} (x times "
                         "the norm's weight could overflow before the rows are scaled)")
    k = x.shape[1]
    if weight.shape != (k,) or not weight.dtype.is_floating_point or weight.device != x.device:
        raise ValueError(f"the RMSNorm weight must be a float [{k}] vector on {x.device}, got "
                         f"{weight.shape} {weight.dtype} on {weight.device}")


@functools.cache
def check_operands(sig: Signature) -> None:
    """The epilogue's steps, operands and scalars against what it reads (for every kernel family)."""
    unknown = [s for s in sig.steps if s not in EPILOGUE_STEPS]
    if unknown:
        raise ValueError(f"unknown epilogue step(s) {unknown}")
    kinds = operand_kinds(sig.steps)
    if len(sig.operands) != len(kinds) or sig.num_scalars != num_scalars(sig.steps):
        raise ValueError(
            f"epilogue {sig.steps} takes {len(kinds)} tensor operand(s) and {num_scalars(sig.steps)} "
            f"scalar(s), got {len(sig.operands)} and {sig.num_scalars}"
        )
    m, n = sig.x.shape[0], sig.w.shape[1]
    expected = {Operand.ROW: (n,), Operand.ELEMENT: (n,), Operand.COL: (m, n), Operand.FULL: (m, n)}
    for i, (kind, operand) in enumerate(zip(kinds, sig.operands)):
        if operand.shape != expected[kind]:
            raise ValueError(
                f"operand {i} ({kind.value}) must have shape {expected[kind]}, got {operand.shape}"
            )


@functools.cache  # on every launch
def check_family_steps(steps: tuple[str, ...], family: str) -> None:
    """Refuse a step that only another kernel family runs (``up_mul`` needs the gated kernel's second
    accumulator)."""
    foreign = [s for s in steps if EPILOGUE_STEPS[s].only_in and family not in EPILOGUE_STEPS[s].only_in]
    if foreign:
        raise ValueError(f"epilogue step {foreign[0]!r} runs only in the {', '.join(EPILOGUE_STEPS[foreign[0]].only_in)} "
                         f"kernels, not in {family}")


# (kernel name, signature, config, splits) -> compiled host function of the kernel.
_COMPILED: dict[Hashable, Callable[..., None]] = {}


class Launch(NamedTuple):
    """One kernel launch of a wrapper: the kernel, its arguments and the config it was compiled with."""

    kernel: helion.Kernel
    args: tuple[object, ...]
    config: helion.Config


_recorded: list[Launch] | None = None  # where record_launches() collects, while it is active


@contextlib.contextmanager
def record_launches() -> Iterator[list[Launch]]:
    """Collect the launches the wrappers make inside the block, so that the tuner autotunes exactly the kernel,
    arguments and config adaptation a compile runs (one thread at a time: a tool's, not the hot path's)."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer


def compiled_kernel(
    kernel: helion.Kernel, args: tuple[object, ...], sig: Hashable, config: helion.Config, splits: int
) -> Callable[..., None]:
    """Compile ``kernel`` for ``args`` under ``config`` once; later calls skip Helion's binding, and so
    do later processes where the code cache holds the kernel.

    ``compile_config`` compiles exactly the given config and never autotunes. ``splits`` (the number
    of workspace slices) is part of the key: the finishing pass runs one config for every split-K
    config, and a kernel compiled for two slices would sum only two of four.
    """
    if _recorded is not None:
        _recorded.append(Launch(kernel, args, config))
    key = (kernel.name, sig, config, splits)
    run = _COMPILED.get(key)
    if run is None:
        run = _COMPILED[key] = _load_or_compile(kernel, args, key, config)
    return run


def _load_or_compile(
    kernel: helion.Kernel, args: tuple[object, ...], key: Hashable, config: helion.Config
) -> Callable[..., None]:
    """The host function from the code cache (:mod:`helion_backend.code_cache`), else compiled by binding
    ``args`` and then stored for the next process."""
    entry = code_cache.entry(kernel, key, args)
    if entry is not None and (run := entry.load()) is not None:
        return run
    try:
        bound = kernel.bind(args)
        run = bound.compile_config(config)
    except Exception:
        # Drop the half-built bound kernel Helion cached for these arguments: it must not keep the
        # call's output alive (under CUDA graph trees that output sits in the graph's memory pool).
        kernel.reset()
        raise
    if entry is not None:
        entry.store(bound.get_cached_path(config))
    return run


def gemm_epilogue_helion(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    config: helion.Config | None = None,
    config_dir: str | None = None,
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None,
) -> torch.Tensor:
    """``epilogue(x @ w_kn)`` as a contiguous [M, N] ``out_dtype`` tensor, accumulated and finished in fp32.

    ``w_kn`` may be any strided [K, N] view (e.g. ``weight.t()`` of an nn.Linear weight); it is read in
    place. ``config`` defaults to :func:`.configs.config_for` (user tables in ``config_dir`` first); its
    ``split_k`` picks one or two passes. With ``norm`` (an RMSNorm's weight and spec) the rows of x are
    RMS-normalized as :mod:`helion_backend.semantics.norm` says before the multiply.
    """
    steps = tuple(steps)
    operands = list(operands)
    scalars = [float(s) for s in scalars]
    sig = Signature.of(x, w_kn, operands, scalars, steps, out_dtype, norm)
    check_signature(sig)
    check_family_steps(steps, DEFAULT_KERNEL_FAMILY)
    (m, k), n = x.shape, w_kn.shape[1]
    if config is None:
        config = config_for(m, k, n, x.dtype, x.device, config_dir)
    gemv, config = split_key(config, GEMV)
    epilogue = tile_epilogue(steps)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if gemv:
        return gemv_helion(x, w_kn, out, operands, scalars, epilogue, sig, config, norm)
    split_k = config.get("split_k", 1)
    gemm_args = gemm_kernel_args(x, w_kn, out, operands, scalars, epilogue, split_k)
    splits = gemm_args[2].shape[0]
    if norm is None:
        compiled_kernel(gemm_kernel, gemm_args, sig, config, splits)(*gemm_args)
    else:
        weight, eps = norm_kernel_args(norm)
        x, w_kn, workspace = gemm_args[:3]
        norm_args = (x, weight, eps, w_kn, workspace, operands, scalars, epilogue)
        compiled_kernel(rmsnorm_gemm_kernel, norm_args, sig, norm_kernel_config(config), splits)(*norm_args)
    return finish_split_k(gemm_args[2], out, split_k, sig, operands, scalars, epilogue)


def gemv_helion(x: torch.Tensor, w_kn: torch.Tensor, out: torch.Tensor, operands: list[torch.Tensor],
                scalars: list[float], epilogue: TileEpilogue, sig: Signature, config: helion.Config,
                norm: tuple[torch.Tensor, RmsNormSpec] | None = None) -> torch.Tensor:
    """``out`` from :func:`gemv_kernel` (config key ``gemv``, already taken out of ``config``), which reads
    the weight as [N, K] and x (and the norm's weight) through stride-0 views as wide as the weight. Any
    input dtypes: 16-bit, and fp8 or int8 rows and weights (quantized before the call), or a float x with an
    int8 weight; products in fp32, int8 x int8 ones in int32."""
    args = gemv_kernel_args(x, w_kn, out, operands, scalars, epilogue, norm)
    compiled_kernel(gemv_kernel, args, sig, gemv_kernel_config(config), 1)(*args)
    return out


def gemv_kernel_args(x: torch.Tensor, w_kn: torch.Tensor, out: torch.Tensor, operands: list[torch.Tensor],
                     scalars: list[float], epilogue: TileEpilogue,
                     norm: tuple[torch.Tensor, RmsNormSpec] | None = None) -> tuple[object, ...]:
    """:func:`gemv_kernel`'s arguments: x and the norm's weight as stride-0 views as wide as the weight."""
    (m, k), n = x.shape, w_kn.shape[1]
    weight, eps = norm_kernel_args(norm)
    norm_rows = None if weight is None else weight[None, :].expand(n, k)
    return x[:, None, :].expand(m, n, k), norm_rows, eps, w_kn.t(), out, operands, scalars, epilogue


@functools.cache  # on every launch
def gemv_kernel_config(config: helion.Config) -> helion.Config:
    """A GEMM config (``gemv`` taken out) as :func:`gemv_kernel` runs it: the same keys but split-K, which it
    has not (a split asked for is an error, not a silent single pass)."""
    if config.get("split_k", 1) != 1:
        raise ValueError(f"the GEMV form (config key {GEMV!r}) has no split-K, got split_k={config['split_k']}")
    return helion.Config(**{key: value for key, value in config.items() if key != "split_k"})


def gemm_kernel_args(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    out: torch.Tensor,
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue: TileEpilogue,
    split_k: int,
) -> tuple[object, ...]:
    """:func:`gemm_kernel`'s arguments at this split (its target: :func:`split_k_target`)."""
    return (x, w_kn, split_k_target(out, x.shape[1], split_k), operands, scalars, epilogue)


def norm_kernel_args(norm: tuple[torch.Tensor, RmsNormSpec] | None) -> tuple[torch.Tensor | None, float]:
    """``(norm_weight, eps)`` as the kernels with an RMSNorm prologue take them; without a norm, a None
    weight (which Helion specializes away) and an unused eps. The spec's rounding is the unfused graph's:
    the kernels' norm rounds x * weight instead (:mod:`helion_backend.semantics.norm`)."""
    if norm is None:
        return None, 0.0
    weight, spec = norm
    return weight, spec.eps


def glu_gemm_helion(
    x: torch.Tensor,
    w_kn: torch.Tensor,
    up_kn: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    config: helion.Config | None = None,
    config_dir: str | None = None,
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None,
    up_steps: tuple[str, ...] = (),
    kernel_family: str = GLU_FAMILY,
) -> torch.Tensor:
    """``epilogue(x @ w_kn)`` with the epilogue's ``up_mul`` multiplying by ``up_steps(x @ up_kn)``, as a
    contiguous [M, N] ``out_dtype`` tensor: one kernel, x read once for both projections. ``operands`` and
    ``scalars`` hold the epilogue's, then ``up_steps``' (the up projection's own rescaling on quantized rows:
    ``token_scale``, ``channel_scale``; float ones have none). ``config`` is in ``gemm_kernel``'s layout
    (:func:`glu_kernel_config` adapts it; a quantized family without a table entry takes its member
    family's). With ``norm`` (an RMSNorm's weight and spec) both projections multiply the rows of x
    RMS-normalized as :mod:`helion_backend.semantics.norm` says. ``kernel_family`` ``gemm_glu_fp8`` or
    ``gemm_glu_int8`` multiplies quantized rows by quantized weights."""
    steps, up_steps = tuple(steps), tuple(up_steps)
    operands, scalars = list(operands), [float(s) for s in scalars]
    (ops, scs), (up_ops, up_scs) = split_per_output((steps, up_steps), operands, scalars)
    sig = Signature.of(x, w_kn, ops, scs, steps, out_dtype, norm)
    up_sig = Signature.of(x, up_kn, up_ops, up_scs, up_steps, out_dtype, norm)
    quantized = family(kernel_family).multiplies_quantized_rows
    for s in (sig, up_sig):
        check_quantized_signature(s, kernel_family) if quantized else check_signature(s)
    check_family_steps(steps, kernel_family)
    check_family_steps(up_steps, MEMBER_FAMILY[kernel_family])
    if Layout.of(up_kn)[:2] != Layout.of(w_kn)[:2]:
        raise ValueError(f"the up projection {tuple(up_kn.shape)} {up_kn.dtype} must match the gate's "
                         f"{tuple(w_kn.shape)} {w_kn.dtype}")
    (m, k), n = x.shape, w_kn.shape[1]
    if config is None:
        config = config_for(m, k, n, x.dtype, x.device, config_dir, kernel_family)
    config = glu_kernel_config(config, x.dtype.itemsize, norm is not None)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    weight, eps = norm_kernel_args(norm)
    args = (x, weight, eps, w_kn, up_kn, out, operands, scalars, tile_epilogue(steps), tile_epilogue(up_steps, steps))
    kernel = lowp_glu_gemm_kernel if quantized else glu_gemm_kernel
    compiled_kernel(kernel, args, (sig, up_sig), config, 1)(*args)
    return out


@functools.cache
def check_quantized_signature(sig: Signature, family: str) -> None:
    """A quantized fused family's GEMM: x [M, K] and w_kn [K, N] both of the family's quantized dtype (rows
    quantized before the kernel), no norm, and the epilogue's operands as :func:`check_operands` wants."""
    check_gemm_shapes(sig.x, sig.w)
    (dtype,) = (RULE_DTYPES[name] for name in KERNEL_FAMILIES[MEMBER_FAMILY[family]].dtypes)
    if sig.x.dtype != dtype or sig.w.dtype != dtype:
        raise ValueError(f"the {family} kernel multiplies {dtype} rows by {dtype} weights, got {sig.x.dtype} and "
                         f"{sig.w.dtype}")
    if sig.norm is not None:
        raise ValueError(f"the {family} kernel takes no RMSNorm prologue")
    check_operands(sig)


@functools.cache  # on every launch
def glu_kernel_config(config: helion.Config, itemsize: int, normed: bool) -> helion.Config:
    """``gemm_kernel``'s config for :func:`glu_gemm_kernel`, whose block sizes come in the same order: fitted
    to two weight tiles, and with the norm only the keys that its extra loop and loads leave meaning the same."""
    config = _fit_two_weights(config, itemsize)
    return helion.Config(block_sizes=config["block_sizes"], **_norm_safe_keys(config)) if normed else config


# Shared memory a pipelined config may use for its tiles (the H100/H200 limit is 227 KB a block).
_SHARED_MEMORY_BUDGET = 160 * 1024


def _fit_two_weights(config: helion.Config, itemsize: int) -> helion.Config:
    """``config`` for the gated kernel: without a split-K factor (it has no such tunable) or ``prequantize``
    (ours, in the single fp8/int8 GEMM's configs that a quantized gated site falls back to), and the K
    block halved until the stages of x's tile and two weight tiles fit in shared memory (a config sized
    for one weight tile, such as the decode default, would not)."""
    config = helion.Config(**{key: value for key, value in config.items() if key not in ("split_k", PREQUANTIZE)})
    block_m, block_n, block_k = config["block_sizes"]
    stages = config.get("num_stages", 1)
    while block_k > 16 and stages * (block_m + 2 * block_n) * block_k * itemsize > _SHARED_MEMORY_BUDGET:
        block_k //= 2
    return helion.Config(**{**config, "block_sizes": [block_m, block_n, block_k]})
