"""Cut a model into a StageGraph: by split points, by named submodules, or automatically.

    graph = split_model(model, ["layers.4"])                          # a chain, forward order
    graph = split_by_modules(model, [["text"], ["image"], ["head"]])  # a DAG, by hand
    graph = auto_split(model, num_stages=3, example_inputs=batch)     # a DAG, searched
    run_stages(graph, bind_inputs(model, batch))                      # == model(batch)

Every stage is an ``fx.GraphModule`` that keeps the original submodules under their original
qualified names. A value used by a later stage becomes an edge to it, however far: skip
connections go straight from producer to consumer (``relay_skips=True`` instead passes them
through every stage in between, as chain-only pipelines must).

Modules: ``frontend`` (``capture``: one way in for every method: torch.fx, or torch.export
for what fx cannot trace, ``export``, on fake tensors of the real device for a model built on
the meta device, ``fake``), ``points`` (split points), ``modules`` (stage modules), ``auto``
(automatic cut) and ``cut`` (its pure search), ``skip`` (stash/pop skips for nn.Sequential),
``inputs``, ``untouched`` (measuring a model without changing it), ``vocab`` (a head and
loss cut along the vocabulary, so stages can start inside it); the internal ``capture``
(fx) and ``stages`` are what they share.
"""

from conveyor.split.auto import auto_split
from conveyor.split.frontend import Traced, Tracer, capture
from conveyor.split.inputs import bind_inputs, run_stages
from conveyor.split.modules import StageAnnotation, split_by_modules
from conveyor.split.points import balance_to_split_points, even_balance, split_model
from conveyor.split.skip import pop, skippable, stash, verify_skips
from conveyor.split.stages import build_stage_graph
from conveyor.split.vocab import ChunkedHeadLoss

__all__ = [
    "ChunkedHeadLoss",
    "StageAnnotation",
    "Traced",
    "Tracer",
    "auto_split",
    "balance_to_split_points",
    "bind_inputs",
    "build_stage_graph",
    "capture",
    "even_balance",
    "pop",
    "run_stages",
    "skippable",
    "split_by_modules",
    "split_model",
    "stash",
    "verify_skips",
]
