"""Attention rewrite: replace each attention site placed on Helion or the reference by one
``decode_attention`` op call, read where the graph read the node's output 0."""

from __future__ import annotations

from helion_backend.compile.context import PassContext
from helion_backend.compile.graph_edit import fused_op, insert_call
from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.recognize.patterns import val
from helion_backend.report import site_id


class AttentionRewritePass(GraphPass):
    name = "attention_rewrite"

    def run(self, ctx: PassContext) -> None:
        for site in ctx.attention:
            if site.runs_on == "inductor":
                continue
            try:
                with ctx.graph.inserting_before(site.output):
                    fused = insert_call(ctx.graph, fused_op("decode_attention"), (
                        site.query, site.key, site.value, site.mask, site.scale, site.masked_bias,
                        list(val(site.output).stride()),
                        site_id(ctx.report.graph, site.node.name),
                    ), origin=site.node)
            except Exception as e:  # leave the node to Inductor: what was inserted before the failure is dead
                site.runs_on, site.reason = "inductor", f"rewrite failed ({type(e).__name__}: {e})"
                continue
            site.output.replace_all_uses_with(fused)
            site.fused = fused


