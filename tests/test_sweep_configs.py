"""benchmarks/sweep_gemm_configs.py on the CPU: its arguments, its keys, the manifest of them the tune command
reads, and the gated kernel's sweep of one key end to end with the kernel replaced by the reference (the sweep
itself times Helion kernels on a GPU)."""

import json
import sys
from pathlib import Path

import helion
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import sweep_gemm_configs as sweep  # noqa: E402
from helion_backend.__main__ import main as helion_main  # noqa: E402
from helion_backend.kernels.gemm import glu_kernel_config  # noqa: E402
from helion_backend.manifest import read_manifest  # noqa: E402
from helion_backend.runtime import dispatch  # noqa: E402
from helion_backend.tuning import loop as tuning  # noqa: E402
from helion_backend.tuning import problems as tuning_problems  # noqa: E402
from helion_backend.tuning.candidates import candidates_for, glu_candidates  # noqa: E402
from helion_backend.tuning.loop import DEFAULT_NUM_TOKENS, TuneKey, expand_keys  # noqa: E402
from helion_backend.tuning.timing import TimingConfig  # noqa: E402

SUITES = sweep.parse_args([]).suites  # the script's default: every model's suite


def test_gated_family_is_a_choice_and_sweeps_the_gate_up_shapes(capsys):
    with pytest.raises(SystemExit) as stopped:  # --help exits after --kernel is checked, before any GPU is needed
        sweep.main(["--kernel", "gemm_glu", "--m", "1,8,32", "--help"])
    assert stopped.value.code == 0 and "gemm_glu" in capsys.readouterr().out
    # Qwen3-8B's and -32B's, and the popular families' (Llama-3.1-8B's, Gemma-2-2B's among them); no other.
    assert {(4096, 12288), (5120, 25600), (4096, 14336), (2304, 9216)} <= sweep.GLU_SHAPES
    assert (4096, 4096) not in sweep.GLU_SHAPES and len(sweep.GLU_SHAPES) == 2 + 6  # Mistral shares Llama's
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
    candidates = glu_candidates(m, 12288)
    assert len(set(candidates)) == len(candidates) > 1
    assert all("split_k" not in c and glu_kernel_config(c, 2, False) == c for c in candidates)


def test_gated_key_checks_times_and_records_an_entry_with_the_sweep_effort(monkeypatch):
    configs = []

    def reference_kernel(family, x, w_kn, steps, operands, scalars, out_dtype, config_dir, program, up_kn, *,
                         weight_scale, norm, config):
        configs.append(config)
        return dispatch.unfused(x, w_kn, steps, operands, scalars, out_dtype, program, up_kn, weight_scale, norm)

    monkeypatch.setattr(tuning_problems, "run_kernel", reference_kernel)
    monkeypatch.setattr(tuning, "TIMING", TimingConfig(warmup_calls=1, calls_per_graph=1, warmup_replays=0, replays=1))
    key = TuneKey("gemm_glu", sweep.GLU_STEPS, "bfloat16", 64, 48, 3)
    entry = tuning.tune_key(key, torch.device("cpu"), effort="sweep", budget_s=None)  # as the script's loop calls it
    assert {key: entry[key] for key in ("kernel", "dtype", "k", "n", "m", "epilogue", "effort")} == {
        "kernel": "gemm_glu", "dtype": "bfloat16", "k": 64, "n": 48, "m": 3, "epilogue": ["silu", "up_mul"],
        "effort": "sweep"}
    candidates = set(glu_candidates(3, 48))
    assert entry["us"] > 0 and entry["fallback_us"] > 0 and entry["seconds"] >= 0
    assert entry["candidates"] == len(candidates | {tuning_problems.build_problem(key, torch.device("cpu")).current})
    assert candidates <= set(configs) and helion.Config(**entry["config"]) in configs


def test_every_swept_family_has_candidates_at_every_key():
    for kernel in sweep.KERNELS:
        for key in sweep.sweep_keys(kernel, SUITES, [1, 32]):
            assert candidates_for(key), key


@pytest.mark.parametrize("kernel", ["gemm_fp8", "gemm_int8"])
def test_prequantize_is_tried_only_where_the_site_quantizes_its_rows(kernel):
    """On rows Inductor quantized (the default), the wrapper ignores ``prequantize``: each config is timed once.
    A site that quantizes its own rows (``fuse_activation_quant``) tries both, the deep one-byte tiles quantized first."""
    from dataclasses import replace

    from helion_backend.kernels.configs import PREQUANTIZE
    from helion_backend.vocabulary import ACTIVATION_QUANT_STEPS

    default = sweep.sweep_keys(kernel, ["qwen3_8b"], [tuning_problems.GEMV_MAX_M + 1])[0]  # no GEMV form
    plain = candidates_for(default)
    assert not any(PREQUANTIZE in c for c in plain) and len(set(plain)) == len(plain)
    assert any(c["block_sizes"][2] == 1024 for c in plain)  # the one-byte tiles
    fused = candidates_for(replace(default, prologue=(ACTIVATION_QUANT_STEPS[torch.float8_e4m3fn if kernel ==
                                                                          "gemm_fp8" else torch.int8],)))
    quantized_first = [c for c in fused if c.get(PREQUANTIZE)]
    assert {helion.Config(**{k: v for k, v in c.items() if k != PREQUANTIZE}) for c in quantized_first} == set(plain)
    assert [c for c in fused if not c.get(PREQUANTIZE)] and all(
        c["block_sizes"][2] < 1024 for c in fused if not c.get(PREQUANTIZE))


def test_block_fp8_tries_one_group_blocks_and_prequantized_deeper_ones():
    """In-kernel quantization steps one group (B) at a time; with ``prequantize`` the K block is free, and the
    N block stays within one weight block (the kernel reads one block scale per K row)."""
    from helion_backend.kernels.configs import PREQUANTIZE
    from helion_backend.vocabulary import FP8_BLOCK

    candidates = candidates_for(sweep.sweep_keys("gemm_fp8_block", ["qwen3_8b"], [8])[0])
    in_kernel = [c for c in candidates if not c.get(PREQUANTIZE)]
    prequantized = [c for c in candidates if c.get(PREQUANTIZE)]
    assert in_kernel and all(c["block_sizes"][2] == FP8_BLOCK for c in in_kernel)
    assert any(c["block_sizes"][2] > FP8_BLOCK for c in prequantized)
    assert all(c["block_sizes"][1] <= FP8_BLOCK for c in prequantized)


@pytest.mark.parametrize("kernel", ["gemm_fp8", "gemm_int8", "gemm_glu_fp8", "gemm_multi_int8"])
def test_one_byte_gemms_try_64_row_tiles(kernel):
    """fp8 and int8 rows by fp8 and int8 weights also try 64-row tiles (Hopper's wgmma); at one row only the
    single GEMM, whose wrapper runs the row as two (Helion ignores the row block of one row). A float
    activation (weight-only int8) does not."""
    def row_blocks(family: str, m: int) -> set[int]:
        candidates = candidates_for(sweep.sweep_keys(family, ["qwen3_8b"], [m])[0])
        return {c["block_sizes"][0] for c in candidates if not c.get("gemv")}  # the GEMV's have a test of their own

    single = kernel in ("gemm_fp8", "gemm_int8")
    assert row_blocks(kernel, 2) == {16, 64} and row_blocks(kernel, 1) == ({16, 64} if single else {16})
    assert 64 not in row_blocks("gemm_weight_only", 2)


def test_int4_tries_each_block_with_both_activation_loads():
    from helion_backend.kernels.configs import PAIRED_LOADS, SWAP_AB

    candidates = candidates_for(sweep.sweep_keys("gemm_int4", ["qwen3_8b"], [8])[0])
    tiles = [c for c in candidates if not c.get(SWAP_AB) and not c.get("gemv")]
    paired = {helion.Config(**{k: v for k, v in c.items() if k != PAIRED_LOADS}) for c in tiles if c.get(PAIRED_LOADS)}
    assert paired and paired == {c for c in tiles if not c.get(PAIRED_LOADS)}


@pytest.mark.parametrize("m", [1, 8, 32])
def test_int4_tries_its_swapped_form_at_every_decode_m(m):
    """``swap_ab`` (``swapped_int4_gemm_kernel``) at every M, each of its tiles once (32-row ones from 17
    rows), K blocks in bytes."""
    from helion_backend.kernels.configs import SWAP_AB
    from helion_backend.tuning.candidates import INT4_SWAPPED_CANDIDATES

    swapped = [c for c in candidates_for(sweep.sweep_keys("gemm_int4", ["qwen3_8b"], [m])[0]) if c.get(SWAP_AB)]
    tried = [(*c["block_sizes"], c["num_warps"], c["num_stages"], c["split_k"], c["indexing"]) for c in swapped]
    assert sorted(tried) == sorted(row for row in INT4_SWAPPED_CANDIDATES if row[0] <= 16 or m > 16)
    assert max(c["block_sizes"][2] for c in swapped) <= 256


@pytest.mark.parametrize("family", ["gemm", "gemm_fp8", "gemm_int8", "gemm_weight_only", "gemm_int4"])
def test_the_single_gemms_try_gemv_tiles_at_a_few_rows(family):
    """Up to ``GEMV_MAX_M`` rows the single GEMM, 16-bit or on one-byte or int4 weights, also tries the GEMV form
    (``gemv``), with N tiles down to one column and no split-K; not past it."""
    one_row = gemv_configs(family, 1)
    assert one_row and min(c["block_sizes"][1] for c in one_row) == 1
    assert all(c["split_k"] == 1 for c in one_row)
    assert gemv_configs(family, tuning_problems.GEMV_MAX_M)
    assert not gemv_configs(family, tuning_problems.GEMV_MAX_M + 1)


@pytest.mark.parametrize("family", ["gemm", "gemm_int4"])
@pytest.mark.parametrize("m", [2, 3, 8])
def test_the_gemv_tiles_at_more_rows_hold_as_many_products_a_step(family, m):
    """A GEMV step holds block_m x block_n x block_k products, and Helion keeps block_m above one row: so at M
    rows the GEMV candidates have an M block of M's next power of two and K blocks that many times shallower
    (32 at least), with the N tiles, warps and stages of one row's."""
    rows = 1 << (m - 1).bit_length()
    expected = {(rows, bn, max(bk // rows, 32), c["num_warps"], c["num_stages"])
                for c in gemv_configs(family, 1) for _, bn, bk in [c["block_sizes"]]}
    assert {(*c["block_sizes"], c["num_warps"], c["num_stages"]) for c in gemv_configs(family, m)} == expected


@pytest.mark.parametrize("family", ["gemm_glu", "gemm_multi", "gemm_glu_fp8", "gemm_multi_fp8", "gemm_fp8_block"])
def test_kernels_without_a_gemv_form_try_none(family):
    """The gated and shared-launch kernels always dot, and block fp8's wrapper has no GEMV."""
    assert not gemv_configs(family, 1)


@pytest.mark.parametrize("family", ["gemm_fp8", "gemm_int8", "gemm_weight_only"])
def test_the_one_byte_gemms_try_swapped_tiles(family):
    """fp8, int8 and weight-only int8 also try the swapped form (``swap_ab``): N blocks that fill the dot's
    64-row side, row blocks that cover M; 32-row blocks only above 16 rows."""
    from helion_backend.kernels.configs import SWAP_AB

    for m, row_blocks in ((8, {16}), (32, {16, 32})):
        swapped = [c for c in candidates_for(sweep.sweep_keys(family, ["qwen3_8b"], [m])[0]) if c.get(SWAP_AB)]
        assert swapped and {c["block_sizes"][0] for c in swapped} == row_blocks
        assert min(c["block_sizes"][1] for c in swapped) >= 64 and not any(c.get("gemv") for c in swapped)


@pytest.mark.parametrize("family", ["gemm", "gemm_glu", "gemm_multi", "gemm_glu_fp8", "gemm_multi_fp8",
                                    "gemm_fp8_block"])
def test_kernels_without_a_swapped_form_try_none(family):
    from helion_backend.kernels.configs import SWAP_AB

    assert not [c for c in candidates_for(sweep.sweep_keys(family, ["qwen3_8b"], [8])[0]) if c.get(SWAP_AB)]


def gemv_configs(family: str, m: int) -> list[helion.Config]:
    from helion_backend.kernels.configs import GEMV

    return [c for c in candidates_for(sweep.sweep_keys(family, ["qwen3_8b"], [m])[0]) if c.get(GEMV)]


def test_the_suites_manifest_expands_in_the_tune_command_to_the_keys_the_script_sweeps(tmp_path, capsys):
    path = tmp_path / "suites.json"
    sweep.main(["--kernel", "all", "--write-manifest", str(path)])
    assert f"-> {path}" in capsys.readouterr().out
    sites = read_manifest(path)  # as the tune command reads it
    for ms in (list(DEFAULT_NUM_TOKENS), [1, 4, 16, 32], [2, 3]):
        swept = [key for kernel in sweep.KERNELS for key in sweep.sweep_keys(kernel, SUITES, ms)]
        assert expand_keys(sites, ms) == sorted(swept, key=lambda key: key.table_key)
    # The shared launch takes its RMSNorm at one row only (fused_norm), the gated and quantized families their steps.
    multi = {(site.prologue, site.max_helion_m) for site in sites if site.kernel == "gemm_multi"}
    assert multi == {(("rmsnorm",), 1), ((), 32)}
    assert {site.kernel for site in sites} == set(sweep.KERNELS)


def test_a_family_manifest_and_its_errors(tmp_path, capsys):
    path = tmp_path / "multi.json"
    sweep.main(["--kernel", "gemm_multi", "--suite", "qwen3_8b", "--write-manifest", str(path)])
    assert {site["kernel"] for site in json.loads(path.read_text())["sites"]} == {"gemm_multi"}
    for argv, message in [(["--m", "1,8"], "--m does not apply to --write-manifest"),
                          (["--suite", "qwen3_9b"], "unknown suite(s) ['qwen3_9b']")]:
        with pytest.raises(SystemExit) as stopped:
            sweep.main([*argv, "--write-manifest", str(path)])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_the_documented_tune_command_reads_the_manifest(tmp_path, capsys, monkeypatch):
    """``tune <manifest> --effort sweep --num-tokens ...`` gets as far as the device (none here)."""
    path = tmp_path / "suites.json"
    sweep.main(["--kernel", "gemm_glu", "--write-manifest", str(path)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["tune", str(path), "--effort", "sweep", "--num-tokens", "1,2,4,8,16,24,32", "--table",
            str(tmp_path / "table.json")]
    assert helion_main(argv) == 2 and "error: no CUDA device" in capsys.readouterr().err
