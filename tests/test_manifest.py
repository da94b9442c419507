"""The compile manifest: what compiles record for the tuner, how records merge, and what never fails a compile."""

import json

import pytest
import torch

from helion_backend import jsonfile
from helion_backend.compile import placing
from helion_backend.manifest import ManifestError, ManifestSite, merge_sites, read_manifest, record_sites
from helion_backend.options import BackendOptions

GELU = ("bias", "gelu_tanh")


def site(m=None, limit=32, epilogue=GELU, k=4096, n=12288, dtype="bfloat16"):
    return ManifestSite.declared("gemm", epilogue, dtype, k, n, m=m, max_helion_m=limit)


def test_manifest_path_is_in_the_cache_dir(tmp_path):
    options = BackendOptions.from_user({"cache_dir": str(tmp_path)})
    assert options.manifest_path == str(tmp_path / "manifest.json")


def test_static_and_dynamic_declarations_of_one_site_merge():
    merged = merge_sites([site(m=8), site(m=1), site(m=None, limit=16), site(m=8), site(m=None, limit=4)])
    assert merged == [ManifestSite("gemm", GELU, "bfloat16", 4096, 12288, frozenset({1, 8}), 16)]


def test_sites_differing_in_epilogue_or_shape_stay_apart():
    merged = merge_sites([site(m=1), site(m=1, epilogue=("bias",)), site(m=1, n=4096), site(m=1, dtype="float16")])
    assert len(merged) == 4


def test_prologue_and_widths_round_trip_and_keep_sites_apart(tmp_path):
    normed = ManifestSite.declared("gemm", (), "bfloat16", 4096, 1024, m=1, max_helion_m=32, prologue=["rmsnorm"])
    qkv = ManifestSite.declared("gemm_multi", (), "bfloat16", 4096, 6144, m=1, max_helion_m=32,
                                prologue=["rmsnorm"], widths=[4096, 1024, 1024])
    other_split = ManifestSite.declared("gemm_multi", (), "bfloat16", 4096, 6144, m=1, max_helion_m=32,
                                        prologue=["rmsnorm"], widths=[2048, 2048, 2048])
    sites = [site(m=1, n=1024), normed, qkv, other_split]
    assert len(merge_sites(sites)) == 4
    path = tmp_path / "manifest.json"
    record_sites(path, sites)
    assert read_manifest(path) == merge_sites(sites)
    assert {"prologue": ["rmsnorm"], "widths": [4096, 1024, 1024]}.items() <= qkv.to_json().items()
    assert "widths" not in normed.to_json()


def test_a_manifest_without_prologue_or_widths_still_reads(tmp_path):
    """Written before the fields existed: sites without a prologue, and a shared launch without its widths."""
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps({"version": 1, "sites": [
        {"kernel": "gemm", "epilogue": ["bias"], "dtype": "bfloat16", "k": 64, "n": 32, "m": [4],
         "max_helion_m": None},
        {"kernel": "gemm_multi", "epilogue": [], "dtype": "bfloat16", "k": 64, "n": 96, "m": [], "max_helion_m": 8},
    ]}))
    assert read_manifest(path) == [ManifestSite("gemm", ("bias",), "bfloat16", 64, 32, frozenset({4})),
                                   ManifestSite("gemm_multi", (), "bfloat16", 64, 96, max_helion_m=8)]


def test_the_helion_m_limit_is_written_as_max_helion_m_and_read_under_its_older_name_too(tmp_path):
    path = tmp_path / "manifest.json"
    record_sites(path, [site(m=None, limit=16)])
    (written,) = json.loads(path.read_text())["sites"]
    assert written["max_helion_m"] == 16 and "dynamic_m_limit" not in written
    written["dynamic_m_limit"] = written.pop("max_helion_m")  # as an older manifest has it
    path.write_text(json.dumps({"version": 1, "sites": [written]}))
    (read,) = read_manifest(path)
    assert read.max_helion_m == 16 and read == site(m=None, limit=16)


def test_record_writes_then_merges_with_the_existing_file(tmp_path):
    path = tmp_path / "cache" / "manifest.json"
    record_sites(path, [site(m=1)])
    record_sites(path, [site(m=8), site(m=None, limit=16), site(m=1, epilogue=("bias",))])
    data = json.loads(path.read_text())
    assert data["version"] == 1
    assert data["sites"] == [
        {"kernel": "gemm", "prologue": [], "epilogue": ["bias"], "dtype": "bfloat16", "k": 4096, "n": 12288,
         "m": [1], "max_helion_m": None},
        {"kernel": "gemm", "prologue": [], "epilogue": ["bias", "gelu_tanh"], "dtype": "bfloat16", "k": 4096,
         "n": 12288, "m": [1, 8], "max_helion_m": 16},
    ]
    assert read_manifest(path) == merge_sites([site(m=1), site(m=8), site(m=None, limit=16), site(m=1, epilogue=("bias",))])


def test_nothing_new_leaves_the_file_alone(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    record_sites(path, [site(m=1), site(m=None)])
    writes = []
    monkeypatch.setattr("helion_backend.manifest.write_json_atomic", lambda *args: writes.append(args))
    record_sites(path, [site(m=1)])
    record_sites(path, [])
    assert writes == []
    record_sites(path, [site(m=2)])
    assert len(writes) == 1


def test_corrupt_manifest_is_replaced_with_a_warning_naming_it(tmp_path, caplog):
    path = tmp_path / "manifest.json"
    path.write_text('{"version": 1, "sites": [')
    with caplog.at_level("WARNING"):
        record_sites(path, [site(m=4)])
    assert str(path) in caplog.text and "replacing" in caplog.text
    assert read_manifest(path) == [site(m=4)]


def test_unwritable_cache_dir_warns_and_does_not_raise(tmp_path, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    path = blocker / "manifest.json"  # its folder cannot be created: works as root too
    with caplog.at_level("WARNING"):
        record_sites(path, [site(m=4)])
    assert "cannot write the manifest" in caplog.text and str(path) in caplog.text


def test_a_failed_write_keeps_the_old_manifest_and_leaves_no_temp_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "manifest.json"
    record_sites(path, [site(m=1)])
    before = path.read_text()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonfile.json, "dump", disk_full)
    with caplog.at_level("WARNING"):
        record_sites(path, [site(m=2)])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    assert "No space left" in caplog.text


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read the manifest"),
        ('{"version": 2, "sites": []}', "not a manifest of version 1"),
        ('{"version": 1, "sites": [{"kernel": "gemm"}]}', "site #0: missing field(s)"),
        ('{"version": 1, "sites": [{"kernel": "gemm", "epilogue": ["geluu"], "dtype": "bfloat16", "k": 8, '
         '"n": 8, "m": [1]}]}', "site #0: 'epilogue' must list steps"),
        ('{"version": 1, "sites": [{"kernel": "gemm", "epilogue": [], "dtype": "bfloat16", "k": 8, '
         '"n": 8, "m": [0]}]}', "site #0: 'm' must be an integer >= 1"),
        ('{"version": 1, "sites": [{"kernel": "gemm", "epilogue": [], "dtype": ["bfloat16"], "k": 8, '
         '"n": 8, "m": [1]}]}', "site #0: unknown dtype"),
        ('{"version": 1, "sites": [{"kernel": "gemm", "prologue": ["rms"], "epilogue": [], "dtype": "bfloat16", '
         '"k": 8, "n": 8, "m": [1]}]}', "site #0: 'prologue' must list steps"),
        ('{"version": 1, "sites": [{"kernel": "gemm_multi", "epilogue": [], "dtype": "bfloat16", "k": 8, '
         '"n": 8, "widths": [4, 2], "m": [1]}]}', "site #0: 'widths' must be 2 to 3 output widths summing to n=8"),
        ('{"version": 1, "sites": [{"kernel": "gemm", "epilogue": [], "dtype": "bfloat16", "k": 8, '
         '"n": 8, "widths": [4, 4], "m": [1]}]}', "site #0: 'widths' belong to the shared launches' sites"),
    ],
)
def test_read_errors_name_the_file_and_the_problem(tmp_path, text, message):
    path = tmp_path / "manifest.json"
    path.write_text(text)
    with pytest.raises(ManifestError) as info:
        read_manifest(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_missing_manifest_says_how_to_make_one(tmp_path):
    with pytest.raises(ManifestError, match="no manifest at .*compile a model"):
        read_manifest(tmp_path / "manifest.json")


# A real compile on the CPU. Inductor's FX graph cache is off so that the pipeline runs in every test.
def compile_linear_gelu(tmp_path, x: torch.Tensor, **options) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    options = {"rewrite_on_cpu": True, "cache_dir": str(tmp_path), "inductor_config": {"fx_graph_cache": False},
               **options}
    with torch.no_grad():
        torch.compile(lambda x: torch.nn.functional.gelu(linear(x)), backend="helion_inductor", options=options)(x)


def test_cpu_compile_records_nothing(tmp_path):
    """On the CPU sites run the reference, not Helion: there is nothing to tune."""
    compile_linear_gelu(tmp_path, torch.randn(4, 64))
    assert not (tmp_path / "manifest.json").exists()


@pytest.fixture
def sites_placed_on_helion(monkeypatch):
    """Where a CUDA compile would send a site to Helion (the fused op still runs the reference on the CPU)."""
    place = placing.place

    def on_helion(site, ctx, kernel, n):
        return placing.Placement("helion", None, place(site, ctx, kernel, n).max_helion_m)  # with the site's limit

    monkeypatch.setattr(placing, "place", on_helion)  # a shared launch too: it is placed as one


def test_compile_records_its_helion_sites(tmp_path, sites_placed_on_helion):
    compile_linear_gelu(tmp_path, torch.randn(4, 64), max_helion_size=16)
    x = torch.randn(6, 64)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    compile_linear_gelu(tmp_path, x, max_helion_size=16)
    assert read_manifest(tmp_path / "manifest.json") == [
        ManifestSite("gemm", ("bias", "gelu"), "float32", 64, 32, static_m=frozenset({4}), max_helion_m=16)
    ]


def test_compile_records_a_shared_launch_with_its_widths_and_norm(tmp_path, sites_placed_on_helion):
    from test_shared_input import QKV

    options = {"rewrite_on_cpu": True, "rmsnorm_prologue_max_m": 4, "cache_dir": str(tmp_path),
               "inductor_config": {"fx_graph_cache": False}}
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(QKV(), backend="helion_inductor", options=options)(torch.randn(4, 64))
    (launch,) = read_manifest(tmp_path / "manifest.json")
    assert (launch.kernel, launch.n, launch.widths, launch.prologue, launch.epilogue) == (
        "gemm_multi", 96, (64, 16, 16), ("rmsnorm",), ("relu",))
