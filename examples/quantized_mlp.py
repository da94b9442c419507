"""Quantize a transformer MLP block in each format, compile it with helion_inductor, check and report.

    python examples/quantized_mlp.py

For each format of ``helion_backend.quantize.QUANT_FORMATS`` the script quantizes a copy of the
block, compiles it, and prints how far the compiled output is from the eager quantized one (they
should agree to rounding) and its SQNR against the float block in float64 (the cost of the format),
then what the backend fused. On a GPU the block runs in bf16; on a CPU in float32, with the rewrite
asked for explicitly (``rewrite_on_cpu``) so that the report shows what would be fused.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

try:
    import helion_backend
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import helion_backend
from quickstart import MLPBlock  # examples/ is on the path when this file runs as a script

from helion_backend.quantize import QUANT_FORMATS, quantize


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - out).pow(2).sum())).item()


def main() -> None:
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    model = MLPBlock(hidden=256, intermediate=512).to(device, dtype).eval()
    x = torch.randn(2, 4, 256, device=device, dtype=dtype)  # 8 tokens: a decode step at batch 8
    options = {} if on_gpu else {"rewrite_on_cpu": True}
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())

    summaries = []
    for fmt in QUANT_FORMATS:
        quantized = quantize(copy.deepcopy(model), fmt)
        torch._dynamo.reset()
        helion_backend.clear_reports()
        compiled = torch.compile(quantized, backend="helion_inductor", options=options)
        with torch.no_grad():
            eager, out = quantized(x), compiled(x)
        diff = (out.double() - eager.double()).abs().max().item()
        print(f"{fmt:>17}: max |compiled - eager| {diff:.2e}, block SQNR vs float {sqnr_db(reference, out):5.1f} dB")
        summaries.append((fmt, [report.summary() for report in helion_backend.get_reports()]))

    for fmt, reports in summaries:
        print(f"\n== {fmt}")
        print("\n".join(reports) or "(no graph report)")


if __name__ == "__main__":
    main()
