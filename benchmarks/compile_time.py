"""Compile time of the quickstart model: ``helion_inductor`` against ``torch.compile`` default.

    python benchmarks/compile_time.py [--out-dir DIR] [--repeats 2] [--profile]

Each measurement is a fresh Python process with empty Inductor, Triton and backend caches (cold), then
a second process over the caches the first one filled (warm): the wall time from ``torch.compile`` (for
helion_inductor, from importing the backend, which imports Inductor as the first compiled call of the
other variant does) through the first compiled call (Dynamo, AOTAutograd, Inductor, Helion's kernel
compiles, one run). Both variants compile without CUDA graphs, so the figure is compilation, not graph
recording. Writes ``<gpu>_compile_time.json`` and ``.md``; with ``--profile``, also the functions that
took the warm first call's time, per variant (``<gpu>_compile_profile_<variant>.txt``, cProfile, and its
raw statistics beside it, ``.txt.prof``, for ``pstats``).
"""

from __future__ import annotations

import argparse
import importlib.util
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
import cProfile, importlib.util, json, pstats, sys, time, torch
spec = importlib.util.spec_from_file_location("quickstart", sys.argv[1])
quickstart = importlib.util.module_from_spec(spec); spec.loader.exec_module(quickstart)
torch.manual_seed(0)
model = quickstart.MLPBlock(4096, 12288).to("cuda", torch.bfloat16).eval()
x = torch.randn(2, 4, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
profile = cProfile.Profile() if sys.argv[3] else None
if profile:
    profile.enable()
start = time.perf_counter()
if sys.argv[2] == "compile":
    compiled = torch.compile(model)
else:
    import helion_backend
    compiled = torch.compile(model, backend="helion_inductor", options={"cudagraphs": False})
with torch.no_grad():
    compiled(x)
torch.cuda.synchronize()
seconds = time.perf_counter() - start
if profile:
    profile.disable()
    profile.dump_stats(sys.argv[3] + ".prof")
    with open(sys.argv[3], "w") as f:
        pstats.Stats(profile, stream=f).sort_stats("cumulative").print_stats(80)
print(json.dumps({"seconds": seconds}))
"""


def first_call_seconds(variant: str, cache_root: Path, profile_to: Path | None = None) -> float:
    """Wall time of the first compiled call in a new process whose caches all live under ``cache_root``;
    with ``profile_to``, its cProfile listing is written there."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
        "TRITON_CACHE_DIR": str(cache_root / "triton"),
        "HELION_INDUCTOR_CACHE_DIR": str(cache_root / "backend"),
    }
    done = subprocess.run([sys.executable, "-c", CHILD, str(QUICKSTART), variant, str(profile_to or "")],
                          env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def measure(variant: str, repeats: int, profile_to: Path | None = None) -> dict[str, float]:
    """Median cold and warm first-call seconds over ``repeats`` fresh cache folders; with ``profile_to``,
    one more warm call, profiled (the profiler slows it, so it is not one of the timed ones)."""
    cold, warm = [], []
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory(prefix="compile_time_") as root:
            cold.append(first_call_seconds(variant, Path(root)))
            warm.append(first_call_seconds(variant, Path(root)))
            if profile_to and repeat == 0:
                first_call_seconds(variant, Path(root), profile_to)
    return {"cold_s": statistics.median(cold), "warm_s": statistics.median(warm)}


def helion_bytecode_state() -> str:
    """Whether Helion's modules load from bytecode, as after a default ``pip install``: without it every
    process compiles Helion's sources again (the GPU image sets ``PYTHONDONTWRITEBYTECODE``)."""
    spec = importlib.util.find_spec("helion")
    if spec is None or spec.origin is None:
        return "helion not installed"
    cached = Path(importlib.util.cache_from_source(spec.origin)).exists()
    return "compiled" if cached else "not compiled: each process compiles Helion's sources"


def markdown(metadata: dict, results: dict[str, dict[str, float]]) -> str:
    ratio = {k: results["helion_inductor"][k] / results["compile"][k] for k in ("cold_s", "warm_s")}
    lines = [
        f"# Compile time of the quickstart model: {metadata['device']}",
        "",
        *(f"- {key}: `{metadata[key]}`" for key in ("command", "torch", "triton", "helion", "date")
          if key in metadata),
        f"- Helion's bytecode: `{metadata.get('helion_bytecode', 'not recorded')}`",
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
    parser.add_argument("--profile", action="store_true",
                        help="also write where a warm first call spends its time (cProfile), per variant")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compile_time.py measures on a CUDA GPU; none is available")
    device = torch.device("cuda")
    metadata = {**run_metadata(device), "helion_bytecode": helion_bytecode_state()}
    args.out_dir.mkdir(parents=True, exist_ok=True)

    def profile_path(variant: str) -> Path | None:
        return args.out_dir / f"{device_tag(device)}_compile_profile_{variant}.txt" if args.profile else None

    results = {variant: measure(variant, args.repeats, profile_path(variant)) for variant in VARIANTS}
    stem = args.out_dir / f"{device_tag(device)}_compile_time"
    stem.with_suffix(".json").write_text(json.dumps({"metadata": metadata, "results": results}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(metadata, results))
    print(markdown(metadata, results))


if __name__ == "__main__":
    main(sys.argv[1:])
