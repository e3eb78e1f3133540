"""GPipe and 1F1B as literal data, and their invariants over a grid of sizes."""

from __future__ import annotations

import pytest

from conveyor.graph import chain
from conveyor.schedule import SCHEDULES, forward_only, gpipe, one_f_one_b, validate
from conveyor.simulator import simulate


def compute(program: object, rank: int) -> list[str]:
    return [str(a) for a in program[rank] if a.is_compute]  # type: ignore[index]


def test_one_f_one_b_literal() -> None:
    program = one_f_one_b(chain(2), num_microbatches=3)
    assert compute(program, 0) == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert compute(program, 1) == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]


def test_gpipe_literal() -> None:
    program = gpipe(chain(2), num_microbatches=2)
    assert compute(program, 0) == ["0F0", "0F1", "0B1", "0B0"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8, 16])
def test_schedules_are_valid_with_the_textbook_bubble(
    name: str, num_stages: int, num_microbatches: int
) -> None:
    graph = chain(num_stages)
    program = SCHEDULES[name](graph, num_microbatches)
    validate(program, graph)
    # F=1, B=2 units: step = (m + p - 1) * 3, bubble = (p - 1) / (m + p - 1)
    timeline = simulate(program, graph)
    p, m = num_stages, num_microbatches
    assert timeline.step_time == pytest.approx(3 * (m + p - 1))
    assert timeline.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("num_microbatches", [1, 4, 9])
def test_one_f_one_b_keeps_at_most_p_microbatches_in_flight(num_microbatches: int) -> None:
    p = 4
    program = one_f_one_b(chain(p), num_microbatches)
    for rank in range(p):
        alive = peak = 0
        for action in compute(program, rank):
            alive += 1 if "F" in action else -1
            peak = max(peak, alive)
        assert peak == min(p - rank, num_microbatches)


def test_forward_only_has_no_backward() -> None:
    program = forward_only(chain(3), 4)
    validate(program, chain(3))
    assert all("B" not in a for r in range(3) for a in compute(program, r))


def test_one_f_one_b_refuses_virtual_stages() -> None:
    with pytest.raises(ValueError, match="runs one stage per rank"):
        one_f_one_b(chain(4, num_ranks=2), 4)
    with pytest.raises(ValueError, match="interleaved"):  # the registry names the alternatives
        SCHEDULES["1f1b"](chain(4, num_ranks=2), 4)
