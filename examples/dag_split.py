"""See a graph split before starting any process: `python examples/dag_split.py`.

Splits the two-tower model by naming each stage's modules, prints the stages and the
simulated 1F1B schedule of the graph pipeline beside the chain pipeline of the same stages
(tower B relaying tower A's output), then lets auto_split choose a split by itself.
"""

from __future__ import annotations

from conveyor.graph import StageGraph
from conveyor.models import multimodal_batches, two_tower
from conveyor.schedule import build_program
from conveyor.simulator import simulate
from conveyor.split import split_by_modules
from conveyor.split.auto import auto_split
from conveyor.trace import render_grid


def show(title: str, graph: StageGraph, num_microbatches: int = 4) -> None:
    print(f"{title}: {graph.num_stages} stages, depth {graph.depth}")
    for stage in graph.stages:
        print(
            f"  stage {stage.index} on rank {stage.rank}: {', '.join(stage.inputs)} -> "
            f"{', '.join(stage.outputs)}"
        )
    topology = graph.topology()
    timeline = simulate(build_program("1f1b", topology, num_microbatches), topology)
    print(render_grid(timeline))
    print(
        f"  1F1B, {num_microbatches} micro-batches, F=1 B=2: step {timeline.step_time:g}, "
        f"bubble {timeline.bubble_fraction:.0%}\n"
    )


def main() -> None:
    model = two_tower()
    stages = [["text"], ["image"], ["head"]]
    show("graph pipeline", split_by_modules(model, stages))
    show("chain pipeline (skips relayed)", split_by_modules(model, stages, relay_skips=True))
    ((inputs, _),) = multimodal_batches(batch_size=8, num_batches=1)
    show("auto_split into 3 stages", auto_split(model, 3, example_inputs=inputs))


if __name__ == "__main__":
    main()
