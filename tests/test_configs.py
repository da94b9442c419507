"""The GEMM config table: the shipped H200 file loads, lookup picks the right M, bad files fall back."""

import json

import helion
import pytest
import torch

from helion_backend.kernels import configs

CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(configs, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(configs, "gpu_key", lambda device: "test_gpu")
    configs._table.cache_clear()
    configs.config_for.cache_clear()
    yield tmp_path
    configs._table.cache_clear()
    configs.config_for.cache_clear()


def entry(m, block_n, k=4096, n=12288):
    return {"dtype": "bfloat16", "k": k, "n": n, "m": m,
            "config": {"block_sizes": [16, block_n, 128], "num_warps": 4, "num_stages": 4, "split_k": 1}}


def test_shipped_h200_table_loads_every_entry():
    configs._table.cache_clear()
    table = configs._table("nvidia_h200")
    assert table, "the shipped H200 table is missing or invalid"
    for (dtype, k, n), entries in table.items():
        assert dtype == "bfloat16" and k > 0 and n > 0
        assert all(isinstance(c, helion.Config) and c["block_sizes"][0] in (16, 32) for _, c in entries)
        assert [m for m, _ in entries] == sorted(m for m, _ in entries)


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
