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
from helion_backend import dispatch, tuning_problems  # noqa: E402
from helion_backend.kernels.gemm import glu_kernel_config  # noqa: E402
from helion_backend.timing import TimingConfig  # noqa: E402
from helion_backend.tuning import TuneKey  # noqa: E402


def test_gated_family_is_a_choice_and_sweeps_the_gate_up_shapes(capsys):
    with pytest.raises(SystemExit) as stopped:  # --help exits after --kernel is checked, before any GPU is needed
        sweep.main(["--kernel", "gemm_glu", "--m", "1,8,32", "--help"])
    assert stopped.value.code == 0 and "gemm_glu" in capsys.readouterr().out
    assert sweep.GLU_SHAPES == {(4096, 12288), (5120, 25600)}
    keys = sweep.sweep_keys("gemm_glu", ["qwen3_8b"], [1])
    assert [(k.k, k.n, k.epilogue) for k in keys] == [(4096, 12288, ("silu", "up_mul"))]


def test_keys_of_each_family_are_what_a_compile_records():
    one_row, rows = sweep.sweep_keys("gemm_multi", ["qwen3_8b"], [1, 8])
    assert (one_row.widths, one_row.n, one_row.prologue) == ((4096, 1024, 1024), 6144, ("rmsnorm",))
    # Above rmsnorm_prologue_max_m the compile leaves the norm to Inductor, so the sweep times the plain launch.
    assert (rows.m, rows.prologue) == (8, ())
    fp8 = sweep.sweep_keys("gemm_fp8", ["qwen3_8b"], [1])[0]  # reading the rows Inductor quantized (the default)
    assert (fp8.dtype, fp8.prologue, fp8.epilogue) == (
        "float8_e4m3fn", (), ("token_scale", "channel_scale", "bias", "gelu_tanh"))


@pytest.mark.parametrize("m", [1, 32])
def test_gated_candidates_are_the_configs_the_kernel_runs(m):
    candidates = sweep.glu_candidates(m, 12288)
    assert len(set(candidates)) == len(candidates) > 1
    assert all("split_k" not in c and glu_kernel_config(c, 2, False) == c for c in candidates)


def test_gated_key_checks_times_and_records_an_entry(monkeypatch):
    configs = []

    def reference_kernel(family, x, w_kn, steps, operands, scalars, out_dtype, config_dir, program, up_kn, *,
                         weight_scale, norm, config):
        configs.append(config)
        return dispatch.unfused(x, w_kn, steps, operands, scalars, out_dtype, program, up_kn, weight_scale, norm)

    monkeypatch.setattr(tuning_problems, "run_kernel", reference_kernel)
    monkeypatch.setattr(sweep, "TIMING", TimingConfig(warmup_calls=1, calls_per_graph=1, warmup_replays=0, replays=1))
    key = TuneKey("gemm_glu", sweep.GLU_STEPS, "bfloat16", 64, 48, 3)
    entry = sweep.sweep_key(key, torch.device("cpu"))
    assert entry is not None, "every candidate was off the float64 reference"
    assert {key: entry[key] for key in ("kernel", "dtype", "k", "n", "m", "epilogue")} == {
        "kernel": "gemm_glu", "dtype": "bfloat16", "k": 64, "n": 48, "m": 3, "epilogue": ["silu", "up_mul"]}
    assert entry["us"] > 0 and entry["fallback_us"] > 0 and entry["candidates"] == len(sweep.glu_candidates(3, 48))
    assert helion.Config(**entry["config"]) in configs
