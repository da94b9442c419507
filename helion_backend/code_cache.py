"""Helion's generated code on disk, so that a new process launches a kernel without tracing it again.

``kernel.bind(args).compile_config(config)`` traces the kernel (0.3-0.5 s a signature), generates a Python
module (the Triton kernel and its host function) and imports it with Inductor's ``PyCodeCache``; the
callable it returns is that module's host function, named after the kernel. The module is self-contained:
it imports torch, triton, Helion's runtime and the kernel's source module, holds the shapes, strides and
config it was specialized on as literals, and takes the kernel's own arguments. So its source, stored under
everything it was generated from, is loaded in a later process exactly as ``compile_config`` loads it
(:meth:`Entry.load`), with no binding.

The key is :func:`.kernels.gemm.compiled_kernel`'s in-memory key (kernel, signature, config, K splits),
which covers what Helion specializes the code on within a process, plus what may differ between
processes: Helion's sources, the triton and torch versions, this package's sources (the kernels, the
epilogue, the norm), the device (name, compute capability, CUDA or HIP version) and Helion's settings
other than autotuning's. Only this package's kernels, on Helion's Triton backend, are stored. With the
same key, two processes generate byte-identical code (checked for all 153 kernels of
``tests/test_kernel_interpret.py`` under other hash seeds and test orders).

An entry is a JSON file (``{"version", "key", "source", "sha256"}``) replaced atomically. One that cannot be
read, holds another key, fails its checksum or does not load costs a warning naming the file; the caller
then binds as without the cache, and its fresh entry replaces the bad one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from helion_backend.environment import package_digest, source_digest
from helion_backend.jsonfile import write_json_atomic
from helion_backend.options import BackendOptions

if TYPE_CHECKING:
    import helion

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_PACKAGE = __name__.rpartition(".")[0]

# Where entries live (None: the cache is off). Kernels compile when they first run, after and outside the
# compile that placed them, so the latest compile's options apply (:func:`configure`); until one, the defaults.
_directory: Path | None = None
_configured = False


def configure(options: BackendOptions) -> None:
    """Use ``options``' code cache folder, or none, for the kernels this process compiles from now on."""
    global _directory, _configured
    _directory = None if options.code_cache_dir is None else Path(options.code_cache_dir)
    _configured = True


def directory() -> Path | None:
    """The folder of this process's entries; None when the cache is off."""
    if not _configured:
        configure(BackendOptions())
    return _directory


class Entry:
    """The stored code of one compiled kernel: its file and the full key it must hold."""

    def __init__(self, path: Path, key: str, kernel: helion.Kernel, device: torch.device) -> None:
        self.path, self.key, self.kernel, self.device = path, key, kernel, device

    def load(self) -> Callable[..., None] | None:
        """The host function, loaded as ``compile_config`` loads it; None when there is no usable entry."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        try:
            return self._load_module(self._checked_source(json.loads(text)))
        except Exception as e:  # whatever a bad entry raises, binding is the answer
            log.warning("helion_inductor: ignoring the kernel code cache entry %s (%s: %s)",
                        self.path, type(e).__name__, e)
            return None

    def store(self, module_path: str | None) -> None:
        """Keep the source of the module ``compile_config`` loaded (at ``module_path``); never fails the call."""
        if module_path is None:
            return
        try:
            source = Path(module_path).read_text()
            write_json_atomic(self.path, {"version": FORMAT_VERSION, "key": self.key, "source": source,
                                          "sha256": _sha256(source)})
        except OSError as e:
            log.warning("helion_inductor: cannot write the kernel code cache entry %s (%s)", self.path, e)

    def _checked_source(self, data: Any) -> str:
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or data.get("key") != self.key:
            raise ValueError("not an entry of this format and key")
        source = data.get("source")
        if not isinstance(source, str) or data.get("sha256") != _sha256(source):
            raise ValueError("the source does not match its checksum")
        return source

    def _load_module(self, source: str) -> Callable[..., None]:
        """What ``BoundKernel.compile_config`` does after generating the code (helion 1.4, Triton backend)."""
        from helion._compiler.backend_registry import get_backend_class
        from torch._inductor.codecache import PyCodeCache

        backend = get_backend_class(self.kernel.settings.backend)()
        # Triton's cache folder, as compile_config sets it: the compiled binaries of earlier processes are there.
        backend.setup_compile_cache_dir(self.device.index or 0)
        module = PyCodeCache.load(source)
        backend.annotate_compiled_module(module, source, self.kernel.name)
        run = getattr(module, self.kernel.name)
        if not callable(run):
            raise TypeError(f"{self.kernel.name} in the entry is not a function")
        return run


def entry(kernel: helion.Kernel, key: Hashable, args: tuple[object, ...]) -> Entry | None:
    """The entry of ``kernel`` compiled under the in-memory ``key`` for ``args``; None when the cache is off
    or the kernel is not one it stores."""
    folder = directory()
    device = next((arg.device for arg in args if isinstance(arg, torch.Tensor)), None)
    if folder is None or device is None or not _storable(kernel):
        return None
    text = repr((FORMAT_VERSION, key, _environment(kernel, device)))
    if " at 0x" in text:  # an object without a value repr: the key would name this process's object
        return None
    return Entry(folder / f"{kernel.name}-{_sha256(text)[:32]}.json", text, kernel, device)


def _storable(kernel: helion.Kernel) -> bool:
    """This package's kernels on the Triton backend: :func:`package_digest` covers their sources, and the
    Triton backend's module keeps no state of its own (Pallas modules are specialized per shape)."""
    return kernel.settings.backend == "triton" and kernel.fn.__module__.startswith(f"{_PACKAGE}.")


@functools.cache  # per kernel and device, on misses of the in-memory dict only
def _environment(kernel: helion.Kernel, device: torch.device) -> tuple[object, ...]:
    """What the generated code depends on besides the in-memory key, and may differ between processes."""
    import triton

    settings = sorted((name, repr(value)) for name, value in kernel.settings.to_dict().items()
                      if not name.startswith("autotune"))  # autotuning's hold a per-process random seed
    return (("helion", _helion_digest()), ("triton", triton.__version__), ("torch", torch.__version__),
            ("package", package_digest()), ("device", _device_identity(device)), ("settings", tuple(settings)))


@functools.cache  # 15 ms, once per process
def _helion_digest() -> str:
    """Helion's sources, which generate the code (an edited or development install keeps its version)."""
    import helion

    return source_digest(Path(helion.__file__).resolve().parent)


def _device_identity(device: torch.device) -> tuple[object, ...]:
    """The hardware and runtime the code was generated for (Helion specializes on the compute capability)."""
    if device.type != "cuda":
        return (device.type,)
    props = torch.cuda.get_device_properties(device)
    return (device.type, props.name, (props.major, props.minor), getattr(props, "gcnArchName", None),
            torch.version.cuda, torch.version.hip)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
