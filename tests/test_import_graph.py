"""The package's dependencies run one way: options and vocabulary at the bottom, the compile side apart from
Helion and the run time, the run time on the kernels, tuning and the commands on top.

The graph is read from the sources (ast), so it holds every ``helion_backend`` import, at module level,
under ``TYPE_CHECKING`` or inside a function, without importing anything. A function-level import counts
like any other: one that only dodged a cycle would show up as the cycle.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "helion_backend"

# Modules below the compile side and the run time: both may import them, they import neither.
BOTTOM = ("version", "vocabulary", "options", "jsonfile", "environment", "policy", "tables", "report", "manifest",
          "logs", "semantics")
HELION = ("helion", "triton")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # a helion_backend module, or a third-party top-level name
    kind: str  # "module", "type-checking" or "function"
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, source: str) -> str:
    if not node.level:
        return node.module or ""
    package = source.split(".") if MODULES[source].name == "__init__.py" else source.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _targets(node: ast.Import | ast.ImportFrom, source: str) -> Iterator[str]:
    """The modules an import statement loads: ``from a import b`` loads ``a.b`` where that is a module."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = _absolute(node, source)
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(source: str) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(Import(source, target, kind, child.lineno) for target in _targets(child, source))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child) and kind == "module":
                visit(child, "type-checking")
            else:
                visit(child, kind)

    visit(ast.parse(MODULES[source].read_text()), "module")
    return found


GRAPH = {source: imports_of(source) for source in MODULES}


def internal(source: str) -> list[Import]:
    return [i for i in GRAPH[source] if i.target == "helion_backend" or i.target.startswith("helion_backend.")]


def in_area(module: str, *areas: str) -> bool:
    return any(module == f"helion_backend.{a}" or module.startswith(f"helion_backend.{a}.") for a in areas)


def violations(sources: list[str], forbidden_areas: tuple[str, ...] = (), third_party: tuple[str, ...] = ()) -> list[str]:
    bad = []
    for source in sources:
        for i in GRAPH[source]:
            top = i.target.split(".")[0]
            if in_area(i.target, *forbidden_areas) or top in third_party:
                bad.append(f"{source}:{i.line} imports {i.target} ({i.kind})")
    return bad


def test_every_internal_import_names_a_module_of_the_package():
    """A stale path would import another copy of the package (an editable install's) instead of failing."""
    missing = [f"{source}:{i.line} imports {i.target}" for source in MODULES for i in internal(source)
               if i.target not in MODULES]
    assert not missing, missing


def test_no_import_cycle_inside_the_package():
    edges = {source: sorted({i.target for i in internal(source) if i.target in MODULES}) for source in MODULES}
    state: dict[str, str] = {}
    stack: list[str] = []

    def walk(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for target in edges[module]:
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := walk(target)) is not None:
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in MODULES:
        if module not in state:
            cycle = walk(module)
            assert cycle is None, " -> ".join(cycle)


def test_the_root_package_is_imported_by_no_module_of_its_own():
    """``helion_backend/__init__`` imports the backend: a module importing a name from it would close a cycle."""
    assert [f"{s}:{i.line}" for s in MODULES for i in internal(s) if i.target == "helion_backend"] == []


def test_the_compile_side_and_the_bottom_import_neither_helion_nor_the_run_time():
    sources = [m for m in MODULES if in_area(m, "compile", *BOTTOM)]
    assert "helion_backend.compile.manager" in sources and "helion_backend.tables" in sources
    assert violations(sources, ("runtime", "kernels", "tuning", "tools", "layers", "backend", "code_cache"),
                      HELION) == []


def test_the_bottom_does_not_import_the_compile_side():
    sources = [m for m in MODULES if in_area(m, *BOTTOM)]
    assert violations(sources, ("compile",)) == []


def test_the_run_time_imports_neither_the_compile_side_nor_tuning():
    sources = [m for m in MODULES if in_area(m, "runtime")]
    assert "helion_backend.runtime.dispatch" in sources
    assert violations(sources, ("compile", "tuning", "tools", "backend")) == []


def test_the_kernels_import_neither_the_compile_side_nor_the_run_time_nor_tuning():
    sources = [m for m in MODULES if in_area(m, "kernels", "code_cache")]
    assert "helion_backend.kernels.gemm" in sources
    assert violations(sources, ("compile", "runtime", "tuning", "tools", "backend")) == []


def test_the_registry_rows_late_paths_lead_to_kernels_and_tuning_only():
    """A family's row names its kernel and config adapter (kernels, loaded with Helion) and its tuning problem
    and candidates (tuning, the layer above) by ``"module:attribute"`` paths, which the graph above cannot see:
    each must name an attribute the module defines, and none may lead to the compile side or the run time."""
    from helion_backend.kernels.family import FAMILIES

    paths = {getattr(row, field) for row in FAMILIES.values() for field in
             ("kernel_path", "config_adapter_path", "problem_path", "candidates_path") if getattr(row, field)}
    targets = {}
    for path in paths:
        module, _, attribute = path.partition(":")
        target = f"helion_backend.{module}"
        assert target in MODULES, f"{path}: no module {target}"
        defined = {node.name for node in ast.parse(MODULES[target].read_text()).body
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        assert attribute in defined, f"{path}: {target} defines no {attribute}"
        targets[path] = target
    assert {t for t in targets.values() if not in_area(t, "kernels", "tuning")} == set()
    assert any(in_area(t, "tuning") for t in targets.values()) and any(in_area(t, "kernels") for t in targets.values())


def test_the_quantized_layers_stand_apart():
    """A user layer needs torch and the vocabulary's names, nothing of the backend."""
    for source in (m for m in MODULES if in_area(m, "layers")):
        assert {i.target for i in internal(source)} <= {"helion_backend.vocabulary", "helion_backend.layers.quantize"}
        assert violations([source], third_party=HELION) == []


def test_function_level_imports_are_only_lazy_loads_of_heavy_modules():
    """What is imported inside a function: Helion, Triton and the kernels (their import takes seconds), the
    tuner from the backend (it imports Helion) and the compile side from a tuning problem (tuning's worker
    processes import problems.py); anything else belongs at the top of its module."""
    lazy = {f"{s} -> {i.target}" for s in MODULES for i in GRAPH[s] if i.kind == "function"
            and i.target.split(".")[0] in ("helion_backend", *HELION)}
    heavy = [entry for entry in lazy if entry.split(" -> ")[1].split(".")[0] in HELION
             or in_area(entry.split(" -> ")[1], "kernels")
             or entry in ("helion_backend.backend -> helion_backend.tuning.loop",
                          "helion_backend.tuning.problems -> helion_backend.compile.trace")]
    assert sorted(lazy) == sorted(heavy)


def test_importing_the_package_and_reading_a_config_table_do_not_import_helion():
    """The compile side places sites from the JSON tables; Helion loads only when a kernel runs (Triton is
    torch's own: Inductor imports it)."""
    check = ("import sys, helion_backend, helion_backend.compile.passes; from helion_backend import tables; "
             "assert tables._table('nvidia_h200'); print([m for m in sys.modules if m.split('.')[0] == 'helion'])")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_no_pass_imports_another_pass():
    """Passes talk through the PassContext; what two of them need lives in a helper module."""
    passes = [m for m in MODULES if m.startswith("helion_backend.compile.passes.")]
    assert len(passes) == 10
    crossing = [f"{s}:{i.line} imports {i.target}" for s in passes for i in internal(s)
                if i.target.startswith("helion_backend.compile.passes") and i.target != s]
    assert crossing == []
