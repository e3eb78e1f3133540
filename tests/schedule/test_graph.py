"""StageGraph: validation, producers and consumers, skip edges, depth."""

from __future__ import annotations

import pytest

from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph, chain


def test_chain_is_a_line() -> None:
    graph = chain(3)
    assert [graph.producers(s) for s in range(3)] == [[], [0], [1]]
    assert graph.consumers(0) == [1] and graph.sink == 2 and graph.depth == 3
    assert [graph.distance_to_sink(s) for s in range(3)] == [2, 1, 0]


def test_skip_edge_and_branches() -> None:
    stages = (
        Stage(0, 0, ("input",), ("a", "skip")),
        Stage(1, 1, ("a",), ("b",)),
        Stage(2, 2, ("b", "skip"), (MODEL_OUTPUT,)),
    )
    graph = StageGraph(stages)
    assert graph.consumers(0) == [1, 2]
    assert graph.edge_values(0, 2) == ("skip",)
    assert graph.depth == 3 and graph.distance_to_sink(0) == 2


def test_placement_round_robin() -> None:
    graph = chain(4, num_ranks=2)
    assert [graph.rank_of(s) for s in range(4)] == [0, 1, 0, 1]
    assert graph.stages_on(1) == [1, 3]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ((Stage(0, 0, ("nope",), (MODEL_OUTPUT,)),), "takes 'nope'"),
        ((Stage(0, 0, ("input",), ("a",)),), "no stage produces the model output"),
        ((Stage(0, 1, ("input",), (MODEL_OUTPUT,)),), "expected every rank"),
    ],
)
def test_invalid_graphs_are_rejected(stages: tuple[Stage, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StageGraph(stages)
