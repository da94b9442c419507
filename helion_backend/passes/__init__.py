"""The backend's FX pass pipeline, run as Inductor's post-grad custom pre pass.

Each pass is one module with ``run(ctx: PassContext) -> None``; the pipeline is their order.
"""

from . import cleanup, legality, match, normalize, rewrite

PIPELINE = (normalize, match, legality, rewrite, cleanup)
