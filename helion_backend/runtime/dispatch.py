"""Run-time choice of the implementation behind the fused op, by device and num_tokens (M)."""

from __future__ import annotations

import gc
import logging
import math
import traceback
from typing import Callable, Sequence, TypeVar

import torch

from helion_backend import report
from helion_backend.cuda_graphs import stream_capturing
from helion_backend.environment import helion_unavailable_reason
from helion_backend.runtime import verify
from helion_backend.semantics.epilogue import operand_kinds, split_per_output
from helion_backend.semantics.gemm_spec import SCALED_WEIGHT_STEPS, GemmSpec
from helion_backend.semantics.norm import RmsNormSpec
from helion_backend.semantics.reference import unfused, unfused_multi
from helion_backend.vocabulary import RMSNORM, Operand, dtype_name

log = logging.getLogger(__name__)
T = TypeVar("T")

# (site, M) -> why its Helion kernel failed, or why its output is not trusted (option verify); those calls
# run the reference from then on.
_FAILED: dict[tuple[str, int], str] = {}


def run_gemm_epilogue(
    spec: GemmSpec,
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    operands: Sequence[torch.Tensor],
    norm_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``gemm_epilogue`` op: the ``spec.kernel`` family's Helion kernel for rows up to
    ``spec.max_helion_m`` on CUDA, else (and after it failed for this site and M) the reference."""
    steps, up_steps, program, site = spec.epilogue, spec.up_epilogue, spec.quant_program, spec.site
    if (spec.up_layout is None) != (up_weight is None):
        raise ValueError(f"site {site}: an up_weight goes with the spec's up_layout, got "
                         f"{'an' if up_weight is not None else 'no'} up_weight and up_layout {spec.up_layout!r}")
    _check_weight_scale(spec.prologue, weight_scale)
    norm = _norm(spec, norm_weight)
    w_kn = weight_kn(weight, spec.weight_layouts[0])
    up_kn = weight_kn(up_weight, spec.up_layout) if up_weight is not None else None
    n = w_kn.shape[1]
    scalars = list(spec.scalars)
    # The epilogue's operands, then the up projection's own (its scales on quantized rows).
    (ops, _), (up_ops, _) = split_per_output((steps, up_steps), operands, scalars)
    flat = [*flatten_operands(ops, steps, n), *flatten_operands(up_ops, up_steps, n)]

    def reference() -> torch.Tensor:
        return unfused(x, w_kn, steps, flat, scalars, spec.out_dtype, program, up_kn, weight_scale, norm, up_steps)

    if _runs_helion(x, spec.max_helion_m, site):
        fused = _try_helion(site, x.shape[0], lambda: _helion_gemm(
            spec.kernel, x, w_kn, steps, flat, scalars, spec.out_dtype, spec.config_dir or None, program, up_kn,
            weight_scale=weight_scale, norm=norm, up_steps=up_steps, frozen_weights=spec.frozen_weights))
        if fused is not None:
            if verify.watching():
                dtypes = [x.dtype, w_kn.dtype, spec.out_dtype, *([up_kn.dtype] if up_kn is not None else [])]
                fused = _verified(site, x.shape[0], fused, reference, dtypes, _launch_text(spec.kernel, x, [n]),
                                  spec.max_helion_m)
            return fused
    return reference()


def run_multi_gemm_epilogue(
    spec: GemmSpec,
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    operands: Sequence[torch.Tensor],
    norm_weight: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The ``multi_gemm_epilogue`` op: one Helion launch for every output, or the reference of each."""
    steps, scalars, site = spec.epilogues, list(spec.scalars), spec.site
    if len(weights) != spec.outputs:
        raise ValueError(f"site {site}: {len(weights)} weights need as many layouts and epilogues, got "
                         f"{list(spec.weight_layouts)} and {[list(s) for s in steps]}")
    norm = _norm(spec, norm_weight)
    w_kns = [weight_kn(w, layout) for w, layout in zip(weights, spec.weight_layouts)]
    per_output = [(flatten_operands(ops, s, w.shape[1]), scs)
                  for w, s, (ops, scs) in zip(w_kns, steps, split_per_output(steps, operands, scalars))]
    flat = [op for ops, _ in per_output for op in ops]

    def reference() -> list[torch.Tensor]:
        return unfused_multi(x, w_kns, steps, flat, scalars, spec.out_dtype, norm)

    if _runs_helion(x, spec.max_helion_m, site):
        fused = _try_helion(site, x.shape[0], lambda: _helion_multi_gemm(
            x, w_kns, steps, flat, scalars, spec.out_dtype, config_dir=spec.config_dir or None, norm=norm,
            kernel_family=spec.kernel))
        if fused is not None:
            if verify.watching():
                dtypes = [x.dtype, *(w.dtype for w in w_kns), spec.out_dtype]
                launch = _launch_text(spec.kernel, x, [w.shape[1] for w in w_kns])
                fused = _verified(site, x.shape[0], fused, reference, dtypes, launch, spec.max_helion_m)
            return fused
    return reference()


def run_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         masked_bias: float, out_stride: Sequence[int], site: str = "") -> torch.Tensor:
    """The ``decode_attention`` op: the Helion decode kernel on CUDA, else (and after it failed here)
    PyTorch's ``scaled_dot_product_attention``; into a fresh tensor of strides ``out_stride``."""
    out = q.new_empty_strided(q.shape, out_stride)
    rows = q.shape[2]

    def reference() -> torch.Tensor:
        return _attention_reference(q, k, v, mask, scale, masked_bias)

    if _helion_runs_on(q) and (site, rows) not in _FAILED:
        def launch() -> torch.Tensor:
            return _helion_decode_attention(q, k, v, mask, scale, out=out, masked_bias=masked_bias)

        fused = _try_helion(site, rows, launch)
        if fused is not None:
            if verify.watching():
                shape = f"rows={rows} L={k.shape[2]} D={q.shape[3]} {dtype_name(q.dtype)}"
                trusted = _verified(site, rows, out, reference, [q.dtype], f"decode attention kernel ({shape})")
                if trusted is not out:
                    out.copy_(trusted)
            return out
    return out.copy_(reference())


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, masked_bias: float) -> torch.Tensor:
    """What the ``decode_attention`` op computes without Helion: PyTorch's attention, the graph's mask."""
    if mask is not None and mask.dtype == torch.bool and masked_bias != -math.inf:
        mask = torch.where(mask, 0.0, masked_bias).to(q.dtype)  # the bias the graph had made of it
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _runs_helion(x: torch.Tensor, max_helion_m: int, site: str) -> bool:
    """Whether this call's rows go to the Helion kernel (else to the reference)."""
    m = x.shape[0]
    return m <= max_helion_m and _helion_runs_on(x) and (site, m) not in _FAILED


def _helion_runs_on(x: torch.Tensor) -> bool:
    """Whether Helion kernels run on ``x``'s device: CUDA, with Helion installed."""
    return x.is_cuda and helion_unavailable_reason() is None


# The Helion kernels the fused ops launch, imported at their first call (Helion's import takes seconds); the
# CPU tests of the option verify replace them to make a site's fast path wrong.

def _helion_gemm(*args, **kwargs) -> torch.Tensor:
    from helion_backend.kernels import run_kernel

    return run_kernel(*args, **kwargs)


def _helion_multi_gemm(*args, **kwargs) -> list[torch.Tensor]:
    from helion_backend.kernels import multi_gemm_helion

    return multi_gemm_helion(*args, **kwargs)


def _helion_decode_attention(*args, **kwargs) -> torch.Tensor:
    from helion_backend.kernels.attention import decode_attention_helion

    return decode_attention_helion(*args, **kwargs)


def _verified(site: str, m: int, fused: T, reference: Callable[[], T], dtypes: Sequence[torch.dtype], launch: str,
              up_to_m: int | None = None) -> T:
    """``fused``, or ``reference()``'s result where the option ``verify`` checks this first Helion run of the
    site at ``m`` rows and finds it diverging; the site then runs its reference from now on, at every M up to
    ``up_to_m`` (None: at this M alone). Not checked: a (site, M) checked before, and a run being captured
    into a CUDA graph (its replays run no Python: the next uncaptured run checks). ``launch`` names the
    kernel and shape."""
    if not verify.pending(site, m) or stream_capturing():
        return fused
    expected = reference()
    check = verify.compare(site, m, _outputs(fused), _outputs(expected), dtypes)
    report.record_verified(site, check.describe())
    if check.ok:
        return fused
    _fall_back(site, m, f"output of the {launch} diverged from the reference: rel. error {check.error:.2e} > "
                        f"tolerance {check.tolerance:.1e} (option verify)", up_to_m)
    return expected


def _outputs(value: torch.Tensor | Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else value


def _launch_text(kernel: str, x: torch.Tensor, widths: Sequence[int]) -> str:
    """The kernel family and shape of a GEMM launch, for the self-check's warning."""
    n = "+".join(map(str, widths))
    return f"{kernel} kernel (M={x.shape[0]} K={x.shape[1]} N={n} {dtype_name(x.dtype)})"


def _try_helion(site: str, m: int, launch: Callable[[], T]) -> T | None:
    """``launch()``; None when the kernel cannot compile or launch (the model must not fail: the caller runs
    the reference, and this site does at this M from now on)."""
    try:
        return launch()
    except Exception as e:
        failure = _describe_failure(e)
        # The failed call's frames hold the output it had allocated, and a log record that keeps the
        # traceback (Helion's, or a test's log capture) would keep them alive: under CUDA graph trees
        # that output sits in the graph's memory pool, untracked. Drop their locals.
        _clear_frames(e)
    _fall_back(site, m, f"Helion kernel failed ({failure})")
    return None


def _check_weight_scale(prologue: tuple[str, ...], weight_scale: torch.Tensor | None) -> None:
    """``dequant_int4`` and ``dequant_fp8_block`` read their [N, ..] weight's scales (``weight_scale``); no
    other prologue has one."""
    scaled = any(step in SCALED_WEIGHT_STEPS for step in prologue)
    if scaled != (weight_scale is not None):
        raise ValueError(f"prologue {list(prologue)} with {'no' if scaled else 'a'} weight_scale")


def _norm(spec: GemmSpec, weight: torch.Tensor | None) -> tuple[torch.Tensor, RmsNormSpec] | None:
    """The fused RMSNorm's weight and spec; refuses a norm weight without the ``rmsnorm`` step and the
    other way round, since either would silently skip or misapply the normalization."""
    if (spec.norm is not None) != (weight is not None):
        raise ValueError(f"the {RMSNORM} prologue step needs norm_weight and norm_spec, and they need it "
                         f"(prologue {list(spec.prologue)}, norm_weight {'given' if weight is not None else 'None'}, "
                         f"norm spec {spec.norm})")
    return (weight, spec.norm) if spec.norm is not None else None


def _clear_frames(error: BaseException | None) -> None:
    """Clear the locals of every finished frame in ``error``'s traceback and in those it chains to."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _describe_failure(error: Exception) -> str:
    message = str(error).strip()
    return f"{type(error).__name__}: {message.splitlines()[0] if message else 'no message'}"[:300]


def _fall_back(site: str, m: int, reason: str, up_to_m: int | None = None) -> None:
    """Remember that ``site`` runs its reference at this M (at every M up to ``up_to_m`` if given), warn once,
    and note it in the site's report."""
    for rows in range(up_to_m + 1) if up_to_m is not None else (m,):
        _FAILED[(site, rows)] = reason
    scope = f"M={m}" if up_to_m is None else f"M={m}, and every M"
    log.warning("helion_inductor: site %s (%s) runs its reference (cuBLAS + an unfused epilogue, or PyTorch's "
                "attention) from now on: %s", site or "<unnamed>", scope, reason)
    report.record_fallback(site, f"{scope}: {reason}; ran the reference instead")
    gc.collect()  # whatever the failure left in reference cycles goes now, not at some later collection


def weight_kn(weight: torch.Tensor, weight_layout: str) -> torch.Tensor:
    """The weight as a logical [K, N] view; an [N, K] (nn.Linear) weight is transposed without a copy."""
    if weight_layout == "nk":
        return weight.t()
    if weight_layout == "kn":
        return weight
    raise ValueError(f"weight_layout must be 'kn' or 'nk', got {weight_layout!r}")


def flatten_operands(operands: Sequence[torch.Tensor], steps: Sequence[str], n: int) -> list[torch.Tensor]:
    """Each operand as an [N] vector or an [M, N] tensor, the two shapes kernels index (3-D linears
    arrive as [B, S, N]). Per-token columns and one-element tensors are broadcast as views, no copy."""
    kinds = operand_kinds(steps)
    if len(kinds) != len(operands):
        raise ValueError(f"epilogue {list(steps)} reads {len(kinds)} tensor operands, got {len(operands)}")
    return [_flatten(op, kind, n) for op, kind in zip(operands, kinds)]


def _flatten(operand: torch.Tensor, kind: Operand, n: int) -> torch.Tensor:
    if kind is Operand.ROW:
        return operand.reshape(n)
    if kind is Operand.ELEMENT:
        return operand.reshape(1).expand(n)
    if kind is Operand.COL:
        return operand.reshape(-1, 1).expand(-1, n)
    return operand.reshape(-1, n)
