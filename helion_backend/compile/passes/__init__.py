"""The backend's FX pass pipeline, run as Inductor's post-grad custom pre pass.

Each pass is a :class:`~helion_backend.compile.graph_pass.GraphPass`. The pipeline is ``ANALYSIS`` then
``TRANSFORMS``: analysis passes leave the graph untouched, so when one of them fails the graph is
handed to Inductor unchanged.
"""

from helion_backend.compile.passes.attention import AttentionPass
from helion_backend.compile.passes.attention_rewrite import AttentionRewritePass
from helion_backend.compile.passes.cleanup import CleanupPass
from helion_backend.compile.passes.legality import LegalityPass
from helion_backend.compile.passes.match import MatchPass
from helion_backend.compile.passes.normalize import NormalizePass
from helion_backend.compile.passes.placement import PlacementPass
from helion_backend.compile.passes.rewrite import RewritePass
from helion_backend.compile.passes.shared_input import SharedInputPass
from helion_backend.compile.passes.siblings import SiblingsPass

ANALYSIS = (NormalizePass(), MatchPass(), SiblingsPass(), LegalityPass(), PlacementPass(), SharedInputPass(),
            AttentionPass())
TRANSFORMS = (RewritePass(), AttentionRewritePass(), CleanupPass())
