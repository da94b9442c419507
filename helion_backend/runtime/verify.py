"""The self-check of fused sites (option ``verify``): which sites are watched, the tolerance, the comparison.

A watched site's first Helion run at each M also runs its unfused reference on the same inputs
(:mod:`.dispatch` does both); the two outputs are compared by their relative error,
``||fused - reference|| / ||reference||`` (the worst output of a shared launch), at a tolerance set by the
least precise dtype the site reads or writes. A site over it is treated as a site whose kernel failed: it runs
its reference from then on. This module holds no tensors between calls and imports neither Helion nor
:mod:`.dispatch`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

# The largest relative error a correct kernel shows against its reference, per dtype. Both accumulate in fp32
# and round once, so they differ by accumulation order and by one rounding of the output (bf16: 8 mantissa
# bits, fp16: 11); a few times that, well under what a wrong kernel gives.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,  # full-precision fp32 dots; TF32 (10 mantissa bits) gives ~5e-4
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
# float32 where the user allowed TF32 dots (torch.set_float32_matmul_precision("high"), or allow_tf32):
# cuBLAS may then use them, and either side may differ from full precision by ~5e-4.
TF32_TOLERANCE = 5e-3
# Quantized operands (int8, fp8, int4 bytes): a kernel may round a value across a quantization step that the
# reference does not; such flips are rare and each moves its product by one step.
QUANTIZED_TOLERANCE = 3e-2

_lock = threading.Lock()
_watched: set[str] = set()  # site ids (report.site_id) whose first run at each M is checked
_checked: list[Check] = []  # every check made, in the order made
_done: set[tuple[str, int]] = set()  # (site, M) of those checks


@dataclass(frozen=True)
class Check:
    """One comparison of a site's fused output with its reference, at ``m`` rows."""

    site: str
    m: int
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def describe(self) -> str:
        if self.ok:
            return f"M={self.m}: ok (rel. error {self.error:.2e} <= tolerance {self.tolerance:.1e})"
        return f"M={self.m}: diverged (rel. error {self.error:.2e} > tolerance {self.tolerance:.1e})"


def watch(sites: Iterable[str]) -> None:
    """Check these sites (their ops' ``site`` names) on their first run at each M."""
    with _lock:
        _watched.update(sites)


def watching() -> bool:
    """Whether any site is watched: the one test the fused ops make per call when the option is off."""
    return bool(_watched)


def pending(site: str, m: int) -> bool:
    """Whether ``site`` is watched and has not been checked at ``m`` rows yet."""
    with _lock:
        return site in _watched and (site, m) not in _done


def checks() -> list[Check]:
    """Every check made in this process, oldest first."""
    with _lock:
        return list(_checked)


def reset() -> None:
    """Forget the watched sites and the checks made (tests)."""
    with _lock:
        _watched.clear()
        _checked.clear()
        _done.clear()


def tolerance(dtypes: Iterable[torch.dtype]) -> float:
    """The tolerance of a site that reads and writes ``dtypes``: that of the least precise of them."""
    return max(_tolerance(dtype) for dtype in dtypes)


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return TF32_TOLERANCE
    if dtype in TOLERANCE:
        return TOLERANCE[dtype]
    return QUANTIZED_TOLERANCE  # int8, uint8 (packed int4), the fp8 formats


def relative_error(fused: torch.Tensor, reference: torch.Tensor) -> float:
    """``||fused - reference|| / ||reference||`` in float64 over the finite entries of the reference; inf where
    the two disagree on a non-finite entry (a NaN or an infinity only one of them has, or of another sign)."""
    fused, reference = fused.double(), reference.double()
    nan, infinite = torch.isnan(reference), torch.isinf(reference)
    if not torch.equal(torch.isnan(fused), nan) or not torch.equal(fused[infinite], reference[infinite]):
        return math.inf
    finite = ~(nan | infinite)
    difference = (fused[finite] - reference[finite]).norm().item()
    if difference == 0.0:
        return 0.0
    if not math.isfinite(difference):  # the reference is finite there, the fused output is not
        return math.inf
    return difference / max(reference[finite].norm().item(), torch.finfo(torch.float32).tiny)


def compare(site: str, m: int, fused: Sequence[torch.Tensor], reference: Sequence[torch.Tensor],
            dtypes: Iterable[torch.dtype]) -> Check:
    """Compare a site's outputs (one, or each of a shared launch) with its reference's, and remember it."""
    error = max(relative_error(f, r) for f, r in zip(fused, reference, strict=True))
    check = Check(site=site, m=m, error=error, tolerance=tolerance(dtypes))
    with _lock:
        _checked.append(check)
        _done.add((site, m))
    return check
