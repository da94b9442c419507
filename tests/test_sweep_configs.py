"""benchmarks/sweep_gemm_configs.py on the CPU: its arguments, and the gated kernel's sweep of one key end to
end with the kernel replaced by the reference (the sweep itself times Helion kernels on a GPU)."""

import sys
from pathlib import Path

import helion
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import sweep_gemm_configs as sweep  # noqa: E402
from helion_backend import dispatch  # noqa: E402
from helion_backend.kernels.gemm import glu_kernel_config  # noqa: E402
from helion_backend.timing import TimingConfig  # noqa: E402


def test_gated_family_is_a_choice_and_sweeps_the_gate_up_shapes(capsys):
    with pytest.raises(SystemExit) as stopped:  # --help exits after --kernel is checked, before any GPU is needed
        sweep.main(["--kernel", "gemm_glu", "--m", "1,8,32", "--help"])
    assert stopped.value.code == 0 and "gemm_glu" in capsys.readouterr().out
    assert sweep.GLU_SHAPES == {(4096, 12288), (5120, 25600)}
    assert sweep.sweep_glu_key(4096, 4096, 1, torch.device("cpu")) is None  # q/o: not swept


@pytest.mark.parametrize("m", [1, 32])
def test_gated_candidates_are_the_configs_the_kernel_runs(m):
    candidates = sweep.glu_candidates(m, 12288)
    assert len(set(candidates)) == len(candidates) > 1
    assert all("split_k" not in c and glu_kernel_config(c, 2, False) == c for c in candidates)


def test_gated_key_checks_times_and_records_an_entry(monkeypatch):
    configs = []

    def reference_kernel(x, w_kn, up_kn, steps, operands, scalars, out_dtype, config):
        configs.append(config)
        return dispatch.reference(x, w_kn, steps, operands, scalars, out_dtype, None, up_kn)

    monkeypatch.setattr(sweep, "glu_gemm_helion", reference_kernel)
    monkeypatch.setattr(sweep, "GLU_SHAPES", {(64, 48)})
    monkeypatch.setattr(sweep, "TIMING", TimingConfig(warmup_calls=1, calls_per_graph=1, warmup_replays=0, replays=1))
    entry = sweep.sweep_glu_key(64, 48, 3, torch.device("cpu"))
    assert entry is not None, "every candidate was off the float64 reference"
    assert {key: entry[key] for key in ("kernel", "dtype", "k", "n", "m", "epilogue")} == {
        "kernel": "gemm_glu", "dtype": "bfloat16", "k": 64, "n": 48, "m": 3, "epilogue": ["silu", "up_mul"]}
    assert entry["us"] > 0 and entry["fallback_us"] > 0 and entry["candidates"] == len(sweep.glu_candidates(3, 48))
    assert helion.Config(**entry["config"]) in configs
