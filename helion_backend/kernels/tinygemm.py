"""tinygemm (``aten._weight_int4pack_mm``, PyTorch's int4 weight-only GEMM) as a form of the int4 family.

At a few rows tinygemm streams some int4 weights faster than the Helion kernels (``benchmarks/NOTES.md``), so
the int4 wrapper runs it where a config table measured it faster: the config key ``tinygemm`` (ours), then the
site's epilogue in one Helion pass over its bf16 product. The weight is tiled for it from the layer's own
bytes and scales on first use, and kept beside them:

- A prepared form belongs to the storage that holds the bytes (whatever view or alias of them a compiled graph
  passes), through a weak reference, and lives as long as it does: CUDA graphs recorded with it read its
  memory at every replay, so it is never replaced while the bytes live. Other bytes or scales (another view
  of the storage, new tensors) get a form of their own. An in-place change of the bytes or scales is not
  seen: that is what the option ``frozen_weights`` promises. (Version counters cannot tell: the alias a
  compiled graph passes at its first call has a counter of its own, and later ones share the buffer's.)
- It is never made inside a CUDA-graph capture (the conversion would be captured and replayed). The caller
  runs its Helion form for such a call instead.
- It is made on a thread of its own. Inductor's CUDA-graph trees route every allocation of the thread that
  warms a graph up into the graph's private pool, and memory the trees do not track there is overwritten by
  the next recording; PyTorch's pool routing is per thread, so the weight kept beside the layer is allocated
  outside every pool.

tinygemm dequantizes ``(q - 8) * scale + zero`` per group: zero 0 for the fixed zero point 8, and
``(8 - z) * scale`` for a zero point z (rounded to bf16, the only difference from the layer's values).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import weakref
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# tinygemm's K tiling (torchao's default): K must be a multiple of 16 * INNER_K_TILES.
INNER_K_TILES = 8
GROUP_SIZES = (32, 64, 128, 256)
_N_TILE = 8  # tinygemm tiles N by 8: a partial tile would widen the output
# Forms kept per storage of int4 bytes (weights sliced from one buffer each get one): a bound on the memory
# where the scales are new tensors at every call.
MAX_FORMS_PER_STORAGE = 8


def tinygemm_problem(x_dtype: torch.dtype, k: int, n: int, group_size: int) -> str | None:
    """Why tinygemm cannot multiply these operands (a requirement to print), or None."""
    if x_dtype != torch.bfloat16:
        return f"tinygemm multiplies bf16 rows, not {x_dtype}"
    if k % (16 * INNER_K_TILES):
        return f"tinygemm needs K a multiple of {16 * INNER_K_TILES}, got K={k}"
    if n % _N_TILE:
        return f"tinygemm needs N a multiple of {_N_TILE}, got N={n}"
    if group_size not in GROUP_SIZES:
        return f"tinygemm's group sizes are {GROUP_SIZES}, got {group_size}"
    return None


def tinygemm_operands(packed_nk: torch.Tensor, group_params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 weight of ``packed_nk`` ([N, K/2] bytes, column 2j in byte j's low nibble) and ``group_params``
    ([N, K/G] scales, or [N, K/G, 2] scales and zero points) in tinygemm's form: the tiled int32 weight of
    ``_weight_int4pack_mm`` (``_weight_int4pack_mm_for_cpu`` off CUDA) and the bf16 [K/G, N, 2] scales and
    zeros."""
    n, k = packed_nk.shape[0], 2 * packed_nk.shape[1]
    q = torch.stack([packed_nk & 15, packed_nk >> 4], dim=-1).reshape(n, k)
    if group_params.dim() == 3:
        scale, zero_point = group_params[:, :, 0].float(), group_params[:, :, 1].float()
        zero = (8 - zero_point) * scale
    else:
        scale = group_params.float()
        zero = torch.zeros_like(scale)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    if packed_nk.is_cuda:  # the CUDA packing reads the even column from the high nibble
        high_first = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8)
        tiled = torch.ops.aten._convert_weight_to_int4pack(high_first, INNER_K_TILES)
    else:
        tiled = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), INNER_K_TILES)
    return tiled, scales_and_zeros


def tinygemm_mm(x: torch.Tensor, tiled: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in bf16 for the weight that :func:`tinygemm_operands` prepared; x is [M, K] bf16."""
    group_size = x.shape[1] // scales_and_zeros.shape[0]
    mm = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    return mm(x.contiguous(), tiled, group_size, scales_and_zeros)


@dataclasses.dataclass
class _Prepared:
    owner: weakref.ref  # the storage holding the bytes
    forms: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]]  # by what each was made from (_source)
    full: bool = False  # MAX_FORMS_PER_STORAGE reached (and said once)


# id(storage) -> its prepared forms; an entry leaves when its storage is freed.
_PREPARED: dict[int, _Prepared] = {}
_PREPARER: concurrent.futures.ThreadPoolExecutor | None = None


def prepared_operands(packed_nk: torch.Tensor,
                      group_params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`tinygemm_operands` of these tensors, made once and kept (see the module docstring); None during
    a CUDA-graph capture that finds none made, or past :data:`MAX_FORMS_PER_STORAGE`."""
    owner = packed_nk.untyped_storage()  # one Python object per storage, whichever tensor shows it
    source = _source(packed_nk, group_params)
    entry = _PREPARED.get(id(owner))
    if entry is not None and entry.owner() is owner and source in entry.forms:
        return entry.forms[source]
    if packed_nk.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if entry is None or entry.owner() is not owner:
        entry = _PREPARED[id(owner)] = _Prepared(weakref.ref(owner, _forget_owner(id(owner))), {})
    if len(entry.forms) >= MAX_FORMS_PER_STORAGE:
        if not entry.full:
            entry.full = True
            log.warning("helion_inductor: no more tinygemm copies of the int4 weight [%s] kept: its bytes or "
                        "scales came from %d places already (scales computed anew each call?); a Helion kernel "
                        "runs", ", ".join(map(str, packed_nk.shape)), len(entry.forms))
        return None
    form = entry.forms[source] = _outside_graph_pools(packed_nk, group_params)
    return form


def _forget_owner(key: int) -> Callable[[weakref.ref], None]:
    """The weak reference's callback: drop the entry of the collected owner (not a later tensor's at its id)."""

    def forget(dead: weakref.ref) -> None:
        entry = _PREPARED.get(key)
        if entry is not None and entry.owner is dead:
            del _PREPARED[key]

    return forget


def forget_prepared() -> None:
    """Drop every prepared form (tests). A CUDA graph recorded with one must not replay after this."""
    _PREPARED.clear()


def _source(packed_nk: torch.Tensor, group_params: torch.Tensor) -> tuple[object, ...]:
    """What a prepared form stands for: where both tensors' elements are, and their shapes and strides."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in (packed_nk, group_params))


def _outside_graph_pools(packed_nk: torch.Tensor, group_params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tinygemm_operands` on a thread of its own (CUDA), ordered after the caller's stream's work."""
    if not packed_nk.is_cuda:
        return tinygemm_operands(packed_nk, group_params)
    global _PREPARER
    if _PREPARER is None:
        _PREPARER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="helion-tinygemm")
    device, caller = packed_nk.device, torch.cuda.current_stream(packed_nk.device)

    def convert() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(caller)
            with torch.cuda.stream(stream):
                operands = tinygemm_operands(packed_nk, group_params)
            stream.synchronize()
        for tensor in operands:  # read on the caller's stream from now on: freed only after its work
            tensor.record_stream(caller)
        return operands

    return _PREPARER.submit(convert).result()
