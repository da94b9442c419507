"""One registry row per kernel family: everything the backend knows about a family, reached from its name.

A row holds the family's kernel (a lazy import path: reading a row imports no Helion), how ``run_kernel``
calls it, its default config as a plain dict, the adapter from a table config to the config its kernel
runs, its sweep candidates, its tuning problem and its reference computation
(:mod:`helion_backend.semantics.reference`). The kernel, the adapter, the candidates and the problem are
imported when first used (the tuning ones from the layer above, which is why they are paths:
``tests/test_import_graph.py`` checks where they lead); everything else is plain data.
The family names, and what a rule may ask of each family (its input dtypes and prologue steps, the row's
``contract``), are :mod:`helion_backend.vocabulary`'s: the compile side reads them without this module.

Adding a family is one row here plus its kernel file (and its tuning problem and candidates where they
differ from an existing family's).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from helion_backend.semantics.reference import unfused, unfused_multi
from helion_backend.tables import GEMV, PAIRED_LOADS, PREQUANTIZE, SWAP_AB
from helion_backend.vocabulary import (
    DEFAULT_KERNEL_FAMILY,
    FP8_BLOCK_FAMILY,
    FP8_FAMILY,
    GLU_FAMILY,
    GLU_FP8_FAMILY,
    GLU_INT8_FAMILY,
    INT4_FAMILY,
    INT8_FAMILY,
    KERNEL_FAMILIES,
    MEMBER_FAMILY,
    MULTI_GEMM_FAMILIES,
    MULTI_GEMM_FAMILY,
    SUPPORTED_DTYPES,
    WEIGHT_ONLY_FAMILY,
    FamilyContract,
)

_PACKAGE = __name__.rsplit(".", 2)[0]  # helion_backend

# Our boolean keys in a family's configs (removed before Helion sees them), each making the family's wrapper
# launch another kernel: :mod:`helion_backend.tables` names them.

NUM_SMS = 132  # H200: split-K grids are sized by it (the default configs and the tuner's candidates)
_DECODE_MAX_M = 32
# Each split must still run a few K blocks, or its atomic adds and the extra epilogue pass cost more
# than the parallelism gains.
_MIN_K_PER_SPLIT = 1024
_MAX_SPLIT_K = 16
_QUANTIZED_INPUTS = (torch.float8_e4m3fn, torch.int8)


@dataclass(frozen=True)
class KernelCall:
    """The arguments of one GEMM launch, the same for every family: the activation ``x`` [M, K], the weight
    ``w_kn`` as a [K, N] view (a shared launch: one per output, with ``steps`` one epilogue per output),
    the epilogue and its ``operands`` and ``scalars``, the output dtype, a fused activation quantization
    (``program``), a gated MLP's up projection (``up_kn``, rescaled by its own ``up_steps``), the scales of
    a dequantized weight (``weight_scale``), a fused RMSNorm's weight and spec (``norm``) and whether the
    weights are frozen (``frozen_weights``: the int4 family may then run tinygemm)."""

    x: torch.Tensor
    w_kn: Any  # torch.Tensor, or a shared launch's list of them
    steps: Sequence[Any]  # step names, or a shared launch's one tuple of them per output
    operands: Sequence[torch.Tensor]
    scalars: Sequence[float]
    out_dtype: torch.dtype
    program: Any = None  # QuantProgram
    up_kn: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    norm: Any = None  # (norm weight, RmsNormSpec)
    up_steps: tuple[str, ...] = ()
    frozen_weights: bool = False  # option frozen_weights: the weight may be kept in another form


Launcher = Callable[["KernelFamily", Callable[..., Any], KernelCall, Any, "str | None"], Any]


def _launch_gemm(family: KernelFamily, kernel: Callable[..., Any], call: KernelCall, config: Any,
                 config_dir: str | None) -> torch.Tensor:
    return kernel(call.x, call.w_kn, call.steps, call.operands, call.scalars, call.out_dtype, config=config,
                  config_dir=config_dir, norm=call.norm)


def _launch_glu(family: KernelFamily, kernel: Callable[..., Any], call: KernelCall, config: Any,
                config_dir: str | None) -> torch.Tensor:
    if call.up_kn is None:
        raise ValueError(f"the {family.name} kernel needs the up projection's weight (up_kn)")
    return kernel(call.x, call.w_kn, call.up_kn, call.steps, call.operands, call.scalars, call.out_dtype,
                  config=config, config_dir=config_dir, norm=call.norm, up_steps=call.up_steps,
                  kernel_family=family.name)


def _launch_quantized(family: KernelFamily, kernel: Callable[..., Any], call: KernelCall, config: Any,
                      config_dir: str | None) -> torch.Tensor:
    return kernel(call.x, call.w_kn, call.steps, call.operands, call.scalars, call.out_dtype, call.program,
                  config=config, config_dir=config_dir, kernel_family=family.name)


def _launch_int4(family: KernelFamily, kernel: Callable[..., Any], call: KernelCall, config: Any,
                 config_dir: str | None) -> torch.Tensor:
    return kernel(call.x, call.w_kn, call.weight_scale, call.steps, call.operands, call.scalars, call.out_dtype,
                  config=config, config_dir=config_dir, frozen_weights=call.frozen_weights)


def _launch_block_fp8(family: KernelFamily, kernel: Callable[..., Any], call: KernelCall, config: Any,
                      config_dir: str | None) -> torch.Tensor:
    return kernel(call.x, call.w_kn, call.weight_scale, call.steps, call.operands, call.scalars, call.out_dtype,
                  call.program, config=config, config_dir=config_dir)


def _launch_multi(family: KernelFamily, kernel: Callable[..., Any], call: KernelCall, config: Any,
                  config_dir: str | None) -> list[torch.Tensor]:
    return kernel(call.x, call.w_kn, call.steps, call.operands, call.scalars, call.out_dtype, config=config,
                  config_dir=config_dir, norm=call.norm, kernel_family=family.name)


def split_k_choices(k: int) -> list[int]:
    """The split-K factors worth trying at this K: powers of two up to the cap that leave every split deep
    enough (what the default configs pick from, and what the tuner searches)."""
    choices = [1]
    while choices[-1] * 2 <= _MAX_SPLIT_K and k // (choices[-1] * 2) >= _MIN_K_PER_SPLIT:
        choices.append(choices[-1] * 2)
    return choices


def _split_k(m_tiles: int, n_tiles: int, k: int) -> int:
    """The largest choice that keeps the grid within one wave of SMs."""
    return max(s for s in split_k_choices(k) if s == 1 or m_tiles * n_tiles * s <= NUM_SMS)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_default(m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, Any]:
    """The hand-picked config of a tiled GEMM at this shape, as a plain dict; never autotuned."""
    # fp32 tiles take twice the shared memory of 16-bit ones: halve the K block to keep the stages
    # (fp8/int8 GEMMs keep the 16-bit block: the quantized kernel stages its activation in 16 bits).
    k_scale = 2 if dtype == torch.float32 else 1
    if m <= _DECODE_MAX_M:
        # Narrow N tiles and deep K blocks won most decode keys of the H200 sweep (tuned/nvidia_h200.json).
        block_m, block_n, block_k, num_warps, num_stages = 16, 32, 512 // k_scale, 4, 3
    elif m <= 128:
        block_m, block_n, block_k, num_warps, num_stages = 64, 128, 64 // k_scale, 4, 4
    else:
        block_m, block_n, block_k, num_warps, num_stages = 128, 128, 64 // k_scale, 8, 3
    # Every fp8/int8 key of the H200 sweep ran fastest with the activation quantized once, up front.
    extra = {PREQUANTIZE: True} if dtype in _QUANTIZED_INPUTS else {}
    return dict(block_sizes=[block_m, block_n, block_k], num_warps=num_warps, num_stages=num_stages,
                split_k=_split_k(_cdiv(m, block_m), _cdiv(n, block_n), k), **extra)


def int4_default(m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, Any]:
    """:func:`tile_default` with the int4 kernel's K block: it counts packed bytes (two columns of K each),
    and every step holds four [block_k, block_n] tiles in registers (bytes, their group scales, two
    dequantized nibbles), so a quarter of the 16-bit depth, and 128 columns of K at the least."""
    config = tile_default(m, k, n, dtype)
    block_m, block_n, block_k = config["block_sizes"]
    return {**config, "block_sizes": [block_m, block_n, max(64, block_k // 4)]}


@functools.cache  # on every launch: the kernel and its config adapter
def _resolve(path: str) -> Any:
    """``"module:attribute"`` (the module relative to the package) imported."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), attribute)


@dataclass(frozen=True)
class KernelFamily:
    """One kernel family's row (see the module docstring). ``kernel``, ``config_adapter``, ``problem``
    and ``candidates`` are ``"module:attribute"`` paths under the package, imported on use."""

    name: str
    kernel_path: str
    launcher: Launcher
    default: Callable[[int, int, int, torch.dtype], dict[str, Any]]
    problem_path: str
    candidates_path: str
    # What the family computes without Helion, from a :class:`KernelCall`'s fields in order.
    reference: Callable[..., Any] = unfused
    # Turns a table config into the config the family's kernel runs (None: the table's config as is).
    config_adapter_path: str | None = None
    quant_format: str | None = None  # the helion_backend.quantize format whose layers the family runs
    # Our config keys (PREQUANTIZE, PAIRED_LOADS, GEMV, SWAP_AB) that make the family's wrapper launch
    # another kernel; a site that quantizes its own rows reads PREQUANTIZE whatever its family.
    wrapper_keys: tuple[str, ...] = ()
    # Reads a quantize layer's weight as the kernel takes it: (w_kn, weight_scale).
    layer_weight: Callable[[Any], tuple[torch.Tensor, torch.Tensor | None]] | None = None

    @property
    def kernel(self) -> Callable[..., Any]:
        """The family's Helion entry point (imports Helion)."""
        return _resolve(self.kernel_path)

    @property
    def config_adapter(self) -> Callable[..., Any] | None:
        return _resolve(self.config_adapter_path) if self.config_adapter_path else None

    @property
    def contract(self) -> FamilyContract:
        """What rules may ask of the family (:data:`helion_backend.vocabulary.KERNEL_FAMILIES`); a shared
        launch, which no rule names, has its member family's."""
        return KERNEL_FAMILIES.get(self.name) or KERNEL_FAMILIES[self.member]

    @property
    def member(self) -> str:
        """The single-GEMM family whose kernel each site of this one would run alone (itself if single)."""
        return MEMBER_FAMILY.get(self.name, self.name)

    @property
    def multiplies_quantized_rows(self) -> bool:
        """Whether the kernel multiplies rows quantized before it (fp8 or int8), rather than float ones."""
        return not set(self.contract.dtypes) & set(SUPPORTED_DTYPES)

    def default_config(self, m: int, k: int, n: int, dtype: torch.dtype) -> dict[str, Any]:
        """The hand-picked config at this shape, as a plain dict (``helion.Config(**it)`` runs it)."""
        return self.default(m, k, n, dtype)

    def problem(self, key: Any, device: torch.device) -> Any:
        """The tuning problem of ``key`` (a ``TuneKey`` of this family; imports Helion)."""
        return _resolve(self.problem_path)(key, device)

    def candidates(self, key: Any) -> list[Any]:
        """The sweep's candidate configs at ``key`` (imports Helion)."""
        return _resolve(self.candidates_path)(key)

    def launch(self, call: KernelCall, config: Any = None, config_dir: str | None = None) -> Any:
        """Run the family's kernel on ``call`` with ``config`` (by default the config tables' pick)."""
        return self.launcher(self, self.kernel, call, config, config_dir)


def _qweight(layer: Any) -> tuple[torch.Tensor, None]:
    return layer.qweight.t(), None


def _packed_weight(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.packed.t(), layer.group_params


def _block_weight(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.qweight.t(), layer.weight_scale


_PROBLEMS, _CANDIDATES = "tuning.problems", "tuning.candidates"
_FLOAT = dict(problem_path=f"{_PROBLEMS}:float_problem", default=tile_default)
_QUANTIZED = dict(kernel_path="kernels.quant_gemm:quant_gemm_helion", launcher=_launch_quantized,
                  default=tile_default, problem_path=f"{_PROBLEMS}:quantized_problem", layer_weight=_qweight)
_SIBLINGS = dict(default=tile_default, problem_path=f"{_PROBLEMS}:quantized_sibling_problem")
_GLU = dict(kernel_path="kernels.gemm:glu_gemm_helion", launcher=_launch_glu,
            config_adapter_path="kernels.gemm:glu_kernel_config")
_MULTI = dict(kernel_path="kernels.multi_gemm:multi_gemm_helion", launcher=_launch_multi,
              config_adapter_path="kernels.multi_gemm:multi_kernel_config", reference=unfused_multi)

FAMILIES: dict[str, KernelFamily] = {
    row.name: row
    for row in (
        KernelFamily(DEFAULT_KERNEL_FAMILY, "kernels.gemm:gemm_epilogue_helion", _launch_gemm,
                     candidates_path=f"{_CANDIDATES}:float_candidates", wrapper_keys=(GEMV,),
                     config_adapter_path="kernels.gemm:norm_kernel_config", **_FLOAT),
        KernelFamily(FP8_FAMILY, candidates_path=f"{_CANDIDATES}:row_quant_candidates", quant_format="fp8_dynamic",
                     wrapper_keys=(GEMV, SWAP_AB), **_QUANTIZED),
        KernelFamily(INT8_FAMILY, candidates_path=f"{_CANDIDATES}:row_quant_candidates", quant_format="int8_dynamic",
                     wrapper_keys=(GEMV, SWAP_AB), **_QUANTIZED),
        KernelFamily(WEIGHT_ONLY_FAMILY, candidates_path=f"{_CANDIDATES}:weight_only_candidates",
                     quant_format="int8_weight_only", wrapper_keys=(GEMV, SWAP_AB), **_QUANTIZED),
        KernelFamily(INT4_FAMILY, "kernels.quant_gemm:int4_gemm_helion", _launch_int4, int4_default,
                     f"{_PROBLEMS}:quantized_problem", f"{_CANDIDATES}:int4_candidates",
                     quant_format="int4_weight_only", wrapper_keys=(PAIRED_LOADS, GEMV, SWAP_AB),
                     layer_weight=_packed_weight),
        KernelFamily(FP8_BLOCK_FAMILY, "kernels.quant_gemm:block_fp8_gemm_helion", _launch_block_fp8, tile_default,
                     f"{_PROBLEMS}:quantized_problem", f"{_CANDIDATES}:block_fp8_candidates",
                     quant_format="fp8_block", wrapper_keys=(PREQUANTIZE,), layer_weight=_block_weight),
        KernelFamily(GLU_FAMILY, candidates_path=f"{_CANDIDATES}:glu_family_candidates", **_GLU, **_FLOAT),
        KernelFamily(GLU_FP8_FAMILY, candidates_path=f"{_CANDIDATES}:quantized_glu_candidates", **_GLU, **_SIBLINGS),
        KernelFamily(GLU_INT8_FAMILY, candidates_path=f"{_CANDIDATES}:quantized_glu_candidates", **_GLU,
                     **_SIBLINGS),
        KernelFamily(MULTI_GEMM_FAMILY, problem_path=f"{_PROBLEMS}:multi_problem", default=tile_default,
                     candidates_path=f"{_CANDIDATES}:multi_candidates", **_MULTI),
        *(KernelFamily(name, candidates_path=f"{_CANDIDATES}:quantized_multi_candidates", **_MULTI, **_SIBLINGS)
          for name in MULTI_GEMM_FAMILIES.values() if name != MULTI_GEMM_FAMILY),
    )
}
assert FAMILIES.keys() == {*KERNEL_FAMILIES, *MULTI_GEMM_FAMILIES.values()}, "a family without a registry row"


@functools.cache
def family(name: str) -> KernelFamily:
    """The row of ``name``; raises ``ValueError`` listing the known families."""
    row = FAMILIES.get(name)
    if row is None:
        raise ValueError(f"unknown kernel family {name!r}; known: {list(FAMILIES)}")
    return row


def run_kernel(
    kernel: str,
    x: torch.Tensor,
    w_kn: torch.Tensor,
    steps: tuple[str, ...],
    operands: Sequence[torch.Tensor],
    scalars: Sequence[float],
    out_dtype: torch.dtype,
    config_dir: str | None = None,
    program: Any = None,
    up_kn: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    norm: Any = None,
    config: Any = None,
    up_steps: tuple[str, ...] = (),
    frozen_weights: bool = False,
) -> torch.Tensor:
    """Run the ``kernel`` family's Helion implementation on these arguments (see :class:`KernelCall`) with
    ``config``, by default the config tables' pick for the shape (user-tuned ones in ``config_dir`` first)."""
    call = KernelCall(x, w_kn, steps, operands, scalars, out_dtype, program, up_kn, weight_scale, norm, up_steps,
                      frozen_weights)
    return family(kernel).launch(call, config, config_dir)
