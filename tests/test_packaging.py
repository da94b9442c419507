"""The package as a wheel installs it: the shipped rules and the tuned config tables are package data, and an
installed copy finds them through the package, not through a checkout."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a wheel build reads from the checkout.
BUILD_INPUTS = ("setup.cfg", "pyproject.toml", "README.md", "helion_inductor.py", "rules")

FIND_RULES = """
import json, helion_backend
from helion_backend.compile.rules import builtin_rule_files, load_rules
files = builtin_rule_files()
print(json.dumps({"package": helion_backend.__file__, "files": [str(p) for p in files],
                  "rules": sorted(r.name for r in load_rules(files))}))
"""


def build_wheel(tmp_path: Path) -> Path:
    """A wheel built from a copy of the checkout (the build writes into its source tree), offline."""
    pytest.importorskip("setuptools")
    source = tmp_path / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, source / name)
    shutil.copytree(ROOT / "helion_backend", source / "helion_backend", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


@pytest.mark.slow  # a wheel build and a fresh interpreter: about 10 s alone, more on a loaded machine
def test_the_wheel_holds_the_rules_and_tables_and_an_installed_copy_loads_its_own(tmp_path):
    wheel = build_wheel(tmp_path)
    shipped = {f"helion_backend/builtin_rules/{p.name}": p for p in sorted((ROOT / "rules").glob("*.toml"))}
    tables = {f"helion_backend/kernels/tuned/{p.name}": p
              for p in sorted((ROOT / "helion_backend" / "kernels" / "tuned").glob("*.json"))}
    assert shipped and tables
    sources = {path.relative_to(ROOT).as_posix() for path in (ROOT / "helion_backend").rglob("*.py")}
    assert {"helion_backend/compile/passes/match.py", "helion_backend/runtime/ops.py"} <= sources
    with zipfile.ZipFile(wheel) as archive:
        for member, original in {**shipped, **tables}.items():
            assert archive.read(member) == original.read_bytes(), member
        # Every module of every subpackage.
        assert sources <= set(archive.namelist()), sorted(sources - set(archive.namelist()))
        site = tmp_path / "site"
        archive.extractall(site)  # a pure-Python wheel installed is its files on sys.path

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    result = subprocess.run([sys.executable, "-c", FIND_RULES], capture_output=True, text=True, timeout=300,
                            cwd=outside, env={**os.environ, "PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).is_relative_to(site)
    assert sorted(Path(f).name for f in found["files"]) == sorted(Path(m).name for m in shipped)
    assert all(Path(f).is_relative_to(site.resolve()) for f in found["files"]), found["files"]

    from helion_backend.compile.rules import load_rules

    assert found["rules"] == sorted(r.name for r in load_rules(shipped.values()))
