"""What this process runs on and what its code is: whether Helion kernels can run here, and digests of
source trees, which are the identity of compiled graphs and of cached kernels. Imports neither Helion nor
Triton, so the compile side can ask."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

import torch


@functools.cache
def helion_unavailable_reason() -> str | None:
    """None when Helion kernels can run here, else why not (shown in the report)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("helion") is None:
        return "helion is not installed"
    return None


def source_digest(root: Path) -> str:
    """sha256 of the Python sources under ``root`` (paths and contents, in a stable order)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache  # once per process: the sources do not change under a running compile
def package_digest() -> str:
    """The digest of this package's sources, every subpackage included: the passes decide what a cached
    graph holds, and the kernels what cached code holds."""
    return source_digest(Path(__file__).resolve().parent)
