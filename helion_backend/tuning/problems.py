"""The tuning problem of each kernel family: what the tuner (``python -m helion_backend tune``, with Helion's
search or the candidate sweep, also run by ``benchmarks/sweep_gemm_configs.py``) runs, checks and times for
one key.

A :class:`Problem` runs a config on call ``i`` through the family's production wrapper (so what is checked
and timed is what a compile runs, the wrapper's config adaptation included), over inputs in enough copies
that every call reads a weight that is not in the L2; it knows the result the call must match, what the
site runs without Helion (``torch.compile`` default of the unfused computation), the config the backend
runs today, and the family's config keys that one Helion search cannot explore (:attr:`Problem.searched`):

- ``split_k``: a split writes fp32 partial sums to a workspace of another shape and needs a finishing pass
  the autotuner never sees, so each split is searched on its own, with ``split_k`` fixed;
- ``prequantize`` (fp8 and int8 sites that quantize their activation, option ``fuse_activation_quant``, and
  block fp8), ``paired_loads`` (int4) and ``gemv`` (at a few rows): ours, not Helion's; with
  them the wrapper launches another GEMM kernel (on rows quantized by a kernel of their own; reading the
  activation as pairs; multiplying and summing without a dot).

Each :class:`Search` captures, on the GPU, the GEMM launch the wrapper makes for its seed config
(:func:`~.kernels.gemm.record_launches`): the kernel, its arguments and the config as that kernel takes
it, which is what Helion's autotuner needs. :meth:`Problem.table_config` maps a config the search found
back to the layout the config tables store.

What the manifest does not record is chosen here: an RMSNorm is Hugging Face's (:data:`NORM_SPEC`), an
fp8/int8 site's activation is bfloat16, a quantized site's weight is :mod:`helion_backend.layers.quantize`'s layer
of its family, and a shared launch's outputs are tuned without their epilogues (the manifest records them
one after the other, not which output has which). An fp8/int8 site without the activation quantization
in its prologue (the default: Inductor quantizes the rows) is the layer's GEMM on rows quantized before
the call, timed against ``torch.compile`` of that GEMM alone.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import helion
import torch

from helion_backend.kernels import FAMILIES, configs, run_kernel
from helion_backend.kernels.gemm import (
    Launch,
    epilogue_kernel,
    gemm_config_of_norm_kernel,
    gemm_epilogue_helion,
    glu_gemm_helion,
    record_launches,
)
from helion_backend.kernels.multi_gemm import multi_gemm_helion
from helion_backend.kernels.quant_gemm import dequantize_groups_kernel, quantize_rows_kernel, tinygemm_gemm
from helion_backend.kernels.tinygemm import tinygemm_problem
from helion_backend.layers.quantize import QUANT_FORMATS
from helion_backend.options import BackendOptions
from helion_backend.policy import TableKey
from helion_backend.runtime import dispatch
from helion_backend.semantics.epilogue import apply_epilogue, num_scalars, operand_kinds
from helion_backend.semantics.norm import RmsNormSpec, rms_norm
from helion_backend.semantics.quant_program import QuantProgram, quantize_rows
from helion_backend.semantics.reference import unfused, unfused_multi
from helion_backend.tables import TINYGEMM_US
from helion_backend.tuning.timing import Step, copies_to_defeat_l2, relative_error
from helion_backend.vocabulary import (
    ACTIVATION_QUANT_STEPS,
    BIAS,
    CHANNEL_SCALE,
    DEFAULT_KERNEL_FAMILY,
    INT4_FAMILY,
    KERNEL_FAMILIES,
    MEMBER_FAMILY,
    MULTI_GEMM_FAMILY,
    RMSNORM,
    RULE_DTYPES,
    SILU,
    SUPPORTED_DTYPES,
    TOKEN_SCALE,
    UP_MUL,
    Operand,
    dtype_name,
)

# Largest relative Frobenius error against the reference for a config to count: bf16 rounding of the
# output alone is about 3e-3 (float families: against float64; quantized ones: against the unfused
# quantized computation, 40 dB SQNR).
TOLERANCE = 1e-2
NORM_SPEC = RmsNormSpec(1e-6, round_before_weight=True)  # LlamaRMSNorm / Qwen3RMSNorm
QUANT_ACTIVATION_DTYPE = "bfloat16"  # of fp8/int8 sites, whose manifest dtype is the quantized one
# The helion_backend.layers.quantize format whose layers each quantized family runs (the registry rows').
QUANT_FORMAT_OF = {row.name: row.quant_format for row in FAMILIES.values() if row.quant_format}
SPLIT_K, PREQUANTIZE, PAIRED_LOADS = "split_k", configs.PREQUANTIZE, configs.PAIRED_LOADS
GEMV, SWAP_AB = configs.GEMV, configs.SWAP_AB
HELION_TUNABLES = frozenset({SPLIT_K})  # of the searched keys, those Helion's autotuner can hold fixed
# Launches around the GEMM, never tuned.
_HELPER_KERNELS = (epilogue_kernel, quantize_rows_kernel, dequantize_groups_kernel)

Output = torch.Tensor | list[torch.Tensor]


class TuneError(Exception):
    """What stops the command (exit status 2) or fails one key, said for the user."""


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """One site shape and token count to tune, with the prologue and epilogue it is tuned under."""

    kernel: str
    epilogue: tuple[str, ...]
    dtype: str  # the GEMM's input dtype, as the manifest and the config tables name it
    k: int
    n: int
    m: int
    widths: tuple[int, ...] = ()  # a shared launch's outputs (gemm_multi)
    prologue: tuple[str, ...] = ()

    @property
    def table_key(self) -> TableKey:
        return TableKey(self.kernel, self.dtype, self.k, self.n, self.m)

    @property
    def normed(self) -> bool:
        return RMSNORM in self.prologue

    def __str__(self) -> str:
        family = "" if self.kernel == DEFAULT_KERNEL_FAMILY else f"{self.kernel} "
        widths = f" ({'+'.join(map(str, self.widths))})" if self.widths else ""
        steps = [*(f"{step} ->" for step in self.prologue), ",".join(self.epilogue) or "no epilogue"]
        return f"{family}{self.dtype} K={self.k} N={self.n}{widths} M={self.m} [{' '.join(steps)}]"


@dataclasses.dataclass(frozen=True)
class Search:
    """One autotuner search of a key: the family's own config keys held at one value each."""

    fixed: Mapping[str, Any]
    seed: helion.Config  # today's config with ``fixed``, as the tables store it
    launch: Callable[[], Launch]  # the GEMM launch of ``seed``, recorded from the wrapper (runs it: GPU)

    @property
    def overrides(self) -> dict[str, Any]:
        """The fixed keys the autotuner must keep (the others choose the launch, which ``launch`` made)."""
        return {key: value for key, value in self.fixed.items() if key in HELION_TUNABLES}

    def __str__(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.fixed.items()) or "the search"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One key's tuning problem (see the module docstring)."""

    run: Callable[[helion.Config, int], Output]  # the wrapper with this config on call i
    reference: Output  # what call 0 must compute
    fallback: Callable[[], Step]  # builds the step that runs call i without Helion (compiles lazily)
    current: helion.Config  # the config the backend runs today: the shipped table's, else the default
    epilogue: tuple[str, ...]  # the epilogue the kernel runs, recorded with the entry
    searched: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
    to_table: Callable[[helion.Config], helion.Config] = lambda config: config  # kernel layout -> table's
    tolerance: float = TOLERANCE
    extra_timings: Mapping[str, Step] = dataclasses.field(default_factory=dict)  # recorded as <name> (us)

    def searches(self) -> list[Search]:
        """One search per combination of the searched keys' values, seeded with today's config at them."""
        searches = []
        for values in itertools.product(*self.searched.values()):
            fixed = dict(zip(self.searched, values))
            # The GEMV kernel has no split-K; it and the swapped kernel always read rows quantized first
            # (prequantize or not), and they are two forms, not one.
            if fixed.get(GEMV) and (fixed.get(SPLIT_K, 1) != 1 or fixed.get(SWAP_AB)):
                continue
            if (fixed.get(GEMV) or fixed.get(SWAP_AB)) and fixed.get(PREQUANTIZE) is False:
                continue
            # int4's GEMV and swapped kernels read the rows their own way; paired_loads is the tiled kernel's.
            if (fixed.get(GEMV) or fixed.get(SWAP_AB)) and fixed.get(PAIRED_LOADS):
                continue
            seed = helion.Config(**{**self.current, **fixed})
            searches.append(Search(fixed, seed, functools.partial(gemm_launch, self.run, seed)))
        return searches

    def table_config(self, found: helion.Config, search: Search) -> helion.Config:
        """``found`` (in the searched kernel's layout) as the table stores it, with the search's own keys. The
        GEMV and swapped kernels' layout is the table's, with or without the norm."""
        to_table = (lambda config: config) if search.fixed.get(GEMV) or search.fixed.get(SWAP_AB) else self.to_table
        return helion.Config(**{**to_table(found), **search.fixed})


def gemm_launch(run: Callable[[helion.Config, int], Output], config: helion.Config) -> Launch:
    """The GEMM launch ``run(config, 0)`` makes (not the split-K finishing pass or the row quantization)."""
    with record_launches() as launches:
        run(config, 0)
    gemms = [launch for launch in launches if launch.kernel not in _HELPER_KERNELS]
    if len(gemms) != 1:
        raise TuneError(f"expected one GEMM launch, the wrapper made {[launch.kernel.name for launch in launches]}")
    return gemms[0]


def build_problem(key: TuneKey, device: torch.device) -> Problem:
    """The problem of ``key`` (its family's registry row's); raises ``TuneError`` for a key no problem can
    rebuild, saying why."""
    row = FAMILIES.get(key.kernel)
    if row is None:
        raise TuneError(f"no tuning problem for the kernel family {key.kernel!r}")
    return row.problem(key, device)


# ---------------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass(frozen=True)
class Call:
    """The arguments of one call of a single-output family, as :func:`~.kernels.run_kernel` takes them."""

    x: torch.Tensor
    w_kn: torch.Tensor  # a view of an nn.Linear-layout [N, K] weight
    steps: tuple[str, ...]
    operands: list[torch.Tensor]
    scalars: list[float]
    out_dtype: torch.dtype
    program: QuantProgram | None = None
    up_kn: torch.Tensor | None = None
    weight_scale: torch.Tensor | None = None
    norm: tuple[torch.Tensor, RmsNormSpec] | None = None

    def args(self) -> tuple[Any, ...]:
        """The fields in order: :func:`~helion_backend.semantics.reference.unfused`'s arguments."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def kernel(self, family: str, config: helion.Config) -> torch.Tensor:
        return run_kernel(family, self.x, self.w_kn, self.steps, self.operands, self.scalars, self.out_dtype,
                          None, self.program, self.up_kn, weight_scale=self.weight_scale, norm=self.norm,
                          config=config)

    def unfused(self) -> torch.Tensor:
        return unfused(*self.args())

    def float64(self) -> Call:
        """This call in float64 (a float family's exact result), the norm applied first in x's dtype so that
        its roundings are the kernel's."""
        x = self.x if self.norm is None else rms_norm(self.x, *self.norm)
        return dataclasses.replace(
            self, x=x.double(), w_kn=self.w_kn.double(), operands=[op.double() for op in self.operands],
            out_dtype=torch.float64, up_kn=None if self.up_kn is None else self.up_kn.double(), norm=None)


def _randn(gen: torch.Generator, device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _operands(steps: Sequence[str], m: int, n: int, make: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    """Random operands of ``steps``, flattened as the fused op hands them to the kernels."""
    shapes = {Operand.ROW: (n,), Operand.COL: (m, 1), Operand.ELEMENT: (1,), Operand.FULL: (m, n)}
    return dispatch.flatten_operands([make(*shapes[kind]) for kind in operand_kinds(steps)], steps, n)


def float_calls(key: TuneKey, device: torch.device, copies: int, seed: int = 0) -> list[Call]:
    """``copies`` calls of a float family's key (and, for the gated family, its up projection); the weights
    are scaled by 1/sqrt(K) so the accumulator is O(1), where activations are neither linear nor saturated.
    The output keeps the input dtype."""
    dtype = SUPPORTED_DTYPES[key.dtype]
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = functools.partial(_randn, gen, device, dtype)

    def weight() -> torch.Tensor:
        return (randn(key.n, key.k) * key.k**-0.5).t()

    def call() -> Call:
        return Call(x=randn(key.m, key.k), w_kn=weight(), steps=key.epilogue,
                    operands=_operands(key.epilogue, key.m, key.n, randn), scalars=[0.5] * num_scalars(key.epilogue),
                    out_dtype=dtype, up_kn=weight() if UP_MUL in key.epilogue else None,
                    norm=(randn(key.k) * 0.1 + 1, NORM_SPEC) if key.normed else None)

    return [call() for _ in range(copies)]


def compiled(fn: Callable[..., Output], args_of: Callable[[int], Sequence[Any]]) -> Step:
    """``torch.compile`` default of ``fn`` on call i's arguments, through a copy of ``fn`` with a code object
    of its own. Dynamo caches compiled code per code object and stops compiling after a few shapes, so each
    problem starts afresh and the fallback of the tenth key compiles too. (Resetting Dynamo would also drop
    every other compiled function of the process, a user's among them: ``autotune_missing`` tunes inside a
    compiled graph's first call.)"""
    compiled_fn = torch.compile(_fresh_code(fn), dynamic=False)
    return lambda i: compiled_fn(*args_of(i))


def _fresh_code(fn: Callable[..., Output]) -> Callable[..., Output]:
    """``fn`` as a new function object over a new (equal) code object: a cache of its own in Dynamo."""
    if not isinstance(fn, types.FunctionType):
        return fn
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    return fresh


# ---------------------------------------------------------------------------------------------------
# Families


def float_problem(key: TuneKey, device: torch.device) -> Problem:
    """``gemm`` and ``gemm_glu``: random float operands, checked against float64, against torch.compile of
    the unfused computation (cuBLAS, then Inductor's fused epilogue)."""
    dtype = SUPPORTED_DTYPES[key.dtype]
    glu = _gated(key.kernel)
    weights = 2 if glu else 1  # the gated kernel streams two weights a call
    calls = float_calls(key, device, copies_to_defeat_l2(weights * key.k * key.n * dtype.itemsize, device))
    if glu:  # the table holds what the gated kernel runs; it has no split-K
        to_table = functools.partial(FAMILIES[key.kernel].config_adapter, itemsize=dtype.itemsize, normed=key.normed)
        searched = {}
    else:
        to_table = gemm_config_of_norm_kernel if key.normed else (lambda config: config)
        searched = {SPLIT_K: configs.split_k_choices(key.k), **wrapper_keys(key)}
    return Problem(
        run=lambda config, i: calls[i % len(calls)].kernel(key.kernel, config),
        reference=calls[0].float64().unfused(),
        fallback=lambda: compiled(unfused, lambda i: calls[i % len(calls)].args()),
        current=_current(key, device),
        epilogue=key.epilogue, searched=searched, to_table=to_table,
    )


def quantizes_its_rows(key: TuneKey) -> bool:
    """Whether ``key``'s site quantizes its activation in the kernel (its prologue holds fp8's or int8's dynamic
    quantization, option ``fuse_activation_quant``). Only such a site reads ``prequantize``: the default site
    runs the plain GEMM on rows Inductor quantized."""
    return bool(set(key.prologue) & set(ACTIVATION_QUANT_STEPS.values()))


# The most rows at which the GEMV form (config key ``gemv``) is tried: it takes M multiply-adds a weight on the
# CUDA cores, where a dot takes a 16-row tile on the tensor cores at once, so past a few rows only the dot can
# keep up with the weight's read.
GEMV_MAX_M = 8


def wrapper_keys(key: TuneKey) -> dict[str, tuple[bool, ...]]:
    """Our config keys that make ``key``'s wrapper run another kernel, with their values: ``prequantize`` for a
    site that quantizes its own rows (:func:`quantizes_its_rows`) and for block fp8 (whose kernel always
    quantizes its groups itself), ``paired_loads`` for int4, ``gemv`` up to :data:`GEMV_MAX_M` rows in the
    families whose wrapper has it, ``swap_ab`` for those whose wrapper has it (the registry rows'
    ``wrapper_keys``)."""
    own = FAMILIES[key.kernel].wrapper_keys
    wanted = {PREQUANTIZE: quantizes_its_rows(key) or PREQUANTIZE in own, PAIRED_LOADS: PAIRED_LOADS in own,
              GEMV: GEMV in own and key.m <= GEMV_MAX_M, SWAP_AB: SWAP_AB in own}
    return {name: (False, True) for name, wanted_here in wanted.items() if wanted_here}


def _current(key: TuneKey, device: torch.device) -> helion.Config:
    """The config the backend runs at ``key`` today (the shipped table's, else the default)."""
    return configs.config_for(key.m, key.k, key.n, RULE_DTYPES[key.dtype], device, kernel=key.kernel)


def multi_problem(key: TuneKey, device: torch.device) -> Problem:
    """``gemm_multi``: the outputs of one activation (and its norm) in one launch, checked against float64,
    against torch.compile of the norm and the separate GEMMs and (``separate_us``) against one launch of
    the ``gemm`` family per output with its table config (the backend with ``merge_siblings`` off)."""
    if not key.widths:
        raise TuneError(f"{MULTI_GEMM_FAMILY} site recorded without its outputs' widths (a manifest written before "
                        "they were recorded): compile the model again to record them")
    dtype = SUPPORTED_DTYPES[key.dtype]
    copies = copies_to_defeat_l2(key.k * key.n * dtype.itemsize, device)
    outputs = [float_calls(dataclasses.replace(key, kernel=DEFAULT_KERNEL_FAMILY, n=n, epilogue=(), widths=()),
                           device, copies, seed) for seed, n in enumerate(key.widths)]
    x, norm = [call.x for call in outputs[0]], [call.norm for call in outputs[0]]
    steps = [()] * len(key.widths)

    def args(i: int) -> tuple[Any, ...]:
        j = i % copies
        return (x[j], [calls[j].w_kn for calls in outputs], steps, [], [], dtype)

    def separate(i: int) -> list[torch.Tensor]:
        j = i % copies
        return [gemm_epilogue_helion(x[j], calls[j].w_kn, (), [], [], dtype, norm=norm[j]) for calls in outputs]

    x64, w64 = outputs[0][0].float64().x, [calls[0].w_kn.double() for calls in outputs]
    return Problem(
        run=lambda config, i: multi_gemm_helion(*args(i), config, norm=norm[i % copies]),
        reference=unfused_multi(x64, w64, steps, [], [], torch.float64),
        fallback=lambda: compiled(unfused_multi, lambda i: (*args(i), norm[i % copies])),
        current=_current(key, device),
        epilogue=(), to_table=FAMILIES[key.kernel].config_adapter, extra_timings={"separate_us": separate},
    )


@functools.cache
def quantized_site(family: str, fuse_activation_quant: bool = BackendOptions.fuse_activation_quant,
                   ) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(GEMM input dtype, prologue, epilogue) of the family's layer with a bias, as a compile with that option
    records it (traced once on a small layer on the CPU): the sweep's keys."""
    layer = _quantized_layer(family, 256, 256, bias=True, device=torch.device("cpu"))
    site = _trace(layer, torch.zeros(2, 256, dtype=SUPPORTED_DTYPES[QUANT_ACTIVATION_DTYPE]), fuse_activation_quant)
    return dtype_name(site.dtype), tuple(step.name for step in site.prologue), _layer_steps(site)


def _quantized_layer(family: str, k: int, n: int, bias: bool, device: torch.device,
                     dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    linear = torch.nn.Linear(k, n, bias=bias, device=device, dtype=dtype)
    return QUANT_FORMATS[FAMILIES[family].quant_format].from_linear(linear).eval()


def _trace(layer: torch.nn.Module, x: torch.Tensor, fuse_activation_quant: bool) -> Any:
    # The compile side (its passes, rules and networkx) loads only where a problem traces a layer: tuning's
    # worker processes import this module.
    from helion_backend.compile.trace import trace_sites

    (site,) = trace_sites(layer, x, fuse_activation_quant=fuse_activation_quant)
    return site


def _layer_steps(site: Any) -> tuple[str, ...]:
    return tuple(step.name for step in site.steps)


def quantized_problem(key: TuneKey, device: torch.device) -> Problem:
    """A quantized family: layers as :mod:`helion_backend.layers.quantize` builds them (with a bias where the site
    adds one), the site's epilogue after the layer's own steps, checked against the unfused quantized
    computation and timed against torch.compile of the layer and those steps. An fp8/int8 key without its
    activation quantization runs the kernel on rows quantized before the call (by the layer's own program) and
    is timed against torch.compile of the layer's GEMM on them (``forward_quantized``)."""
    family_quantizes = set(KERNEL_FAMILIES[key.kernel].prologue) & set(ACTIVATION_QUANT_STEPS.values())
    quant_step = next(iter(family_quantizes), None)  # fp8's and int8's dynamic activation quantization
    # Without it (the default compile's site), the kernel reads rows quantized before the call, as Inductor does.
    prequantized = quant_step is not None and not quantizes_its_rows(key)
    act_dtype = SUPPORTED_DTYPES.get(key.dtype, SUPPORTED_DTYPES[QUANT_ACTIVATION_DTYPE])
    bias = BIAS in key.epilogue
    first = _quantized_layer(key.kernel, key.k, key.n, bias, device, act_dtype)
    copies = copies_to_defeat_l2(sum(b.nbytes for b in first.buffers()), device)
    layers = [first, *(_quantized_layer(key.kernel, key.k, key.n, bias, device, act_dtype) for _ in range(copies - 1))]
    gen = torch.Generator(device=device).manual_seed(0)
    randn = functools.partial(_randn, gen, device, act_dtype)
    xs = [randn(key.m, key.k) for _ in range(copies)]
    site = _trace(first, xs[0], fuse_activation_quant=True)  # (its program quantizes the rows of a pre-quantized key)
    if dtype_name(site.dtype) != key.dtype:
        raise TuneError(f"the {key.kernel} layer multiplies {dtype_name(site.dtype)} inputs, the site {key.dtype}")
    own = _layer_steps(_trace(first, xs[0], fuse_activation_quant=False) if prequantized else site)
    if key.epilogue[:len(own)] != own:
        raise TuneError(f"the {key.kernel} layer computes the steps {list(own)}; the site's epilogue "
                        f"{list(key.epilogue)} does not start with them")
    after = key.epilogue[len(own):]
    scalars = [0.5] * num_scalars(key.epilogue)
    extra = [_operands(after, key.m, key.n, randn) for _ in range(copies)]
    # What the layer's GEMM reads: the float rows, or (pre-quantized) the quantized rows and their [M, 1] scales.
    inputs = [quantize_rows(site.quant_program, x) if prequantized else (x,) for x in xs]
    calls = [_quantized_call(key.kernel, layer, rows, None if prequantized else site.quant_program, own,
                             key.epilogue, scalars, ops, act_dtype)
             for layer, rows, ops in zip(layers, inputs, extra)]

    def layer_then_steps(layer: torch.nn.Module, rows: tuple[torch.Tensor, ...],
                         operands: list[torch.Tensor]) -> torch.Tensor:
        out = layer.forward_quantized(*rows, act_dtype) if prequantized else layer(*rows)
        return apply_epilogue(out.to(torch.float32), after, operands.__getitem__,
                              scalars[num_scalars(own):]).to(act_dtype)

    split = {SPLIT_K: configs.split_k_choices(key.k)}
    current = _current(key, device)
    keep_prequantize = {PREQUANTIZE: current[PREQUANTIZE]} if PREQUANTIZE in current else {}
    return Problem(
        run=lambda config, i: calls[i % copies].kernel(key.kernel, config),
        reference=calls[0].unfused(),
        fallback=lambda: compiled(layer_then_steps,
                                  lambda i: (layers[i % copies], inputs[i % copies], extra[i % copies])),
        current=current,
        epilogue=key.epilogue,
        searched={**split, **wrapper_keys(key)},
        # A pre-quantized site never quantizes: its entry keeps today's prequantize for the sites that do.
        to_table=lambda config: helion.Config(**{**config, **keep_prequantize}),
        extra_timings=_tinygemm_timing(key, calls, act_dtype),
    )


def _tinygemm_timing(key: TuneKey, calls: list[Call], act_dtype: torch.dtype) -> dict[str, Step]:
    """An int4 key's tinygemm run (:func:`~helion_backend.kernels.quant_gemm.tinygemm_gemm`: its product and the
    epilogue over it), timed beside the configs for the sites whose weights are frozen; none where tinygemm
    cannot take the key. Its first call is checked against the unfused layer, as every config is."""
    if key.kernel != INT4_FAMILY:
        return {}
    groups = calls[0].weight_scale.shape[1]  # the layers' [N, K/G] scales
    if tinygemm_problem(act_dtype, key.k, key.n, key.k // groups) is not None:
        return {}
    reference, checked = calls[0].unfused(), []

    def step(i: int) -> torch.Tensor:
        call = calls[i % len(calls)]
        out = tinygemm_gemm(call.x, call.w_kn, call.weight_scale, call.steps, call.operands, call.scalars,
                            call.out_dtype)
        if out is None:
            raise TuneError(f"{key}: tinygemm's form of the weight could not be made (inside a capture)")
        if not checked:  # the first call, a warm-up one (the check reads the GPU: never inside a capture)
            error = relative_error(out, reference)
            if not error <= TOLERANCE:
                raise TuneError(f"{key}: tinygemm is off by {error:.2e} (> {TOLERANCE:.0e})")
            checked.append(error)
        return out

    return {TINYGEMM_US: step}


def _quantized_call(family: str, layer: torch.nn.Module, rows: tuple[torch.Tensor, ...], program: QuantProgram | None,
                    own: tuple[str, ...], steps: tuple[str, ...], scalars: list[float],
                    extra: list[torch.Tensor], out_dtype: torch.dtype) -> Call:
    """The fused op's arguments for ``layer``: its weight as the family's kernel reads it, the operands of the
    layer's ``own`` steps from the layer (weight scales, bias) or the rows (``(x_quantized, scale)``: the
    token_scale), then ``extra`` for the steps after them."""
    x, *row_scale = rows
    from_layer = {CHANNEL_SCALE: lambda: layer.weight_scale.reshape(-1).float(), BIAS: lambda: layer.bias,
                  TOKEN_SCALE: lambda: row_scale[0]}
    # Flattened as the fused op hands them to the kernels (the rows' [M, 1] scales become an [M, N] view).
    operands = [*dispatch.flatten_operands([from_layer[step]() for step in own if operand_kinds((step,))], own,
                                           layer.out_features), *extra]
    w_kn, weight_scale = FAMILIES[family].layer_weight(layer)
    return Call(x=x, w_kn=w_kn, steps=steps, operands=operands, scalars=scalars, out_dtype=out_dtype,
                program=program, weight_scale=weight_scale)


# ---------------------------------------------------------------------------------------------------
# Sibling fusions on quantized rows


def _gated(family: str) -> bool:
    """Whether the family is a gated MLP's (gate and up projections in one kernel: the ``up_mul`` step)."""
    signature = KERNEL_FAMILIES.get(family)
    return signature is not None and UP_MUL in signature.needs_steps


def quantized_sibling_epilogue(family: str) -> tuple[str, ...]:
    """The steps a fused quantized family's key is swept with: its member layer's own steps (rows quantized
    before the call: token and channel scales, int8's casts), then for the gated families SiLU and the product."""
    _, _, own = quantized_site(MEMBER_FAMILY[family], False)
    own = tuple(step for step in own if step != BIAS)  # the sweep's layers have no bias
    return (*own, SILU, UP_MUL) if _gated(family) else ()


def quantized_sibling_problem(key: TuneKey, device: torch.device) -> Problem:
    """``gemm_multi_fp8``/``_int8`` (q, k, v: ``widths``) and ``gemm_glu_fp8``/``_int8`` (gate and up, N each):
    :mod:`helion_backend.layers.quantize` layers of the member family without a bias, on rows quantized before the
    call by the layer's own program, each output rescaled by its own steps (the layer's); checked against
    the unfused quantized computation and timed against what torch.compile runs without the fusion: one
    quantized GEMM per projection (the layers' ``forward_quantized``: cuBLAS), then for the gated families
    Inductor's ``silu(gate) * up``."""
    glu = _gated(key.kernel)
    widths = (key.n, key.n) if glu else key.widths
    if not widths:
        raise TuneError(f"{key.kernel} site recorded without its outputs' widths: compile the model again")
    member, act_dtype = MEMBER_FAMILY[key.kernel], SUPPORTED_DTYPES[QUANT_ACTIVATION_DTYPE]
    make = functools.partial(_quantized_layer, member, key.k, bias=False, device=device, dtype=act_dtype)
    first = [make(n) for n in widths]
    copies = copies_to_defeat_l2(sum(b.nbytes for layer in first for b in layer.buffers()), device)
    layers = [first, *([make(n) for n in widths] for _ in range(copies - 1))]
    gen = torch.Generator(device=device).manual_seed(0)
    xs = [_randn(gen, device, act_dtype, key.m, key.k) for _ in range(copies)]
    program = _trace(first[0], xs[0], fuse_activation_quant=True).quant_program
    own = _layer_steps(_trace(first[0], xs[0], fuse_activation_quant=False))
    rows = [quantize_rows(program, x) for x in xs]
    calls = [[_quantized_call(member, layer, r, None, own, own, [], [], act_dtype) for layer in group]
             for group, r in zip(layers, rows)]

    def args(i: int) -> tuple[Any, ...]:
        group = calls[i % copies]
        return (group[0].x, [c.w_kn for c in group], [own] * len(group), [op for c in group for op in c.operands],
                [], act_dtype)

    if glu:
        steps = key.epilogue or (*own, SILU, UP_MUL)

        def glu_args(i: int) -> tuple[Any, ...]:
            x, (w, up), _, operands, _, _ = args(i)
            return x, w, up, operands

        def run(config: helion.Config, i: int) -> Output:
            x, w, up, operands = glu_args(i)
            return glu_gemm_helion(x, w, up, steps, operands, [], act_dtype, config, up_steps=own,
                                   kernel_family=key.kernel)

        def unfused_glu(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor, operands: list[torch.Tensor]) -> Output:
            return unfused(x, w, steps, operands, [], act_dtype, None, up, None, None, own)

        fn, fn_args = unfused_glu, glu_args
        to_table = functools.partial(FAMILIES[key.kernel].config_adapter, itemsize=1, normed=False)
        epilogue = steps
    else:
        def run(config: helion.Config, i: int) -> Output:
            return multi_gemm_helion(*args(i), config, kernel_family=key.kernel)

        fn, fn_args, to_table, epilogue = unfused_multi, args, FAMILIES[key.kernel].config_adapter, ()
    def separate(group: list[torch.nn.Module], quantized_rows: tuple[torch.Tensor, ...]) -> Output:
        outs = [layer.forward_quantized(*quantized_rows, act_dtype) for layer in group]
        return (torch.nn.functional.silu(outs[0]) * outs[1]).to(act_dtype) if glu else outs

    return Problem(
        run=run, reference=fn(*fn_args(0)),
        fallback=lambda: compiled(separate, lambda i: (layers[i % copies], rows[i % copies])),
        current=_current(key, device), epilogue=epilogue, to_table=to_table,
    )
