"""Match: follow each GEMM's epilogue through the graph and pick the rule that fuses most of it
(:mod:`helion_backend.compile.selection`).

A quantized GEMM whose input was quantized per token just before it reads the quantized rows, and its
``token_scale`` step multiplies by their scale: Inductor computes the quantization, fused into the kernel
that produces the activation (an RMSNorm, a residual add), at no launch of its own. With the option
``fuse_activation_quant`` the GEMM takes that quantization as its prologue instead: the kernel then reads
the float activation, and the ``token_scale`` step becomes ``act_scale`` (the kernel knows that scale).
"""

from __future__ import annotations

from helion_backend.compile import selection
from helion_backend.compile.context import PassContext
from helion_backend.compile.graph_pass import GraphPass


class MatchPass(GraphPass):
    name = "match"

    def run(self, ctx: PassContext) -> None:
        for site in ctx.sites:
            selection.follow_chain(site, ctx.options.fuse_activation_quant)
            selection.choose_rule(site, ctx.rules)
