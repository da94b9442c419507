"""Compile time of the quickstart model: ``helion_inductor`` against ``torch.compile`` default.

    python benchmarks/compile_time.py [--out-dir DIR] [--repeats 2]

Each measurement is a fresh Python process with empty Inductor, Triton and backend caches (cold), then
a second process over the caches the first one filled (warm): the wall time of the first compiled call
(Dynamo, AOTAutograd, Inductor, Helion's kernel compiles, one run). Both variants compile without CUDA
graphs, so the figure is compilation, not graph recording. Writes ``<gpu>_compile_time.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.common import device_tag, run_metadata

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
VARIANTS = ("compile", "helion_inductor")

# Runs in the child process: build the quickstart block, time its first compiled call.
CHILD = """
import importlib.util, json, sys, time, torch
spec = importlib.util.spec_from_file_location("quickstart", sys.argv[1])
quickstart = importlib.util.module_from_spec(spec); spec.loader.exec_module(quickstart)
torch.manual_seed(0)
model = quickstart.MLPBlock(4096, 12288).to("cuda", torch.bfloat16).eval()
x = torch.randn(2, 4, 4096, device="cuda", dtype=torch.bfloat16)
if sys.argv[2] == "compile":
    compiled = torch.compile(model)
else:
    import helion_backend
    compiled = torch.compile(model, backend="helion_inductor", options={"cudagraphs": False})
torch.cuda.synchronize()
start = time.perf_counter()
with torch.no_grad():
    compiled(x)
torch.cuda.synchronize()
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


def first_call_seconds(variant: str, cache_root: Path) -> float:
    """Wall time of the first compiled call in a new process whose caches all live under ``cache_root``."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
        "TRITON_CACHE_DIR": str(cache_root / "triton"),
        "HELION_INDUCTOR_CACHE_DIR": str(cache_root / "backend"),
    }
    done = subprocess.run([sys.executable, "-c", CHILD, str(QUICKSTART), variant], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def measure(variant: str, repeats: int) -> dict[str, float]:
    """Median cold and warm first-call seconds over ``repeats`` fresh cache folders."""
    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="compile_time_") as root:
            cold.append(first_call_seconds(variant, Path(root)))
            warm.append(first_call_seconds(variant, Path(root)))
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}


def markdown(metadata: dict, results: dict[str, dict[str, float]]) -> str:
    ratio = {k: results["helion_inductor"][k] / results["compile"][k] for k in ("cold_s", "warm_s")}
    lines = [
        f"# Compile time of the quickstart model: {metadata['device']}",
        "",
        *(f"- {key}: `{metadata[key]}`" for key in ("command", "torch", "triton", "helion", "date")),
        "- first compiled call (wall seconds, median over fresh cache folders); `cold`: empty caches, "
        "`warm`: a second process over the caches the first one filled",
        "",
        "| variant | cold s | warm s |",
        "|---|---|---|",
        *(f"| {v} | {r['cold_s']:.2f} | {r['warm_s']:.2f} |" for v, r in results.items()),
        "",
        f"helion_inductor / torch.compile: cold {ratio['cold_s']:.2f}x, warm {ratio['warm_s']:.2f}x "
        "(target: at most 1.5x)",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--repeats", type=int, default=2, help="fresh cache folders per variant")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compile_time.py measures on a CUDA GPU; none is available")
    device = torch.device("cuda")
    metadata = run_metadata(device)
    results = {variant: measure(variant, args.repeats) for variant in VARIANTS}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{device_tag(device)}_compile_time"
    stem.with_suffix(".json").write_text(json.dumps({"metadata": metadata, "results": results}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(metadata, results))
    print(markdown(metadata, results))


if __name__ == "__main__":
    main(sys.argv[1:])
