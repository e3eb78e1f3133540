"""The simulator (conveyor.simulator): programs run in order, by the runtime's blocking rules."""

from __future__ import annotations

import itertools

import pytest

from conveyor import build_program, chain
from conveyor.graph import place
from conveyor.schedule import SCHEDULES, Action, Kind, Program, spec_of
from conveyor.simulator import DeadlockError, UnitCost, simulate


def _layout(name: str, num_ranks: int) -> tuple[int, list[int]]:
    wanted = spec_of(name)
    num_stages = wanted.virtual_stages * num_ranks
    return num_stages, place(num_stages, num_ranks, wanted.placement)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_executes_in_program_order_without_overlap(name: str) -> None:
    num_stages, placement = _layout(name, 3)
    graph = chain(num_stages, placement=placement)
    program = build_program(name, graph, 6)
    timeline = simulate(program, graph, UnitCost(latency=0.25))
    for rank in range(3):
        events = timeline.on(rank)
        compute = [e.action for e in events if e.is_compute]
        assert compute == [str(a) for a in program[rank] if a.is_compute]
        for before, after in itertools.pairwise(events):
            assert after.start >= before.end - 1e-12


class _Costs:
    """F=1, B=2, transfers 0.5 after the send, sends 0.1, posting 0.05, collecting 0.01."""

    def compute(self, action: Action) -> float:
        return 1.0 if action.kind is Kind.F else 2.0

    def transfer(self, action: Action) -> float:
        return 0.5

    def overhead(self, action: Action) -> float:
        return 0.1 if action.kind.is_send else 0.05

    def wait(self, action: Action) -> float:
        return 0.01


def test_transfers_overheads_and_waits_follow_the_runtime_rules() -> None:
    graph = chain(2)
    program = build_program("gpipe", graph, 1)
    assert str(program) == "0F0 0SF0>1 0RB0<1 0B0\n1RF0<0 1F0 1B0 1SB0>0"
    timeline = simulate(program, graph, _Costs())
    spans = {(e.rank, e.action): (round(e.start, 6), round(e.end, 6)) for e in timeline.events}
    assert spans == {
        (0, "0F0"): (0.0, 1.0),
        (0, "0SF0>1"): (1.0, 1.1),
        (0, "0RB0<1"): (1.1, 1.15),
        (0, "wait 0RB0<1"): (1.15, 5.22),
        (0, "0B0"): (5.22, 7.22),
        (1, "1RF0<0"): (0.0, 0.05),
        (1, "wait 1RF0<0"): (0.05, 1.61),
        (1, "1F0"): (1.61, 2.61),
        (1, "1B0"): (2.61, 4.61),
        (1, "1SB0>0"): (4.61, 4.71),
        (1, "wait sends"): (4.71, 5.21),
    }
    assert timeline.step_time == pytest.approx(7.22)


def test_a_receive_posted_out_of_order_is_a_deadlock() -> None:
    graph = chain(2)
    program = Program.parse(
        "0F0 0F1 0SF1>1 0SF0>1 0RB0<1 0RB1<1 0B0 0B1\n1RF0<0 1RF1<0 1F0 1F1 1B0 1SB0>0 1B1 1SB1>0"
    )
    with pytest.raises(DeadlockError, match="post receives in the order"):
        simulate(program, graph)


class _Reducing(UnitCost):
    """Unit costs, and half a unit to reduce a stage's gradients over the replicas."""

    def reduce(self, stage: int) -> float:
        return 0.5


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v"])
def test_each_stage_is_reduced_right_after_its_last_weight_gradient(name: str) -> None:
    num_stages, placement = _layout(name, 2)
    graph = chain(num_stages, placement=placement)
    program = build_program(name, graph, 4)
    plain = simulate(program, graph)
    timeline = simulate(program, graph, _Reducing())
    for rank in range(2):
        events = [e for e in timeline.on(rank) if not e.action.startswith("wait")]
        reduced = [e for e in events if e.kind == "reduce"]
        assert sorted(e.action for e in reduced) == [
            f"reduce {s}" for s in range(num_stages) if placement[s] == rank
        ]
        for event in reduced:
            stage = int(event.action.split()[1])
            last = max(
                (
                    e
                    for e in events
                    if e.stage == stage and e.kind in ("backward", "backward_weight")
                ),
                key=lambda e: e.end,
            )
            assert event.start == last.end and event.duration == 0.5
    # the reductions that end a rank's step lengthen it; nothing overlaps on a rank
    assert plain.step_time < timeline.step_time <= plain.step_time + 0.5 * num_stages


class _ReducingInFlight(_Reducing):
    """As _Reducing, with the reductions behind the step unless the backward is split."""

    def reduces_in_flight(self, split_backward: bool) -> bool:
        return not split_backward


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_reductions_in_flight_overlap_the_rest_of_the_step(name: str) -> None:
    num_stages, placement = _layout(name, 2)
    graph = chain(num_stages, placement=placement)
    program = build_program(name, graph, 4)
    in_line = simulate(program, graph, _Reducing())
    timeline = simulate(program, graph, _ReducingInFlight())
    for rank in range(2):
        events = timeline.on(rank)
        reduced = [e for e in events if e.kind == "reduce"]
        # a reduction shows as the wait for it after the rank's last action
        assert all(e.start >= max(x.end for x in events if x.kind != "reduce") for e in reduced)
        # one after another from the first stage's last backward: the rank ends no earlier
        last_backward = {
            s: max(e.end for e in events if e.stage == s and e.kind == "backward")
            for s in range(num_stages)
            if placement[s] == rank
        }
        ends, free = [], 0.0
        for stage in sorted(last_backward, key=last_backward.__getitem__):
            free = max(free, last_backward[stage]) + 0.5
            ends.append(free)
        assert max(e.end for e in events) == pytest.approx(
            max([*ends, max(x.end for x in events if x.kind != "reduce")])
        )
    # what the reductions overlap no longer adds to the step
    assert timeline.step_time < in_line.step_time


def test_a_split_backward_keeps_its_reductions_in_line() -> None:
    num_stages, placement = _layout("zb-v", 2)
    graph = chain(num_stages, placement=placement)
    program = build_program("zb-v", graph, 4)
    in_flight = simulate(program, graph, _ReducingInFlight())
    assert in_flight.events == simulate(program, graph, _Reducing()).events
