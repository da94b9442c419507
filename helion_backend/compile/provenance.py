"""Where a graph node came from in the user's model: its module path and source line.

Dynamo records, on every node it traces, the stack of ``nn.Module`` calls it sits in
(``meta["nn_module_stack"]``) and the Python stack that made it (``meta["stack_trace"]``); AOTAutograd and
Inductor's decompositions carry both to the post-grad graph. The report names sites by them, and the rewrite
copies them to the nodes it inserts so that dumps and Inductor's generated code point back to the model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch.fx as fx

# What a node inserted in place of others keeps of theirs: the model's trace, never what the node computes
# (``val``, ``original_aten`` and such describe the replaced op).
ORIGIN_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
# Dynamo names the compiled module's locals as ``L['self']`` (globals ``G[...]``); the attribute path after it
# is the module's, with ``._modules['0']`` where it indexed a container.
_ROOT = re.compile(r"^[A-Z]\['[^']*'\]\.?")
_CONTAINER_ITEM = re.compile(r"\._modules\['([^']*)'\]")


def module_path(node: fx.Node) -> str:
    """The innermost module ``node`` was traced in, as ``model.named_modules()`` names it ("" at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    innermost = list(stack.values())[-1]
    path = str(innermost[0] if isinstance(innermost, tuple) else innermost)
    return _ROOT.sub("", _CONTAINER_ITEM.sub(r".\1", path))


def source_line(node: fx.Node) -> str:
    """``file.py:line`` of the innermost frame that made ``node`` ("" when the graph kept no trace)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    file, line = frames[-1]
    return f"{Path(file).name}:{line}"


def model_location(*nodes: fx.Node) -> tuple[str, str]:
    """The module path and source line of the first of ``nodes`` that has them."""
    module = next((path for path in map(module_path, nodes) if path), "")
    source = next((line for line in map(source_line, nodes) if line), "")
    return module, source


def keep_origin(new: fx.Node, old: fx.Node) -> None:
    """Give ``new`` (a node inserted for ``old``'s work) ``old``'s trace of the model."""
    for key in ORIGIN_KEYS:
        if key in old.meta and key not in new.meta:
            new.meta[key] = old.meta[key]
