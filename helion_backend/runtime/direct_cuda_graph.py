"""Replay a compiled graph as one CUDA graph with a short host path (option ``cudagraph_runner="direct"``).

Under Inductor's cudagraph trees every call of a compiled decode step spends much of its host time in the tree
(its invariant checks, input copies and output bookkeeping) and in AOTAutograd's wrapper around Inductor's code;
serving engines skip both by capturing the step once and replaying it. :class:`DirectCudaGraph` does that for one
compiled graph: a call at a new input signature runs the graph as it is and checks that replaying it would be
exact; the next call at that signature captures it on copies of the inputs that may move (everything but
parameters, buffers and ``mark_static_address`` tensors); every later call checks that the static inputs are
where they were, copies the others in, replays, and returns copies of the outputs, so that an output kept across
calls is never overwritten by the next replay.

A graph is not replayed (it runs as compiled, with no CUDA graph, and the reason is logged and reported) where a
replay could differ from the call: an input off the GPU or with overlapping memory, an input that is not static
and that the graph writes to, random numbers drawn, an output that needs gradients, is a view of an input or shares
memory with another output, or a capture that fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from helion_backend.cuda_graphs import stream_capturing

log = logging.getLogger(__name__)

# Input signatures with a captured graph each, and captures again of one signature (its static inputs moved)
# before that signature runs without a graph: beyond these a graph costs more memory or host time than it saves.
MAX_GRAPHS = 8
MAX_RECAPTURES = 2


class Replayable(Protocol):
    def replay(self) -> None: ...


# The C++ check of data pointers that cudagraph trees use (CUDA builds of torch only): (inputs, each input's pointer
# or None, the indices to check) -> whether all are equal.
_DATA_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

# Records one call of a function on fixed inputs: (the graph, the call's outputs, which its replays rewrite).
Recorder = Callable[[Callable[[], Any]], tuple[Replayable, Any]]


def record_cuda_graph(call: Callable[[], Any]) -> tuple[Replayable, Any]:
    """``call`` captured in a ``torch.cuda.CUDAGraph`` (on a side stream, in a memory pool of its own)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = call()
    return graph, outputs


def is_static_input(value: Any) -> bool:
    """A tensor whose memory stays put from call to call, so a graph may read it where it is: a parameter, or a
    tensor Dynamo marked static (a module's buffer or tensor attribute, or ``torch._dynamo.mark_static_address``)."""
    return isinstance(value, torch.nn.Parameter) or getattr(value, "_dynamo_static_input_type", None) is not None


@dataclass(frozen=True)
class _Layout:
    """Which of a compiled graph's inputs are static tensors (read where they are), other tensors (copied into
    the graph's own) and other values (ints: part of the signature). The same at every call, as Dynamo passes
    the same sources in the same places; taken from the first call."""

    static: list[int]
    copied: list[int]
    values: list[int]

    @classmethod
    def of(cls, args: Sequence[Any]) -> _Layout:
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        static = [i for i in tensors if is_static_input(args[i])]
        return cls(static, [i for i in tensors if i not in static], [i for i, a in enumerate(args) if i not in tensors])

    def signature(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """What one capture holds fixed beyond Dynamo's guards: the shapes and strides of the copied tensors (a
        dynamic dimension), and the other values."""
        return (*((args[i].shape, args[i].stride()) for i in self.copied), *(args[i] for i in self.values))

    def shapes(self, args: Sequence[Any]) -> str:
        return str([list(args[i].shape) for i in self.copied])


@dataclass
class _Entry:
    """One input signature's graph: the inputs it reads (the static ones themselves, copies of the others), its
    outputs, which each replay rewrites, and where the static inputs were."""

    graph: Replayable | None = None
    inputs: list[Any] = field(default_factory=list)
    outputs: Any = None
    static_ptrs: list[int | None] = field(default_factory=list)  # per input: its data pointer if static, else None
    captures: int = 0

    def static_inputs_unmoved(self, args: Sequence[Any], static: list[int]) -> bool:
        if _DATA_PTRS_EQUAL is not None:
            return _DATA_PTRS_EQUAL(list(args), self.static_ptrs, static)
        return all(args[i].data_ptr() == self.static_ptrs[i] for i in static)


class DirectCudaGraph:
    """``compiled`` replayed as one CUDA graph per input signature (the module docstring says when it is not).
    ``on_event`` hears each decision, once, as text (the backend adds it to the graph's report); ``recorder`` and
    ``requires_cuda`` exist for the CPU tests, which replay a recording of the call instead of a CUDA graph."""

    def __init__(self, compiled: Callable[..., Any], on_event: Callable[[str], None] = lambda text: None,
                 recorder: Recorder = record_cuda_graph, requires_cuda: bool = True) -> None:
        self.compiled = compiled
        self.on_event = on_event
        self.recorder = recorder
        self.requires_cuda = requires_cuda
        self.layout: _Layout | None = None
        self.entries: dict[tuple[Any, ...], _Entry | None] = {}  # None: that signature runs without a graph
        self.disabled: str | None = None

    def __call__(self, *args: Any) -> Any:
        if self.disabled is not None or stream_capturing():
            return self.compiled(*args)
        if self.layout is None:
            self.layout = _Layout.of(args)
        key = self.layout.signature(args)
        if key not in self.entries:
            return self._first_call(key, args)
        entry = self.entries[key]
        if entry is None:
            return self.compiled(*args)
        if entry.graph is None or not entry.static_inputs_unmoved(args, self.layout.static):
            if not self._capture(key, entry, args):
                return self.compiled(*args)
        else:
            self._copy_inputs(entry, args)
        entry.graph.replay()
        return _copies(entry.outputs)

    def _first_call(self, key: tuple[Any, ...], args: Sequence[Any]) -> Any:
        """Run the graph as compiled, and keep the signature for a capture at its next call if a replay would
        compute what this call did."""
        reason = self._unsafe_inputs(args)
        if reason is not None:
            self._disable(reason)
            return self.compiled(*args)
        if sum(entry is not None for entry in self.entries.values()) >= MAX_GRAPHS:
            self._without_graph(key, f"not replayed at input shapes {self.layout.shapes(args)}: {MAX_GRAPHS} "
                                     "signatures already have a graph")
            return self.compiled(*args)
        copied = self.layout.copied
        versions = [args[i]._version for i in copied]
        devices = sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda}, key=str)
        rng = _rng_states(devices)
        outputs = self.compiled(*args)
        reason = (_mutated_copy(args, copied, versions) or _random(rng, devices)
                  or _unreplayable_outputs(outputs, args))
        if reason is not None:
            self._disable(reason)
            return outputs
        self.entries[key] = _Entry()
        return outputs

    def _unsafe_inputs(self, args: Sequence[Any]) -> str | None:
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if self.requires_cuda and (len(devices) > 1 or any(d.type != "cuda" for d in devices)):
            return f"its inputs are on {', '.join(sorted(map(str, devices)))}, not one GPU"
        for i in self.layout.copied:
            if not _dense(args[i]):
                return (f"input {i} (shape {list(args[i].shape)}, strides {list(args[i].stride())}) overlaps itself "
                        "in memory")
        return None

    def _capture(self, key: tuple[Any, ...], entry: _Entry, args: Sequence[Any]) -> bool:
        """Capture the graph on this call's static inputs and on copies of the others; False where the signature
        runs without a graph from now on."""
        shapes = self.layout.shapes(args)
        if entry.captures >= 1 + MAX_RECAPTURES:
            self._without_graph(key, f"not replayed at input shapes {shapes}: its static inputs moved "
                                     f"{MAX_RECAPTURES} times")
            return False
        entry.graph = entry.outputs = None
        inputs = list(args)
        for i in self.layout.copied:
            inputs[i] = _fresh_copy(args[i])
        try:
            graph, outputs = self.recorder(lambda: self.compiled(*inputs))
        except Exception as e:  # any capture failure leaves the graph to run as compiled
            self._without_graph(key, f"not replayed: its capture failed ({type(e).__name__}: {e})")
            return False
        entry.graph, entry.inputs, entry.outputs = graph, inputs, outputs
        static = set(self.layout.static)
        entry.static_ptrs = [a.data_ptr() if i in static else None for i, a in enumerate(args)]
        entry.captures += 1
        self.on_event(f"captured at input shapes {shapes}" if entry.captures == 1 else
                      f"captured again at input shapes {shapes}: a static input moved")
        return True

    def _copy_inputs(self, entry: _Entry, args: Sequence[Any]) -> None:
        pairs = [(entry.inputs[i], args[i]) for i in self.layout.copied if args[i] is not entry.inputs[i]]
        if pairs:
            torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        log.info("helion_inductor: a graph runs without a CUDA graph: %s", reason)
        self.on_event(f"not replayed: {reason}")

    def _without_graph(self, key: tuple[Any, ...], text: str) -> None:
        """This signature runs as compiled from now on."""
        self.entries[key] = None
        log.info("helion_inductor: a graph's signature runs without a CUDA graph: %s", text)
        self.on_event(text)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill their memory once each, in some order of its dims (so that a copy with its
    strides holds it)."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _fresh_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (the compiled code asserts them)."""
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t)


def _rng_states(devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """The CPU's generator state and that of each of ``devices`` (CUDA)."""
    return [torch.random.get_rng_state(), *(torch.cuda.get_rng_state(device) for device in devices)]


def _random(before: list[torch.Tensor], devices: Sequence[torch.device]) -> str | None:
    after = _rng_states(devices)
    if any(not torch.equal(a, b) for a, b in zip(after, before)):
        return "it draws random numbers, which a replay would draw again from the captured state"
    return None


def _mutated_copy(args: Sequence[Any], copied: list[int], versions: list[int]) -> str | None:
    for i, version in zip(copied, versions):
        if args[i]._version != version:
            return (f"it writes to input {i} (shape {list(args[i].shape)}), which is not a static input, so a replay "
                    "would write to its copy")
    return None


def _unreplayable_outputs(outputs: Any, args: Sequence[Any]) -> str | None:
    if not isinstance(outputs, (list, tuple)):
        return f"it returns a {type(outputs).__name__}, not a list of outputs"
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    seen: dict[int, int] = {}  # storage -> the first output in it
    for i, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            continue
        if out.requires_grad:
            return f"output {i} requires grad (a training graph)"
        storage = out.untyped_storage().data_ptr()
        if storage in inputs:
            return f"output {i} is a view of an input"
        if storage in seen:
            return f"outputs {seen[storage]} and {i} share memory, which copies of them would not"
        seen[storage] = i
    return None


def _copies(outputs: Sequence[Any]) -> Any:
    """The replay's outputs, copied out of the graph's memory (the next replay rewrites it)."""
    return type(outputs)(o.clone() if isinstance(o, torch.Tensor) else o for o in outputs)
