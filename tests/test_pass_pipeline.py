"""The pipeline's passes are objects: a name, a switch read from the options once, the work."""

from helion_backend.compile.graph_pass import GraphPass
from helion_backend.compile.manager import HelionPassManager
from helion_backend.compile.passes import ANALYSIS, TRANSFORMS
from helion_backend.options import BackendOptions

PIPELINE = ["normalize", "match", "siblings", "legality", "placement", "shared_input", "attention", "rewrite",
            "attention_rewrite", "cleanup"]


def test_the_pipeline_is_its_passes_in_order_each_named_once():
    stages = [*ANALYSIS, *TRANSFORMS]
    assert all(isinstance(stage, GraphPass) for stage in stages)
    assert [stage.name for stage in stages] == PIPELINE


def test_the_manager_reads_each_pass_switch_from_the_options():
    def names(manager: HelionPassManager) -> list[str]:
        return [stage.name for stage in [*manager.analysis, *manager.transforms]]

    assert names(HelionPassManager(BackendOptions.from_user({}))) == PIPELINE
    off = HelionPassManager(BackendOptions.from_user({"merge_siblings": False}))
    assert names(off) == [name for name in PIPELINE if name != "shared_input"]
