"""Stage boundaries: the bottleneck split is optimal (against brute force), cut points."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from conveyor.planner import Profile, Unit, UnitStats
from conveyor.planner.partition import bottleneck_split, cut_points


def _brute_force(costs: np.ndarray, can_start: np.ndarray, num_stages: int) -> float:
    n = len(can_start) - 1
    best = np.inf
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        if not all(can_start[c] for c in cuts):
            continue
        bounds = [0, *cuts, n]
        best = min(best, max(costs[a, b] for a, b in itertools.pairwise(bounds)))
    return float(best)


@pytest.mark.parametrize("seed", range(20))
def test_the_split_is_optimal_for_its_cost(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, num_stages = int(rng.integers(3, 9)), int(rng.integers(1, 4))
    weights = rng.exponential(size=n)
    costs = np.full((n + 1, n + 1), np.inf)
    for a in range(n):
        for b in range(a + 1, n + 1):
            # a stage's cost: its work plus a made-up overhead, inf where "memory" is exceeded
            cost = weights[a:b].sum() + 0.1 * (b - a) ** 0.5
            costs[a, b] = cost if rng.random() > 0.15 else np.inf
    can_start = np.array([True] + [bool(rng.random() > 0.2) for _ in range(n - 1)] + [False])
    starts = bottleneck_split(lambda j: costs, can_start, num_stages, [0] * num_stages)
    expected = _brute_force(costs, can_start, num_stages)
    if starts is None:
        assert expected == np.inf
        return
    bounds = [*starts, n]
    assert max(costs[a, b] for a, b in itertools.pairwise(bounds)) == pytest.approx(expected)


def test_stages_start_where_one_value_crosses_when_there_are_enough_such_places() -> None:
    # embed, then two residual blocks norm -> fc -> add(block input, fc): cutting before a
    # block's fc would send two values (its input and norm's output), before a norm one
    inputs = [(-1,), (0,), (1,), (0, 2), (3,), (4,), (3, 5)]
    targets = ["embed", "0.norm", "0.fc", "", "1.norm", "1.fc", ""]
    units = tuple(
        Unit(f"u{i}", t, ins, 0, 0) for i, (t, ins) in enumerate(zip(targets, inputs, strict=True))
    )
    stats = tuple(UnitStats(1, 2, 1, 1, 0, 8, (False,) * len(ins), False, 8) for ins in inputs)
    profile = Profile("residual", units, {1: stats}, {1: (0.0, 0.0)}, 8)
    assert list(cut_points(profile, 1)) == [True, True, False, False, True, False, False, False]
    # two ranks want four such places, the model has three: every module call is one
    assert list(cut_points(profile, 2)) == [True, True, True, False, True, True, False, False]
