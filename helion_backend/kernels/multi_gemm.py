"""GEMMs of one activation in one launch: ``out_i = epilogue_i(x @ w_i)`` for a decoder's q, k and v.

At decode sizes each projection is a few microseconds of weight streaming; three launches pay three
ramp-ups and tails, and the small k and v projections alone cannot fill the GPU. Helion runs
consecutive top-level tile loops of one kernel as one launch whose programs are split among the
loops, so :func:`multi_gemm_kernel` writes one loop per output and the grid covers every output's
tiles at once. Nothing is concatenated: each loop reads its own weight where it is, so the fusion
stays correct when the parameters change.

The kernel has one loop per slot (:data:`~helion_backend.vocabulary.MULTI_GEMM_SLOTS`); a group of two
passes an empty third weight, whose loop has no programs. Each output has its own epilogue (a callable
per slot, reading its operands at its own offset). An RMSNorm shared by the group (the decoder's input
norm) runs in every tile, as in ``rmsnorm_gemm_kernel``.
There is no split-K: the outputs' tiles together supply the parallelism it would.

The same source runs fp8 and int8 sites on rows quantized before the launch (Inductor's per-token
quantization, fused into the op producing the activation): every output multiplies the same quantized
rows by its own quantized weight (fp32 or int32 accumulator) and rescales in its own epilogue
(``token_scale``, ``channel_scale``, ...), so a decoder's fp8 q, k and v share one launch as the bf16
ones do (families ``gemm_multi_fp8`` and ``gemm_multi_int8``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .helion_import import helion  # isort: skip  (first: it defers scikit-learn)
import helion.language as hl
import torch

from helion_backend.kernels.configs import config_for
from helion_backend.kernels.family import family
from helion_backend.kernels.gemm import (
    Signature,
    TileEpilogue,
    check_family_steps,
    check_quantized_signature,
    check_signature,
    compiled_kernel,
    norm_kernel_args,
    tile_epilogue,
)

# Module attributes, not bare names, for the reason given in kernels/gemm.py.
from helion_backend.semantics import norm as norm_module
from helion_backend.semantics.epilogue import split_per_output
from helion_backend.semantics.norm import RmsNormSpec
from helion_backend.vocabulary import MEMBER_FAMILY, MULTI_GEMM_FAMILIES, MULTI_GEMM_FAMILY, MULTI_GEMM_SLOTS


# Each loop is written out, with its own variable names: Helion's loop-dependency check goes by name.
# One source, two kernels: float inputs with exact fp32 dots (dot_precision="ieee", as eager torch.mm),
# and fp8/int8 inputs with Triton's default (``lowp_multi_gemm_kernel``, below).
def multi_gemm_kernel(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weights: list[torch.Tensor],
    outs: list[torch.Tensor],
    operands: list[torch.Tensor],
    scalars: list[float],
    epilogue0: TileEpilogue,
    epilogue1: TileEpilogue,
    epilogue2: TileEpilogue,
) -> None:
    """``outs[i] = epilogue_i(x' @ weights[i])`` for every slot i in one launch, where x' is x, or with
    ``norm_weight`` its RMS-normalized rows (``eps``; computed as :mod:`helion_backend.semantics.norm` says).
    The epilogues read ``operands`` and ``scalars`` from their own offsets (:func:`.gemm.tile_epilogue`).
    Quantized x and weights (fp8, int8: rows quantized before the launch) accumulate in fp32 or int32; each
    epilogue gets the fp32 value (its token and channel scales are steps of its own)."""
    m, k = x.size()
    acc_dtype = torch.int32 if x.dtype == torch.int8 else torch.float32
    block_m = hl.register_block_size(m)
    block_n = hl.register_block_size(weights[0].size(1))
    block_k = hl.register_block_size(k)
    for tile_m, tile_n in hl.tile([m, weights[0].size(1)], block_size=[block_m, block_n]):
        acc = hl.zeros([tile_m, tile_n], dtype=acc_dtype)
        sums = hl.zeros([tile_m, 1], dtype=torch.float32)
        squares = hl.zeros([tile_m, block_k], dtype=torch.float32)
        if norm_weight is not None and m > norm_module.ONE_PASS_MAX_M:
            for tile_k in hl.tile(k, block_size=block_k):
                sums = sums + norm_module.squares(x[tile_m, tile_k]).sum(-1, keepdim=True)
        for tile_k in hl.tile(k, block_size=block_k):
            x_tile = x[tile_m, tile_k]
            if norm_weight is not None:
                if m <= norm_module.ONE_PASS_MAX_M:
                    squares = squares + norm_module.squares(x_tile)
                x_tile = norm_module.weighted_rows(x_tile, norm_weight[tile_k])
            acc = hl.dot(x_tile, weights[0][tile_k, tile_n], acc=acc)
        if norm_weight is not None:
            acc = norm_module.scale_rows(acc, sums + squares.sum(-1, keepdim=True), k, eps)
        outs[0][tile_m, tile_n] = epilogue0(acc.to(torch.float32), operands, scalars, tile_m, tile_n).to(outs[0].dtype)
    for tile_m1, tile_n1 in hl.tile([m, weights[1].size(1)], block_size=[block_m, block_n]):
        acc1 = hl.zeros([tile_m1, tile_n1], dtype=acc_dtype)
        sums1 = hl.zeros([tile_m1, 1], dtype=torch.float32)
        squares1 = hl.zeros([tile_m1, block_k], dtype=torch.float32)
        if norm_weight is not None and m > norm_module.ONE_PASS_MAX_M:
            for tile_k1 in hl.tile(k, block_size=block_k):
                sums1 = sums1 + norm_module.squares(x[tile_m1, tile_k1]).sum(-1, keepdim=True)
        for tile_k1 in hl.tile(k, block_size=block_k):
            x_tile1 = x[tile_m1, tile_k1]
            if norm_weight is not None:
                if m <= norm_module.ONE_PASS_MAX_M:
                    squares1 = squares1 + norm_module.squares(x_tile1)
                x_tile1 = norm_module.weighted_rows(x_tile1, norm_weight[tile_k1])
            acc1 = hl.dot(x_tile1, weights[1][tile_k1, tile_n1], acc=acc1)
        if norm_weight is not None:
            acc1 = norm_module.scale_rows(acc1, sums1 + squares1.sum(-1, keepdim=True), k, eps)
        outs[1][tile_m1, tile_n1] = epilogue1(acc1.to(torch.float32), operands, scalars, tile_m1, tile_n1).to(outs[1].dtype)
    for tile_m2, tile_n2 in hl.tile([m, weights[2].size(1)], block_size=[block_m, block_n]):
        acc2 = hl.zeros([tile_m2, tile_n2], dtype=acc_dtype)
        sums2 = hl.zeros([tile_m2, 1], dtype=torch.float32)
        squares2 = hl.zeros([tile_m2, block_k], dtype=torch.float32)
        if norm_weight is not None and m > norm_module.ONE_PASS_MAX_M:
            for tile_k2 in hl.tile(k, block_size=block_k):
                sums2 = sums2 + norm_module.squares(x[tile_m2, tile_k2]).sum(-1, keepdim=True)
        for tile_k2 in hl.tile(k, block_size=block_k):
            x_tile2 = x[tile_m2, tile_k2]
            if norm_weight is not None:
                if m <= norm_module.ONE_PASS_MAX_M:
                    squares2 = squares2 + norm_module.squares(x_tile2)
                x_tile2 = norm_module.weighted_rows(x_tile2, norm_weight[tile_k2])
            acc2 = hl.dot(x_tile2, weights[2][tile_k2, tile_n2], acc=acc2)
        if norm_weight is not None:
            acc2 = norm_module.scale_rows(acc2, sums2 + squares2.sum(-1, keepdim=True), k, eps)
        outs[2][tile_m2, tile_n2] = epilogue2(acc2.to(torch.float32), operands, scalars, tile_m2, tile_n2).to(outs[2].dtype)


lowp_multi_gemm_kernel = helion.kernel(static_shapes=True, autotune_effort="none")(multi_gemm_kernel)
multi_gemm_kernel = helion.kernel(static_shapes=True, autotune_effort="none", dot_precision="ieee")(multi_gemm_kernel)


@functools.cache  # on every launch
def multi_kernel_config(config: helion.Config) -> helion.Config:
    """A GEMM config for :func:`multi_gemm_kernel`: its block sizes, warps, stages, and an indexing mode
    given for every load (a per-load list is sized for another kernel's loads); no split-K."""
    kept = {key: config[key] for key in ("block_sizes", "num_warps", "num_stages") if key in config}
    if isinstance(config.get("indexing"), str):
        kept["indexing"] = config["indexing"]
    return helion.Config(**kept)


def multi_gemm_helion(
    x: torch.Tensor,
    w_kns: Sequence[torch.Tensor],
    steps: Sequence[Sequence[str]],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    config: helion.Config | None = None,
    config_dir: str | None = None,
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None,
    kernel_family: str = MULTI_GEMM_FAMILY,
) -> list[torch.Tensor]:
    """``[epilogue_i(x @ w_kns[i])]`` as contiguous [M, N_i] ``out_dtype`` tensors, from one launch.

    ``steps[i]`` is output i's epilogue; ``operands`` and ``scalars`` hold every output's in turn
    (each flattened as :func:`helion_backend.runtime.dispatch.flatten_operands` does). ``config`` defaults to
    the tables' entry for ``kernel_family`` at N = sum of the N_i (a quantized family without one: the
    member family's there, see :mod:`.configs`). With ``norm`` (an RMSNorm's weight and spec) x's rows are
    normalized first, as in ``gemm_epilogue_helion``. ``kernel_family`` ``gemm_multi_fp8`` or
    ``gemm_multi_int8`` multiplies quantized rows by quantized weights (each output's scales are its
    epilogue's ``token_scale`` and ``channel_scale``).
    """
    if not 2 <= len(w_kns) <= MULTI_GEMM_SLOTS or len(steps) != len(w_kns):
        raise ValueError(f"expected 2 to {MULTI_GEMM_SLOTS} weights with one epilogue each, got {len(w_kns)} and "
                         f"{len(steps)}")
    if kernel_family not in MULTI_GEMM_FAMILIES.values():
        raise ValueError(f"unknown shared-launch family {kernel_family!r}; valid: {list(MULTI_GEMM_FAMILIES.values())}")
    steps = tuple(tuple(s) for s in steps)
    operands, scalars = list(operands), [float(s) for s in scalars]
    per_output = split_per_output(steps, operands, scalars)
    sigs = tuple(Signature.of(x, w, ops, scs, s, out_dtype, norm) for w, s, (ops, scs) in zip(w_kns, steps, per_output))
    quantized = family(kernel_family).multiplies_quantized_rows
    for sig in sigs:
        check_quantized_signature(sig, kernel_family) if quantized else check_signature(sig)
        check_family_steps(sig.steps, MEMBER_FAMILY[kernel_family])
    (m, k), widths = x.shape, [w.shape[1] for w in w_kns]
    if config is None:
        config = config_for(m, k, sum(widths), x.dtype, x.device, config_dir, kernel_family)
    outs = [torch.empty((m, n), dtype=out_dtype, device=x.device) for n in widths]
    empty = MULTI_GEMM_SLOTS - len(w_kns)  # slots without a weight: [K, 0], so their loops have no programs
    weights = [*w_kns, *(x.new_empty((k, 0)) for _ in range(empty))]
    targets = [*outs, *(x.new_empty((m, 0), dtype=out_dtype) for _ in range(empty))]
    norm_weight, eps = norm_kernel_args(norm)
    args = (x, norm_weight, eps, weights, targets, operands, scalars, *_epilogues(steps))
    kernel = lowp_multi_gemm_kernel if quantized else multi_gemm_kernel
    compiled_kernel(kernel, args, sigs, multi_kernel_config(config), 1)(*args)
    return outs


def _epilogues(steps: tuple[tuple[str, ...], ...]) -> list[TileEpilogue]:
    """One device-side epilogue per slot, each reading its operands and scalars after the earlier outputs'
    (an empty slot's has no steps)."""
    padded = (*steps, *((),) * (MULTI_GEMM_SLOTS - len(steps)))
    return [tile_epilogue(s, sum(padded[:i], ())) for i, s in enumerate(padded)]
