"""The GEMM config table: the shipped H200 file loads, lookup picks the right M, bad files fall back."""

import json

import helion
import pytest
import torch

from helion_backend import tables
from helion_backend.kernels import configs
from helion_backend.tuning.candidates import gemv_row_block
from helion_backend.vocabulary import KERNEL_FAMILIES, MEMBER_FAMILY

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(tables, "gpu_key", lambda device: "test_gpu")
    configs.forget_tables()
    yield tmp_path
    configs.forget_tables()


def entry(m, block_n, k=4096, n=12288):
    return {"dtype": "bfloat16", "k": k, "n": n, "m": m,
            "config": {"block_sizes": [16, block_n, 128], "num_warps": 4, "num_stages": 4, "split_k": 1}}


def test_shipped_h200_table_loads_every_entry():
    tables._table.cache_clear()
    table = tables._table("nvidia_h200")
    assert table, "the shipped H200 table is missing or invalid"
    for (kernel, dtype, k, n), entries in table.items():
        # The shared launches (gemm_multi, gemm_multi_fp8, ...) run sites of a member family (no rule names them).
        family = KERNEL_FAMILIES[kernel if kernel in KERNEL_FAMILIES else MEMBER_FAMILY[kernel]]
        assert dtype in family.dtypes and k > 0 and n > 0
        # Row tiles of 16 or 32, and of 64 where both operands are one byte (Hopper's wgmma, tuning_candidates);
        # the GEMV form above one row tiles M by its next power of two (candidates.gemv_rows).
        row_blocks = (16, 32, 64) if dtype in ("float8_e4m3fn", "int8") else (16, 32)
        for e in entries:
            assert isinstance(e.config, dict), (kernel, k, n, e.m)
            gemv_block = gemv_row_block(e.m) if e.config.get(tables.GEMV) and e.m > 1 else None
            assert e.config["block_sizes"][0] in (*row_blocks, gemv_block), (kernel, k, n, e.m, e.config)
        assert [e.m for e in entries] == sorted(e.m for e in entries)


def test_lookup_takes_the_smallest_tuned_m_at_or_above(table_dir):
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(16, 64), entry(1, 32), entry(32, 128)]}))
    picks = {m: configs.config_for(m, 4096, 12288, torch.bfloat16, CUDA)["block_sizes"][1] for m in (1, 2, 16, 17, 32, 64)}
    assert picks == {1: 32, 2: 64, 16: 64, 17: 128, 32: 128, 64: 128}


def test_untuned_shape_and_other_dtype_use_the_default(table_dir):
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(16, 64)]}))
    assert configs.config_for(16, 4096, 4096, torch.bfloat16, CUDA) == configs.default_config(16, 4096, 4096, torch.bfloat16)
    assert configs.config_for(16, 4096, 12288, torch.float16, CUDA) == configs.default_config(16, 4096, 12288, torch.float16)


def test_malformed_table_warns_with_its_path_and_falls_back(table_dir, caplog):
    path = table_dir / "test_gpu.json"
    path.write_text('{"entries": [{"dtype": "bfloat16", "k": 1}]}')
    with caplog.at_level("WARNING"):
        config = configs.config_for(8, 4096, 12288, torch.bfloat16, CUDA)
    assert config == configs.default_config(8, 4096, 12288, torch.bfloat16)
    assert str(path) in caplog.text


def test_cpu_tensors_never_read_a_gpu_table(table_dir):
    assert configs.config_for(8, 64, 64, torch.float32, torch.device("cpu")) == configs.default_config(8, 64, 64, torch.float32)


def timed(m, lead, k=4096, n=12288, **fields):
    """An entry whose Helion time is ``1 / lead`` of the fallback's."""
    return {**entry(m, 32, k=k, n=n), "us": 10.0, "fallback_us": round(10.0 * lead, 3), "helion_wins": lead > 1,
            **fields}


def decisions(ms, k=4096, n=12288, user_dir=None):
    found = {m: tables.decision(m, k, n, torch.bfloat16, CUDA, user_dir) for m in ms}
    return {m: (d.evidence, d.helion, d.source) for m, d in found.items()}


def test_a_tuned_m_follows_its_own_entry_and_an_untuned_one_both_tuned_neighbours(table_dir):
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [
        timed(1, 1.3), timed(4, 1.2), timed(16, 0.9), timed(32, 1.2), {**entry(8, 32)},  # 8: not timed
    ]}))
    assert decisions((1, 2, 4, 12, 16, 24, 64)) == {
        1: ("exact", True, (4096, 12288, 1)),
        2: ("nearest", True, (4096, 12288, 4)),  # 1 and 4 both won: the weaker of the two is the source
        4: ("exact", True, (4096, 12288, 4)),
        12: ("nearest", False, (4096, 12288, 16)),  # 8 was not timed: 4 and 16 are the neighbours; 16 lost...
        16: ("exact", False, (4096, 12288, 16)),
        24: ("nearest", False, (4096, 12288, 16)),  # ...and the win at 32 does not undo the loss at 16
        64: ("none", False, None),  # above every tuned M: no verdict is extrapolated
    }
    # The config comes from the smallest tuned M >= m, as before.
    assert configs.config_for(2, 4096, 12288, torch.bfloat16, CUDA)["block_sizes"][1] == 32
    assert tables.decision(1, 4096, 12288, torch.bfloat16, torch.device("cpu")).evidence == "none"


def test_a_narrow_win_is_no_verdict_for_the_ms_between(table_dir):
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [timed(1, 1.01), timed(4, 1.5)]}))
    assert decisions((2,))[2] == ("nearest", False, (4096, 12288, 1))  # 1% is within the timing's spread


def test_an_untuned_shape_borrows_only_a_close_shapes_lasting_lead(table_dir):
    """K and N within 1.5x of a tuned shape, whose Helion lead held at every tuned M up to the key's M."""
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [
        timed(1, 1.5, n=12288), timed(8, 1.3, n=12288), timed(16, 1.05, n=12288), timed(32, 1.4, n=12288),
        timed(1, 2.0, k=12288, n=4096),
    ]}))
    near = 14336  # Llama-3.1-8B's intermediate size, against Qwen3-8B's 12288
    assert decisions((1, 4, 8, 16, 32), n=near) == {
        1: ("predicted", True, (4096, 12288, 1)),
        4: ("predicted", True, (4096, 12288, 8)),  # the config of the first tuned M above
        8: ("predicted", True, (4096, 12288, 8)),
        16: ("predicted", False, (4096, 12288, 16)),  # a 5% lead is not enough to borrow
        32: ("predicted", False, (4096, 12288, 16)),  # the lead broke below 32
    }
    predicted = tables.decision(4, 4096, near, torch.bfloat16, CUDA)
    assert configs.config_for(4, 4096, near, torch.bfloat16, CUDA) == helion.Config(**predicted.config)
    # Twice the N, or another dtype: nothing close enough; the default config if Helion runs anyway.
    assert decisions((1,), n=2 * 12288) == {1: ("none", False, None)}
    assert tables.decision(1, 4096, near, torch.float16, CUDA).evidence == "none"
    assert configs.config_for(1, 4096, 2 * 12288, torch.bfloat16, CUDA) == configs.default_config(
        1, 4096, 2 * 12288, torch.bfloat16)


def test_entries_autotune_missing_wrote_are_calibrated(table_dir, tmp_path_factory):
    user_dir = tmp_path_factory.mktemp("user_configs")
    (user_dir / "test_gpu.json").write_text(json.dumps({"entries": [timed(8, 1.2, calibrated=True)]}))
    assert decisions((8,), user_dir=str(user_dir)) == {8: ("calibrated", True, (4096, 12288, 8))}


def test_table_without_timings_has_no_verdict(table_dir):
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(1, 32), entry(32, 64)]}))
    assert decisions((1, 16)) == {1: ("none", False, None), 16: ("none", False, None)}


def test_user_table_overrides_the_shipped_one_m_by_m(table_dir, tmp_path_factory):
    user_dir = tmp_path_factory.mktemp("user_configs")
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(1, 32), entry(16, 64)]}))
    (user_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(16, 128), entry(8, 256)]}))
    picks = {m: configs.config_for(m, 4096, 12288, torch.bfloat16, CUDA, str(user_dir))["block_sizes"][1]
             for m in (1, 8, 16)}
    assert picks == {1: 32, 8: 256, 16: 128}
    # Without the user's folder, the shipped table alone.
    assert configs.config_for(16, 4096, 12288, torch.bfloat16, CUDA)["block_sizes"][1] == 64


def test_a_gpu_without_a_table_reads_its_stand_ins_and_its_own_user_table(table_dir, tmp_path_factory,
                                                                          monkeypatch, caplog):
    monkeypatch.setattr(tables, "SHIPPED_STAND_INS", {"test_gpu": "sibling_gpu"})
    (table_dir / "sibling_gpu.json").write_text(json.dumps({"entries": [entry(1, 32), entry(16, 64)]}))
    with caplog.at_level("INFO", logger="helion_backend.tables"):
        picks = {m: configs.config_for(m, 4096, 12288, torch.bfloat16, CUDA)["block_sizes"][1] for m in (1, 16)}
    assert picks == {1: 32, 16: 64}
    assert "sibling_gpu" in caplog.text and "test_gpu" in caplog.text
    # The user's table is kept under the GPU's own name and overrides the stand-in's M by M.
    user_dir = tmp_path_factory.mktemp("user_configs")
    (user_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(16, 128)]}))
    picks = {m: configs.config_for(m, 4096, 12288, torch.bfloat16, CUDA, str(user_dir))["block_sizes"][1]
             for m in (1, 16)}
    assert picks == {1: 32, 16: 128}
    # A shipped table of the GPU's own overrides its stand-in's M by M: the keys it measured, and only those.
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(16, 256)]}))
    configs.forget_tables()
    picks = {m: configs.config_for(m, 4096, 12288, torch.bfloat16, CUDA)["block_sizes"][1] for m in (1, 16)}
    assert picks == {1: 32, 16: 256}
    # The user's table still overrides both.
    assert configs.config_for(16, 4096, 12288, torch.bfloat16, CUDA, str(user_dir))["block_sizes"][1] == 128


def test_the_h100_sxm_reads_its_table_over_the_h200_one():
    assert tables.shipped_table_names("nvidia_h100_80gb_hbm3")[0] == "nvidia_h200"
    assert tables.shipped_table_names("nvidia_h200") == ["nvidia_h200"]
    assert tables.shipped_table_names("nvidia_h100_pcie") == ["nvidia_h100_pcie"]  # 114 SMs: no stand-in


def test_malformed_user_table_warns_and_keeps_the_shipped_one(table_dir, tmp_path_factory, caplog):
    user_dir = tmp_path_factory.mktemp("user_configs")
    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [entry(16, 64)]}))
    bad = user_dir / "test_gpu.json"
    bad.write_text("{not json")
    with caplog.at_level("WARNING"):
        config = configs.config_for(16, 4096, 12288, torch.bfloat16, CUDA, str(user_dir))
    assert config["block_sizes"][1] == 64
    assert str(bad) in caplog.text


@pytest.mark.parametrize("fused", ["gemm_glu_fp8", "gemm_multi_fp8"])
def test_a_fused_family_falls_back_to_its_members_dot_entries_only(table_dir, fused):
    """Without entries of its own a fused fp8 family takes gemm_fp8's, but not a one-row GEMV entry (the fused
    kernels always dot, and a dot has no N tile of 2) nor a swapped one (they always dot ``x @ w``): its M = 1
    lookup takes the next tuned M, its M = 8 lookup the one after."""
    def fp8_entry(m, block_n, **ours):
        config = {"block_sizes": [16, block_n, 512], "num_warps": 4, "num_stages": 1, "split_k": 1, **ours}
        return {"kernel": "gemm_fp8", "dtype": "float8_e4m3fn", "k": 4096, "n": 12288, "m": m, "config": config}

    (table_dir / "test_gpu.json").write_text(json.dumps({"entries": [
        fp8_entry(1, 2, **{configs.GEMV: True}), fp8_entry(8, 128, **{configs.SWAP_AB: True}), fp8_entry(16, 32),
        fp8_entry(32, 64)]}))

    def block_n(kernel: str, m: int) -> int:
        return configs.config_for(m, 4096, 12288, torch.float8_e4m3fn, CUDA, kernel=kernel)["block_sizes"][1]

    assert [block_n("gemm_fp8", m) for m in (1, 8)] == [2, 128]  # the single GEMM runs its GEMV, its swap
    assert [block_n(fused, m) for m in (1, 8, 32)] == [32, 32, 64]


@pytest.mark.parametrize(("family", "dtype"), [("gemm_fp8", torch.float8_e4m3fn), ("gemm_int8", torch.int8)])
def test_quantized_gated_kernel_config_drops_its_fallbacks_single_gemm_keys(family, dtype):
    """A quantized gated site without table entries runs its member family's config; the gated kernel
    has neither split-K nor our ``prequantize`` key, which Helion rejects as an invalid config key."""
    from helion_backend.kernels.gemm import glu_kernel_config

    fallback = configs.default_config(8, 4096, 12288, dtype, family)
    assert configs.PREQUANTIZE in fallback
    gated = glu_kernel_config(fallback, dtype.itemsize, False)
    assert configs.PREQUANTIZE not in gated and "split_k" not in gated
    assert gated["block_sizes"][:2] == fallback["block_sizes"][:2]
