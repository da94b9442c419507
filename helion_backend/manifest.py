"""The compile manifest: the GEMM sites compiles sent to Helion, read by ``python -m helion_backend tune``.

Every compile merges its Helion sites into ``BackendOptions.manifest_path`` (``<cache_dir>/manifest.json``),
one entry per (kernel, prologue, epilogue, dtype, K, N, widths) with every static M seen and, where M was
dynamic, the largest M the site runs on Helion. The tuner turns those into the keys worth tuning, so a deployment
tunes the shapes it serves rather than a benchmark's.

Writing never fails a compile: an unwritable cache folder or a corrupt manifest costs a warning, and
the file is replaced atomically, so a reader never sees half of it. Two processes merging at the same
instant may lose one's new sites until its next compile (there is no lock across processes).

The file::

    {"version": 1,
     "sites": [{"kernel": "gemm", "prologue": ["rmsnorm"], "epilogue": ["bias", "gelu_tanh"],
                "dtype": "bfloat16", "k": 4096, "n": 12288, "m": [1, 8], "max_helion_m": 32},
               {"kernel": "gemm_multi", "prologue": [], "epilogue": [], "dtype": "bfloat16",
                "k": 4096, "n": 6144, "widths": [4096, 1024, 1024], "m": [1], "max_helion_m": null}]}

``m`` lists the static token counts compiled; ``max_helion_m`` is null unless the site was also
compiled with a dynamic M, in which case it is the site's Helion limit (the largest M routed to Helion;
older manifests name it ``dynamic_m_limit``, which still reads).
``dtype`` is the GEMM's input dtype (float8_e4m3fn or int8 for a quantized GEMM). ``prologue`` lists the
fused prologue steps (the kernels specialize on an RMSNorm's); a shared launch (``gemm_multi``) records its
outputs' ``widths``, whose sum is ``n``, and its outputs' epilogues one after the other. Both fields came
after version 1 and are optional: a manifest without them reads as sites without a prologue or widths.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from helion_backend.jsonfile import write_json_atomic
from helion_backend.vocabulary import (
    EPILOGUE_STEPS,
    KERNEL_FAMILIES,
    MULTI_GEMM_FAMILIES,
    MULTI_GEMM_SLOTS,
    PROLOGUE_STEPS,
    RULE_DTYPES,
)

# The families a compile may send sites to: the rules' and the shared launch of sites of one activation.
MANIFEST_KERNELS = (*KERNEL_FAMILIES, *MULTI_GEMM_FAMILIES.values())

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
_lock = threading.Lock()  # compiles on several threads of one process merge one at a time

# (kernel, epilogue, dtype, K, N, prologue, widths)
SiteIdentity = tuple[str, tuple[str, ...], str, int, int, tuple[str, ...], tuple[int, ...]]

# The name ``max_helion_m`` had in older manifests (read, never written).
OLD_MAX_HELION_M_KEY = "dynamic_m_limit"


class ManifestError(ValueError):
    """A manifest that is missing or cannot be read; the message names the file."""


@dataclasses.dataclass(frozen=True)
class ManifestSite:
    """One (kernel, epilogue, dtype, K, N, prologue, widths) and the token counts it was compiled for."""

    kernel: str
    epilogue: tuple[str, ...]
    dtype: str
    k: int
    n: int
    static_m: frozenset[int] = frozenset()
    # The Helion limit of the site where its M is dynamic (None: only static M was compiled).
    max_helion_m: int | None = None
    prologue: tuple[str, ...] = ()
    widths: tuple[int, ...] = ()  # a shared launch's outputs (gemm_multi), summing to n; else empty

    @classmethod
    def declared(
        cls, kernel: str, epilogue: Sequence[str], dtype: str, k: int, n: int, m: int | None,
        max_helion_m: int, *, prologue: Sequence[str] = (), widths: Sequence[int] = (),
    ) -> ManifestSite:
        """A site as one compile saw it: a static ``m``, or ``m=None`` (dynamic) up to ``max_helion_m``."""
        ms = {"max_helion_m": max_helion_m} if m is None else {"static_m": frozenset({m})}
        return cls(kernel, tuple(epilogue), dtype, k, n, prologue=tuple(prologue), widths=tuple(widths), **ms)

    @property
    def identity(self) -> SiteIdentity:
        return (self.kernel, self.epilogue, self.dtype, self.k, self.n, self.prologue, self.widths)

    def merge(self, other: ManifestSite) -> ManifestSite:
        """Every M either declares; of two dynamic limits the larger (a later table may have moved it)."""
        assert self.identity == other.identity, (self, other)
        limits = [limit for limit in (self.max_helion_m, other.max_helion_m) if limit is not None]
        return dataclasses.replace(
            self, static_m=self.static_m | other.static_m, max_helion_m=max(limits, default=None)
        )

    def to_json(self) -> dict[str, Any]:
        widths = {"widths": list(self.widths)} if self.widths else {}
        return {"kernel": self.kernel, "prologue": list(self.prologue), "epilogue": list(self.epilogue),
                "dtype": self.dtype, "k": self.k, "n": self.n, **widths, "m": sorted(self.static_m),
                "max_helion_m": self.max_helion_m}

    @classmethod
    def from_json(cls, data: object) -> ManifestSite:
        """Raises ``ValueError`` saying which field is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a site must be an object, got {data!r}")
        missing = sorted({"kernel", "epilogue", "dtype", "k", "n", "m"} - data.keys())
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        epilogue = _steps("epilogue", data["epilogue"], EPILOGUE_STEPS)
        prologue = _steps("prologue", data.get("prologue", []), PROLOGUE_STEPS)
        if data["kernel"] not in MANIFEST_KERNELS:
            raise ValueError(f"unknown kernel {data['kernel']!r}; valid: {list(MANIFEST_KERNELS)}")
        if not isinstance(data["dtype"], str) or data["dtype"] not in RULE_DTYPES:
            raise ValueError(f"unknown dtype {data['dtype']!r}; valid: {sorted(RULE_DTYPES)}")
        if not isinstance(data["m"], list):
            raise ValueError(f"'m' must be a list of token counts, got {data['m']!r}")
        limit = data.get("max_helion_m", data.get(OLD_MAX_HELION_M_KEY))
        n = _positive_int("n", data["n"])
        return cls(
            kernel=data["kernel"],
            epilogue=epilogue,
            dtype=data["dtype"],
            k=_positive_int("k", data["k"]),
            n=n,
            static_m=frozenset(_positive_int("m", m) for m in data["m"]),
            max_helion_m=None if limit is None else _positive_int("max_helion_m", limit, minimum=0),
            prologue=prologue,
            widths=_widths(data.get("widths", []), data["kernel"], n),
        )


def _steps(name: str, value: object, vocabulary: dict[str, object]) -> tuple[str, ...]:
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value) and set(value) <= vocabulary.keys()):
        raise ValueError(f"'{name}' must list steps of {sorted(vocabulary)}, got {value!r}")
    return tuple(value)


def _widths(value: object, kernel: str, n: int) -> tuple[int, ...]:
    """A shared launch's output widths: 2 to MULTI_GEMM_SLOTS of them summing to ``n``; none for other sites."""
    if not isinstance(value, list):
        raise ValueError(f"'widths' must be a list of output widths, got {value!r}")
    widths = tuple(_positive_int("widths", w) for w in value)
    if widths and kernel not in MULTI_GEMM_FAMILIES.values():
        raise ValueError(f"'widths' belong to the shared launches' sites ({', '.join(MULTI_GEMM_FAMILIES.values())}) "
                         f"only, got {list(widths)} for {kernel}")
    if widths and not (2 <= len(widths) <= MULTI_GEMM_SLOTS and sum(widths) == n):
        raise ValueError(f"'widths' must be 2 to {MULTI_GEMM_SLOTS} output widths summing to n={n}, "
                         f"got {list(widths)}")
    return widths


def _positive_int(name: str, value: object, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value


def merge_sites(sites: Iterable[ManifestSite]) -> list[ManifestSite]:
    """One entry per identity, merged, in a stable order (so an unchanged manifest is not rewritten)."""
    merged: dict[SiteIdentity, ManifestSite] = {}
    for site in sites:
        known = merged.get(site.identity)
        merged[site.identity] = site if known is None else known.merge(site)
    return [merged[identity] for identity in sorted(merged)]


def _load(path: Path) -> list[ManifestSite] | None:
    """The sites of ``path``; None when there is no file. Raises ``ManifestError`` naming it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"cannot read the manifest {path}: {e}") from e
    if not (isinstance(data, dict) and data.get("version") == MANIFEST_VERSION
            and isinstance(data.get("sites"), list)):
        raise ManifestError(
            f"{path} is not a manifest of version {MANIFEST_VERSION} (expected {{\"version\": "
            f"{MANIFEST_VERSION}, \"sites\": [...]}})"
        )
    sites = []
    for i, entry in enumerate(data["sites"]):
        try:
            sites.append(ManifestSite.from_json(entry))
        except ValueError as e:
            raise ManifestError(f"{path}: site #{i}: {e}") from e
    return sites


def read_manifest(path: Path) -> list[ManifestSite]:
    """The sites of the manifest at ``path``. Raises ``ManifestError`` naming the file when it is missing or
    malformed."""
    sites = _load(path)
    if sites is None:
        raise ManifestError(
            f"no manifest at {path}: compile a model with backend='helion_inductor' on a CUDA device first"
        )
    return sites


def write_manifest(path: Path, sites: Sequence[ManifestSite]) -> None:
    """Write ``sites`` (merged) as the manifest at ``path``, atomically; raises ``OSError`` when it cannot
    (compiles merge through :func:`record_sites`, which never raises)."""
    write_json_atomic(path, {"version": MANIFEST_VERSION, "sites": [s.to_json() for s in merge_sites(sites)]})


def record_sites(path: Path, sites: Sequence[ManifestSite]) -> None:
    """Merge ``sites`` into the manifest at ``path``; warn, never raise, when that fails."""
    if not sites:
        return
    with _lock:
        try:
            existing = _load(path) or []
        except ManifestError as e:
            log.warning("helion_inductor: %s; replacing it", e)
            existing = []
        merged = merge_sites([*existing, *sites])
        if merged == existing:
            return
        try:
            write_manifest(path, merged)
        except OSError as e:
            log.warning("helion_inductor: cannot write the manifest %s (%s); the tuner will not see these "
                        "sites", path, e)
