"""The decode benchmark (benchmarks/decode.py): its static-cache decode step against a recomputation of
the whole sequence, and its --smoke run end to end."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (unlike `python -m pytest`) does not put the checkout on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import decode  # noqa: E402

TINY = dataclasses.replace(decode.SMOKE_CONFIG, hidden=64, intermediate=96, heads=4, kv_heads=2, head_dim=16,
                           layers=2, vocab=80, context=4, max_len=12)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x`` [seq, heads, dim]: the pair (i, i + dim/2) turned by pos * theta^(-2i/dim)."""
    half = x.shape[-1] // 2
    freq = theta ** (-2 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angles = positions.double()[:, None] * freq[None, :]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def full_sequence_logits(model: decode.Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [seq, vocab] of every position of one sequence, recomputed without a cache: causal
    attention over the whole sequence, each key/value head repeated for its query heads."""
    config = model.config
    seq, groups = tokens.shape[0], config.heads // config.kv_heads
    positions = torch.arange(seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    x = model.embed(tokens)
    for layer in model.layers:
        attn = layer.attn
        h = layer.input_norm(x)
        q = attn.q_norm(attn.q_proj(h).view(seq, config.heads, config.head_dim))
        k = attn.k_norm(attn.k_proj(h).view(seq, config.kv_heads, config.head_dim))
        v = attn.v_proj(h).view(seq, config.kv_heads, config.head_dim)
        q, k = rotate(q, positions, config.rope_theta), rotate(k, positions, config.rope_theta)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / config.head_dim**0.5
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        out = torch.einsum("hqk,khd->qhd", weights, v).reshape(seq, config.heads * config.head_dim)
        x = x + attn.o_proj(out)
        x = x + layer.mlp(layer.post_attention_norm(x))
    return model.lm_head(model.norm(x))


def test_static_cache_decode_matches_full_sequence_recomputation():
    model = decode.build_model(TINY, torch.float32, torch.device("cpu"), seed=0)
    batch, seq = 2, TINY.context + 2
    tokens = torch.randint(0, TINY.vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    # Random values in every cache position: what the mask must hide until the step writes them.
    model.allocate_cache(batch, TINY.max_len, seed=2)
    before = model.layers[0].attn.k_cache.clone()
    with torch.no_grad():
        stepped = torch.stack([model(tokens[:, p], torch.tensor([p])) for p in range(seq)], dim=1)
        expected = torch.stack([full_sequence_logits(model, tokens[i]) for i in range(batch)])
    assert stepped.shape == (batch, seq, TINY.vocab)
    # All positions, and in particular two consecutive ones past the context length, as the benchmark steps.
    for p in (*range(seq), TINY.context, TINY.context + 1):
        err = decode.relative_error(stepped[:, p], expected[:, p])
        assert err < 1e-5, (p, err)
    # The step wrote each position's keys into the cache and left the later positions alone.
    after = model.layers[0].attn.k_cache
    assert torch.equal(after[:, :, seq:], before[:, :, seq:])
    assert not torch.isclose(after[:, :, :seq], before[:, :, :seq]).any()


@pytest.mark.slow
def test_smoke_run_writes_every_row_within_tolerance(tmp_path):
    env = {**os.environ,
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend")}
    out_dir = tmp_path / "out"
    # A rule file besides the shipped ones: a bare GEMM rule that outranks the shipped one.
    extra_rules = tmp_path / "extra.toml"
    extra_rules.write_text('[[rule]]\nname = "extra_gemm"\nanchor = ["mm", "linear"]\nepilogue = []\npriority = 1\n')
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke",
                             "--out-dir", str(out_dir), "--helion-rules", str(extra_rules)],
                            capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "helion_inductor report, bf16" in result.stdout  # the fused-site summary, once per format

    data = json.loads((out_dir / "cpu_decode.json").read_text())
    plan = decode.PRESETS["smoke"]
    rows = {(row["format"], row["batch"], row["variant"]): row for row in data["rows"]}
    expected = {(f, b, v) for f in plan.formats for b in plan.batches for v in plan.variants}
    assert set(rows) == expected
    assert data["metadata"]["complete"] and not data["metadata"]["skipped"]
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        assert row["wall_us"] > 0 and row["gpu_us"] is None, key
        assert row["wall_method"] == "interleaved", key  # eager and helion_inductor took turns
        if row["variant"] == decode.HELION:
            assert row["rel_err"] <= decode.TOLERANCES[row["format"]], (key, row["rel_err"])
            assert row["compile_s"] > 0 and row["graphs"] == 1 and row["graph_breaks"] == 0, key
            assert "reference" in row["helion_sites"], row["helion_sites"]
        if row["format"] in decode.BASE_TOLERANCES:
            assert row["rel_err_base"] <= decode.BASE_TOLERANCES[row["format"]], (key, row["rel_err_base"])
        assert decode.row_is_correct(row), key
    assert set(data["metadata"]["helion_reports"]) == set(plan.formats)
    # The bf16 model's gate and up projections are one gated site in every layer; --helion-rules loads the
    # extra file besides the shipped rules (its rule takes the bare GEMMs).
    assert data["metadata"]["helion_options"] == {"rules": [str(extra_rules)]}
    bf16_report = "\n".join(data["metadata"]["helion_reports"]["bf16"])
    assert bf16_report.count("[gated_mlp]") == decode.SMOKE_CONFIG.layers, bf16_report
    assert "[extra_gemm]" in bf16_report, bf16_report

    table = (out_dir / "cpu_decode.md").read_text()
    assert "## Summary" in table and all(f"## {fmt} " in table for fmt in plan.formats)


def test_smoke_run_of_the_int4_model_fuses_every_linear(tmp_path):
    """``--formats int4_weight_only``: every linear of the smoke decoder (q, k, v, o, gate, up, down, the LM
    head) is an int4 site with its ``dequant_int4`` prologue, and the logits are within the format's
    tolerances of the eager int4 model and of the eager bf16 one, with and without ``frozen_weights`` (the
    ``helion_inductor_frozen`` variant, in the same run). ``--inductor-config`` is taken and recorded."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend")}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke", "--formats",
                             "int4_weight_only", "--out-dir", str(tmp_path),
                             "--variants", f"eager,{decode.HELION},{decode.HELION_FROZEN}",
                             "--inductor-config", '{"triton.enable_pdl": true}'],
                            capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads((tmp_path / "cpu_decode.json").read_text())
    assert data["metadata"]["inductor_config"] == {"triton.enable_pdl": True}  # recorded, for every variant
    assert [row["variant"] for row in data["rows"]] == ["eager", decode.HELION, decode.HELION_FROZEN]
    for row in data["rows"][1:]:
        assert row["error"] is None and decode.row_is_correct(row), row
        assert row["rel_err"] <= decode.TOLERANCES["int4_weight_only"], row["rel_err"]
        assert row["rel_err_base"] <= decode.BASE_TOLERANCES["int4_weight_only"], row["rel_err_base"]
    for key in ("int4_weight_only", f"int4_weight_only, {decode.HELION_FROZEN}"):
        report = "\n".join(data["metadata"]["helion_reports"][key])
        assert report.count("[int4_weight_only_linear]") == 7 * decode.SMOKE_CONFIG.layers + 1, report
        assert report.count("dequant_int4 -> mm") == 7 * decode.SMOKE_CONFIG.layers + 1, report
    table = (tmp_path / "cpu_decode.md").read_text()
    assert f"int4_weight_only: {decode.HELION_FROZEN} vs {decode.HELION}: wall geomean" in table, table


def test_smoke_run_of_the_step_graph_variants(tmp_path):
    """``compile_step_graph``, ``helion_inductor_frozen_step_graph`` and ``helion_inductor_frozen_direct`` run
    the compiled step (on the CPU without CUDA graphs: :class:`StepGraph` and the direct runner capture CUDA steps
    only) within tolerance, and the summary compares the backend's step graph with torch.compile's and with
    ``helion_inductor_frozen`` under its trees."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend")}
    variants = [decode.HELION_FROZEN, decode.HELION_DIRECT, *decode.STEP_GRAPH_VARIANTS]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke", "--formats", "bf16",
                             "--out-dir", str(tmp_path), "--variants", ",".join(["eager", *variants])],
                            capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((tmp_path / "cpu_decode.json").read_text())["rows"]
    assert [row["variant"] for row in rows] == ["eager", *variants]
    for row in rows[1:]:
        assert row["error"] is None and decode.row_is_correct(row), row
        assert row["graphs"] == 1 and row["graph_breaks"] == 0, row
    assert "reference" in rows[-1]["helion_sites"], rows[-1]["helion_sites"]
    table = (tmp_path / "cpu_decode.md").read_text()
    for ours, theirs in ((decode.HELION_STEP_GRAPH, decode.COMPILE_STEP_GRAPH),
                         (decode.HELION_STEP_GRAPH, decode.HELION_FROZEN), (decode.HELION_DIRECT, decode.HELION_FROZEN)):
        assert f"bf16: {ours} vs {theirs}: wall geomean" in table, table


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [decode.HELION_STEP_GRAPH, decode.HELION_DIRECT])
def test_a_replayed_step_follows_each_new_position(variant):
    """On the GPU the step's CUDA graph, captured by :class:`StepGraph` around the compiled step or by the
    backend's direct runner inside it, is replayed after the first calls: each replay reads the tokens and
    position copied in, writes the caches (static inputs) at that position, and returns the eager model's logits
    at the same position."""
    import helion_backend

    helion_backend.clear_reports()
    device = torch.device("cuda")
    config = decode.SMOKE_CONFIG
    models = []
    for _ in range(2):
        model = decode.build_model(config, torch.bfloat16, device, seed=0)
        model.allocate_cache(batch=2, context=config.context, seed=1)
        models.append(model)
    eager, compiled = models
    step = decode.model_step(decode.compile_variant(variant, compiled, device), variant)
    generator = torch.Generator().manual_seed(2)
    for position in range(config.context, config.context + decode.StepGraph.UNCAPTURED_CALLS + 2):
        tokens = torch.randint(0, config.vocab, (2,), generator=generator).to(device)
        pos = torch.tensor([position], device=device)
        got = step(tokens, pos).clone()
        want = eager(tokens, pos)
        err = decode.relative_error(got, want)
        assert err <= decode.TOLERANCES["bf16"], (position, err)
    if variant == decode.HELION_STEP_GRAPH:
        assert step.graph is not None  # the last two steps were replays
    else:
        events = [event for report in helion_backend.get_reports() for event in report.direct_cuda_graph]
        # Captured once; only the tokens and the position are copied in (the weights, rotary tables and caches
        # are static inputs).
        assert events in (["captured at input shapes [[2], [1]]"], ["captured at input shapes [[1], [2]]"]), events
    for ours, theirs in zip(compiled.layers, eager.layers):
        for name in ("k_cache", "v_cache"):
            err = decode.relative_error(getattr(ours.attn, name), getattr(theirs.attn, name))
            assert err <= decode.TOLERANCES["bf16"], (name, err)


@pytest.mark.gpu
def test_the_step_graph_rows_time_the_replayed_step(tmp_path):
    """``--device cuda`` with the step-graph variants and the direct runner: every row has a GPU time and a launch
    count, and the targets list the backend's step graph's wall over GPU time."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "HELION_INDUCTOR_CACHE_DIR": str(tmp_path / "backend")}
    variants = ["reduce_overhead", decode.HELION_DIRECT, *decode.STEP_GRAPH_VARIANTS]
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--smoke", "--device", "cuda",
                             "--formats", "bf16", "--steps", "20", "--out-dir", str(tmp_path),
                             "--variants", ",".join(variants)],
                            capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (results,) = tmp_path.glob("*_decode.json")  # named by the GPU
    rows = json.loads(results.read_text())["rows"]
    assert [row["variant"] for row in rows] == variants
    for row in rows:
        assert row["error"] is None and decode.row_is_correct(row), row
        assert row["gpu_us"] > 0 and row["kernels_per_step"] > 0, row
    table = results.with_suffix(".md").read_text()
    assert f"batch 1, {decode.HELION_STEP_GRAPH} bf16: wall / GPU" in table, table


def test_interleaved_wall_times_rotate_the_variants_and_skip_each_turns_first_step():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    walls = decode.interleaved_wall_us(steps, total_steps=6, rounds=3, device=torch.device("cpu"))
    assert set(walls) == {"a", "b", "c"} and all(w > 0 for w in walls.values())
    # Each turn: one untimed step, then 6 / 3 = 2 timed ones; the order rotates by one every round.
    turns = ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert calls == [name for name in turns for _ in range(3)]


def test_a_failed_interleaving_keeps_the_wall_times_measured_alone():
    rows = {v: {"wall_us": 5.0, "wall_method": "alone"} for v in ("eager", decode.HELION)}

    def broken() -> None:
        raise RuntimeError("recompiled")

    steps = {"eager": lambda: None, decode.HELION: broken}
    decode.interleave_wall_times(rows, steps, decode.PRESETS["smoke"], torch.device("cpu"))
    assert rows == {v: {"wall_us": 5.0, "wall_method": "alone"} for v in ("eager", decode.HELION)}
    steps[decode.HELION] = lambda: None
    decode.interleave_wall_times(rows, steps, decode.PRESETS["smoke"], torch.device("cpu"))
    assert all(row["wall_method"] == "interleaved" and row["wall_us"] != 5.0 for row in rows.values())


def test_launch_counts_take_the_gpus_kernels_and_copies_apart():
    """The profiler's GPU events of a step: kernels (Helion's, Inductor's, cuBLAS's) and, apart, the memory
    copies and sets (cudagraph trees' input copies); host events are not launches."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [(cuda, "_helion_gemm_kernel"), (cuda, "triton_red_fused_add_mean_0"), (cuda, "Memcpy DtoD (Device -> Device)"),
              (cuda, "Memset (Device)"), (cpu, "aten::mm"), (cpu, "cudaGraphLaunch"), (cuda, "nvjet_tst_64x8")]
    assert decode.count_gpu_activity(events) == (3, 2)


def test_step_targets_are_set_against_the_rows_that_ran():
    """Batch 1, GPU time: each target whose two rows ran and are correct is met or missed, int4 against the
    bf16 model under reduce-overhead; helion_inductor's wall time is set against its GPU time."""
    def row(fmt, variant, gpu_us, wall_us, batch=1):
        return {"format": fmt, "variant": variant, "batch": batch, "gpu_us": gpu_us, "wall_us": wall_us,
                "rel_err": 1e-3, "tolerance": 3e-2, "rel_err_base": None, "tolerance_base": None}

    rows = [row("bf16", "reduce_overhead", 900.0, 1000.0), row("bf16", decode.HELION, 600.0, 640.0),
            row("int4_weight_only", decode.HELION, 500.0, 600.0), row("bf16", decode.HELION, 10.0, 10.0, batch=8),
            row("int4_weight_only", decode.HELION_FROZEN, 450.0, 495.0)]
    rows[1]["hbm_floor_us"] = 540.0  # 1.5x over 900 us asks for 600 us, 90% of the floor
    assert decode.target_lines(rows) == [
        "batch 1, GPU: helion_inductor bf16 vs reduce_overhead bf16: 1.50x: met (>= 1.5x; it needs 90% of the HBM "
        "floor)",
        "batch 1, GPU: helion_inductor int4_weight_only vs reduce_overhead bf16: 1.80x: missed (>= 2x)",
        "batch 1, GPU: helion_inductor_frozen int4_weight_only vs reduce_overhead bf16: 2.00x: met (>= 2x)",
        "batch 1, helion_inductor bf16: wall / GPU 1.07: met (<= 1.1)",
        "batch 1, helion_inductor int4_weight_only: wall / GPU 1.20: missed (<= 1.1)",
        "batch 1, helion_inductor_frozen int4_weight_only: wall / GPU 1.10: met (<= 1.1)",
    ]


def test_step_bytes_count_each_weight_once_and_only_what_the_step_reads():
    """A step's floor: every weight and norm once, the tokens' embedding rows (not the table), one position's
    rotary angles, each cache up to the step's position, and the logits."""
    model = decode.build_model(TINY, torch.float32, torch.device("cpu"), seed=0)
    batch, c = 3, TINY
    model.allocate_cache(batch, c.context, seed=1)
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    layer = c.hidden * (2 * q + 2 * kv) + 3 * c.hidden * c.intermediate + 2 * c.head_dim + 2 * c.hidden
    weights = c.layers * layer + c.hidden + c.hidden * c.vocab  # the layers, the final norm, the LM head
    caches = c.layers * 2 * batch * kv * (c.context + 1)
    reads = batch * c.hidden + 2 * c.head_dim + batch * c.vocab  # embedding rows, cos and sin, logits
    positions = c.max_len * 8  # the int64 positions the mask compares against
    assert decode.step_bytes(model, batch) == 4 * (weights + caches + reads) + positions
