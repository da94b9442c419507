"""The fused op's spec: one string per site, parsed back to the same spec, and a garbled one refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from helion_backend.runtime.ops import gemm_epilogue
from helion_backend.semantics.gemm_spec import GemmSpec, SpecError
from helion_backend.semantics.norm import RmsNormSpec

SINGLE = GemmSpec("gemm_glu", torch.bfloat16, ("nk",), (("bias", "scale", "silu", "up_mul"),), scalars=(0.5, 2.0),
                  prologue=("rmsnorm",), up_layout="kn", up_epilogue=("scale",), norm=RmsNormSpec(1e-6, True),
                  max_helion_m=32, config_dir="/tmp/tables", site="graph_0:addmm_1", frozen_weights=True)
SHARED = GemmSpec("gemm_multi", torch.float16, ("nk", "nk", "kn"), (("bias",), (), ("residual",)), max_helion_m=8,
                  site="graph_1:mm")


@pytest.mark.parametrize("spec", [SINGLE, SHARED], ids=["single", "shared"])
def test_the_key_round_trips_and_is_deterministic(spec):
    key = spec.to_key()
    assert GemmSpec.from_key(key) == spec
    assert GemmSpec.from_key(key) is GemmSpec.from_key(key)  # parsed once per distinct string
    assert GemmSpec(**{f: getattr(spec, f) for f in spec.__dataclass_fields__}).to_key() == key


def test_a_quantized_site_carries_its_program():
    from helion_backend.layers.quantize import QUANT_FORMATS
    from helion_backend.tuning.problems import _trace

    layer = QUANT_FORMATS["fp8_dynamic"].from_linear(torch.nn.Linear(256, 128)).eval()
    program = _trace(layer, torch.randn(3, 256), fuse_activation_quant=True).quant_program
    spec = GemmSpec("gemm_fp8", torch.float32, ("nk",), (("act_scale", "channel_scale", "bias"),),
                    prologue=("quant_fp8_per_token",), quant_program=program, max_helion_m=32)
    assert GemmSpec.from_key(spec.to_key()) == spec


@pytest.mark.parametrize("key, problem", [
    ("not json", "is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({**json.loads(SHARED.to_key()), "colour": "red"}), r"unknown field\(s\) \['colour'\]"),
    (json.dumps({k: v for k, v in json.loads(SHARED.to_key()).items() if k != "site"}), r"missing field\(s\) \['site'\]"),
    (SHARED.to_key().replace('"gemm_multi"', '"gemm_fp4"'), "unknown kernel family 'gemm_fp4'"),
    (SHARED.to_key().replace('"residual"', '"residul"'), r"unknown epilogue step\(s\) \['residul'\]"),
    (SHARED.to_key().replace('"float16"', '"float17"'), "'out_dtype' must name a torch dtype, got 'float17'"),
    (SHARED.to_key().replace('"kn"', '"nn"'), "weight layout must be one of"),
    (SHARED.to_key().replace('"max_helion_m":8', '"max_helion_m":"8"'), "'max_helion_m' has the wrong type"),
    (SHARED.to_key().replace('"frozen_weights":false', '"frozen_weights":0'), "'frozen_weights' must be true or false"),
    (SINGLE.to_key().replace('"norm":{"eps":1e-06,"round_before_weight":true}', '"norm":null'),
     "the rmsnorm prologue step and the norm spec go together"),
])
def test_a_garbled_key_is_refused_naming_the_problem(key, problem):
    with pytest.raises(SpecError, match=problem):
        GemmSpec.from_key(key)


def test_the_op_takes_its_tensors_and_the_key():
    x, w, bias = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    spec = GemmSpec("gemm", torch.float32, ("nk",), (("bias", "scale", "relu"),), scalars=(0.5,), site="t:mm")
    out = gemm_epilogue(x, w, None, None, [bias], None, spec.to_key())
    torch.testing.assert_close(out.double(), torch.relu((x.double() @ w.double().t() + bias.double()) * 0.5),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"prologue \['dequant_int4'\] reads \[N, \.\.\] weights"):
        GemmSpec("gemm_int4", torch.float32, ("kn",), ((),), prologue=("dequant_int4",))
