"""The pass interface: one stage of the pipeline, run by :class:`~helion_backend.compile.manager.HelionPassManager`.

A pass reads and writes the :class:`~helion_backend.compile.context.PassContext` only; what two passes both
need lives in a helper module (:mod:`.selection`, :mod:`.placing`, :mod:`.graph_edit`), never in another pass.
The manager asks :meth:`GraphPass.enabled` once per graph, times :meth:`GraphPass.run` and, with option
``debug_dir``, dumps the sites and the graph around it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from helion_backend.compile.context import PassContext
    from helion_backend.options import BackendOptions


class GraphPass:
    """One stage: ``name`` (in logs, dumps and the report's error), a switch read from the options, the work."""

    name: ClassVar[str]

    def enabled(self, options: BackendOptions) -> bool:
        """Whether the pass runs under ``options`` (the one place its switch is read)."""
        return True

    def run(self, ctx: PassContext) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<pass {self.name}>"
