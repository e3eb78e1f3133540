"""The search behind auto_split (conveyor.split.cut), on plain data."""

from __future__ import annotations

import pytest

from conveyor.split.cut import DataflowGraph, best_cut, branch_order, cut_in_order


def test_branch_order_finishes_each_branch_before_the_next() -> None:
    # fx order interleaves two towers: a0 b0 a1 b1 join
    inputs = [[], [], [0], [1], [2, 3]]
    assert branch_order(inputs) == [0, 2, 1, 3, 4]
    assert branch_order([[], [0], [1]]) == [0, 1, 2]


def test_best_cut_trades_the_worst_stage_against_depth() -> None:
    towers = DataflowGraph(costs=[4, 4, 4, 4, 8], inputs=[[], [], [0], [1], [2, 3]])
    plan = best_cut(towers, 3, num_microbatches=4)
    assert plan.stage_of == (0, 1, 0, 1, 2) and plan.depth == 2  # towers side by side
    light = DataflowGraph(
        costs=[1.0] * 10 + [1.0] * 10 + [0.1],
        inputs=[[]]
        + [[i - 1] for i in range(1, 10)]
        + [[]]
        + [[i - 1] for i in range(11, 20)]
        + [[9, 19]],
    )
    # with a light join, cutting the towers into a balanced chain is faster
    assert best_cut(light, 3).depth == 3


def test_cut_keeps_units_and_shared_weights_whole() -> None:
    chain = DataflowGraph(
        costs=[1] * 6,
        inputs=[[]] + [[i - 1] for i in range(1, 6)],
        units=["a", "a", "a", "b", "b", "b"],
    )
    assert cut_in_order(chain, range(6), 2).starts == (0, 3)
    tied = DataflowGraph(
        costs=[1] * 6, inputs=[[]] + [[i - 1] for i in range(1, 6)], together=[[0, 4]]
    )
    assert cut_in_order(tied, range(6), 2).starts == (0, 5)
    with pytest.raises(ValueError, match="only 0 places to cut"):
        cut_in_order(
            DataflowGraph(costs=[1] * 3, inputs=[[], [0], [1]], units=["a"] * 3), range(3), 2
        )
    with pytest.raises(ValueError, match="topological order"):
        DataflowGraph(costs=[1, 1], inputs=[[1], []])


def test_byte_cost_keeps_cuts_away_from_large_tensors() -> None:
    costs, inputs = [0.5, 1.0, 1.5, 1.0], [[], [0], [1], [2]]
    sizes = [1.0, 100.0, 1.0, 1.0]  # node 1 produces a large tensor
    assert cut_in_order(DataflowGraph(costs, inputs, sizes), range(4), 2).starts == (0, 2)
    costly = DataflowGraph(costs, inputs, sizes, byte_cost=0.05)
    plan = cut_in_order(costly, range(4), 2)
    assert plan.starts == (0, 3) and plan.stage_costs == pytest.approx((3.0, 1.05))
