"""The backend's FX pass pipeline, run as Inductor's post-grad custom pre pass.

Each pass is one module with ``run(ctx: PassContext) -> None``. The pipeline is ``ANALYSIS`` then
``TRANSFORMS``: analysis passes leave the graph untouched, so when one of them fails the graph is
handed to Inductor unchanged.
"""

from helion_backend.compile.passes import (
    attention,
    attention_rewrite,
    cleanup,
    legality,
    match,
    normalize,
    placement,
    rewrite,
    shared_input,
    siblings,
)

ANALYSIS = (normalize, match, siblings, legality, placement, shared_input, attention)
TRANSFORMS = (rewrite, attention_rewrite, cleanup)
