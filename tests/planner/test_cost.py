"""Costs of a profiled model (conveyor.planner.cost): units summed, overheads, memory as the
runtime's meter counts it, and (on two gloo ranks) predicted activation memory against it."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor import Pipeline, build_program, chain
from conveyor.graph import place
from conveyor.planner import (
    Overheads,
    Profile,
    ProfileCost,
    Unit,
    UnitStats,
    Workload,
    layout,
    predict,
    profile_model,
    split_units,
)
from conveyor.schedule import SCHEDULES, Action, Kind, Program, spec_of
from conveyor.simulator import simulate
from conveyor.trace import Timeline
from dist import run_ranks


def _layout(name: str, num_ranks: int) -> tuple[int, list[int]]:
    wanted = spec_of(name)
    num_stages = wanted.virtual_stages * num_ranks
    return num_stages, place(num_stages, num_ranks, wanted.placement)


# -- a synthetic profile: four units in a chain ---------------------------------------------


def _profile(num_units: int = 4, **overheads: float) -> Profile:
    units = tuple(
        Unit(f"u{i}", str(i), (i - 1,), 100 * (i + 1), 100 * (i + 1)) for i in range(num_units)
    )
    stats = tuple(
        UnitStats(
            forward=1.0 + i,
            backward=2.0 + i,
            backward_input=1.0,
            backward_weight=1.0 + i,
            saved_bytes=1000 * (i + 1),
            output_bytes=10,
            saves_input=(True,),
            saves_output=False,
            message_bytes=10,
            weight_grad_bytes=7,
        )
        for i in range(num_units)
    )
    return Profile(
        "synthetic",
        units,
        {4: stats},
        {4: (0.5, 0.25)},
        input_bytes_per_sample=3,
        overheads=Overheads(**overheads),
    )


def test_profile_costs_sum_units_and_add_overheads_loss_and_recomputation() -> None:
    profile = _profile(forward=0.1, backward=0.2)
    graph, units = layout(profile, split_units(4, [2, 2]))
    cost = ProfileCost(profile, graph, units, 4, 3, recompute=["never", "except_last"])
    assert cost.compute(Action(0, Kind.F, 0)) == pytest.approx(1 + 2 + 0.1)
    assert cost.compute(Action(0, Kind.B, 0)) == pytest.approx(2 + 3 + 0.2)
    # the last stage adds the loss; it recomputes micro-batches 0 and 1, not the last one
    assert cost.compute(Action(1, Kind.F, 2)) == pytest.approx(3 + 4 + 0.5 + 0.1)
    assert cost.compute(Action(1, Kind.B, 2)) == pytest.approx(4 + 5 + 0.25 + 0.2)
    assert cost.compute(Action(1, Kind.B, 0)) == pytest.approx(4 + 5 + 0.25 + 0.2 + 7.5)
    assert cost.compute(Action(1, Kind.I, 2)) == pytest.approx(1 + 1 + 0.25 + 0.2)
    assert cost.compute(Action(1, Kind.W, 2)) == pytest.approx(3 + 4 + 0.2)
    # stage 0 takes only the model input, which needs no gradient: all of its backward is W
    assert cost.compute(Action(0, Kind.I, 0)) == pytest.approx(0.2)
    assert cost.compute(Action(0, Kind.W, 0)) == pytest.approx(2 + 3 + 0.2)


def test_memory_is_the_largest_micro_batchs_and_time_the_average() -> None:
    """A batch of 30 in 4 micro-batches runs 8, 8, 7, 7 samples: the peak holds 8-sample
    activations, while the step's time adds up 7.5 on average."""
    small = _profile()
    large = tuple(dataclasses.replace(u, forward=2 * u.forward, saved_bytes=2 * u.saved_bytes)
                  for u in small.stats[4])  # fmt: skip
    profile = dataclasses.replace(
        small, stats={4: small.stats[4], 8: large}, loss={4: (0.5, 0.25), 8: (1, 0.5)}
    )
    graph, units = layout(profile, split_units(4, [2, 2]))
    uneven, eight = (ProfileCost(profile, graph, units, size, 4) for size in (7.5, 8))
    assert uneven.activation_bytes(0, 0) == eight.activation_bytes(0, 0) == 6000 + 10 + 10
    assert uneven.compute(Action(0, Kind.F, 0)) == pytest.approx((2 + 4) * 7.5 / 8)


def test_recomputation_is_its_own_event_at_the_start_of_its_backward() -> None:
    profile = _profile()
    graph, units = layout(profile, split_units(4, [2, 2]))
    cost = ProfileCost(profile, graph, units, 4, 3, recompute=["never", "except_last"])
    assert cost.recompute(Action(1, Kind.B, 0)) == pytest.approx(3 + 4 + 0.5)
    assert cost.recompute(Action(1, Kind.B, 2)) == cost.recompute(Action(0, Kind.B, 0)) == 0.0
    timeline = simulate(build_program("1f1b", graph, 3), graph, cost)
    redone = {e.action: e for e in timeline.events if e.kind == "recompute"}
    assert sorted(redone) == ["recompute 1F0", "recompute 1F1"]
    for k in (0, 1):
        backward = next(e for e in timeline.events if e.action == f"1B{k}")
        assert redone[f"recompute 1F{k}"].start == backward.start
        assert redone[f"recompute 1F{k}"].duration == pytest.approx(7.5)
    assert timeline.busy_time(1) == pytest.approx(
        sum(e.duration for e in timeline.on(1) if e.is_compute)
    ), "inside its backward: not counted twice"


def test_activation_memory_is_counted_as_the_meter_counts_it() -> None:
    profile = _profile()
    graph, units = layout(profile, split_units(4, [2, 2]))
    cost = ProfileCost(profile, graph, units, 4, 3, recompute=["never", "always"])
    # stage 0: saved 1000 + 2000, its inner output (saved by unit 1) 10, its output 10
    assert cost.activation_bytes(0, 0) == 3000 + 10 + 10
    # stage 1 (recomputed): the received input (10) and the model output (10) only
    assert cost.activation_bytes(1, 0) == 10 + 10
    assert cost.resident_bytes(0) == 3 * 4 * 3 and cost.resident_bytes(1) == 0
    # between I and W: the saved tensors and W's gradients, not the stage's values; stage 0
    # takes no input that needs a gradient, so W starts from its output's gradient (10)
    assert cost.activation_after_input(0, 0) == 3000 + 10 + 10
    assert cost.activation_after_input(1, 0) == 10 + 2 * 7  # the input, kept for recomputation
    assert cost.static_bytes(0) == (100 + 200) * 4 and cost.static_bytes(1) == (300 + 400) * 4


@pytest.mark.parametrize(("name", "held", "held_last"), [("gpipe", 3, 3), ("1f1b", 2, 1)])
def test_peak_memory_counts_the_microbatches_a_schedule_keeps(
    name: str, held: int, held_last: int
) -> None:
    profile = _profile()
    graph, units = layout(profile, split_units(4, [2, 2]))
    cost = ProfileCost(profile, graph, units, 4, 3)
    prediction = predict(build_program(name, graph, 3), graph, cost)
    assert prediction.peak_activation[0] == held * cost.activation_bytes(0, 0) + 36
    assert prediction.peak_activation[1] == held_last * cost.activation_bytes(1, 0)
    assert prediction.total_memory[0] == prediction.peak_activation[0] + cost.static_bytes(0)
    quick = predict(build_program(name, graph, 3), graph, cost, record=False)
    assert quick.step_time == prediction.step_time
    assert quick.bubble_fraction == pytest.approx(prediction.bubble_fraction)
    assert quick.peak_activation == prediction.peak_activation and not quick.timeline.events


def test_split_backward_holds_part_of_the_activations_from_i_until_w() -> None:
    profile = _profile()
    graph, units = layout(profile, split_units(4, [2, 2]))
    cost = ProfileCost(profile, graph, units, 4, 2)
    program = Program.parse("0F0 0SF0>1 0RB0<1 0I0 0W0\n1RF0<0 1F0 1I0 1SB0>0 1W0", 1)
    memory = {e.action: e.memory for e in simulate(program, graph, cost).events if e.is_compute}
    resident = cost.resident_bytes(0)  # the batch's inputs, held while micro-batches live
    full = cost.activation_bytes(0, 0) + resident
    after = cost.activation_after_input(0, 0) + resident
    assert (memory["0F0"], memory["0I0"], memory["0W0"]) == (full, after, 0)


def test_layout_of_a_graph_sends_each_value_to_the_stages_that_use_it() -> None:
    units = (
        Unit("a", "a", (-1,), 0, 0),
        Unit("b", "b", (0,), 0, 0),
        Unit("c", "c", (0,), 0, 0),
        Unit("d", "d", (1, 2), 0, 0),
    )
    stats = tuple(UnitStats(1, 2, 1, 1, 0, 8, (False,) * len(u.inputs), False, 8) for u in units)
    profile = Profile("dag", units, {1: stats}, {1: (0.0, 0.0)}, 4)
    graph, _ = layout(profile, [[0], [1], [2], [3]])
    assert [graph.consumers(s) for s in range(4)] == [[1, 2], [3], [3], []]
    assert graph.stages[3].inputs == ("b", "c") and graph.depth == 3
    with pytest.raises(ValueError, match="later stage"):
        layout(profile, [[0], [3], [1, 2]])
    with pytest.raises(ValueError, match="belong to no stage"):
        layout(profile, [[0], [1]])


# -- predicted activation memory against the runtime, on two ranks -----------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    widths = [16, 32, 64, 48, 64, 32, 48, 32, 8]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])  # 8 Linear and 7 Tanh layers


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, 16, generator=generator), torch.randn(size, 8, generator=generator)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _memory_worker(rank: int, world_size: int, results: str) -> None:
    model = _mlp()
    batch_size, num_microbatches = 24, 6
    profile = profile_model(
        Workload("mlp", model, _batch, _loss),
        [batch_size // num_microbatches],
        threads=None,
        min_time_s=0.0,
        min_repeats=1,
    )
    lines = []
    for name in sorted(SCHEDULES):
        num_stages, placement = _layout(name, world_size)
        for recompute in ("never", "except_last"):
            units = split_units(profile.num_units, _even(profile.num_units, num_stages))
            pipe = Pipeline(
                _mlp(),
                loss_fn=_loss,
                schedule=name,
                placement=tuple(placement),
                balance=tuple(len(u) for u in units),
                num_microbatches=num_microbatches,
                recompute=recompute,
                measure_memory=True,
            )
            inputs, targets = _batch(batch_size)
            for _ in range(2):
                pipe.step(inputs, targets)
            measured = pipe.memory().peak_bytes
            graph, units = layout(profile, units, placement)
            cost = ProfileCost(
                profile, graph, units, batch_size / num_microbatches, num_microbatches, recompute
            )
            predicted = predict(build_program(name, graph, num_microbatches), graph, cost)
            lines.append(f"{name} {recompute} {measured} {predicted.peak_activation[rank]}")
    Path(results, f"rank{rank}.txt").write_text("\n".join(lines))


def _even(num_units: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_units, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


@pytest.mark.dist
def test_predicted_peak_activation_memory_matches_the_runtime_meter(tmp_path: Path) -> None:
    run_ranks(_memory_worker, tmp_path, timeout_s=240, results=str(tmp_path))
    for rank in range(2):
        for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines():
            name, recompute, measured, predicted = line.split()
            # exact for most; the meter keys storages by address, so the allocator reusing an
            # address can move a peak by one small tensor (1 KiB of ~11 KiB here)
            assert int(predicted) == pytest.approx(int(measured), rel=0.1), (name, recompute, rank)


def test_profile_costs_reject_a_split_that_does_not_cover_the_units() -> None:
    profile = _profile()
    graph = chain(2)
    with pytest.raises(ValueError, match="belong to no stage"):
        ProfileCost(profile, graph, [[0], [1]], 4, 2)
    with pytest.raises(ValueError, match="covers 3 units"):
        split_units(4, [1, 2])
    cost = ProfileCost(profile, graph, [[0, 1], [2, 3]], 4, 2)
    rng_state = torch.get_rng_state().numel()  # travels with every forward message
    assert cost.message_bytes(Action(0, Kind.SEND_F, 0, 1)) == 10 + rng_state
    assert cost.message_bytes(Action(0, Kind.RECV_B, 0, 1)) == 10


def test_simulate_command_predicts_a_profiled_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conveyor.cli import main

    _profile(forward=1e-3).save(tmp_path / "p.json")
    argv = [
        "simulate",
        "--profile",
        str(tmp_path / "p.json"),
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "3",
        "--balance",
        "1",
        "3",
        "--png",
        str(tmp_path / "p.png"),
        "--save-timeline",
        str(tmp_path / "t.json"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted:" in out and "rank 1: peak activations" in out
    assert (tmp_path / "p.png").stat().st_size > 0
    assert Timeline.load(tmp_path / "t.json").source == "simulated"
    with pytest.raises(SystemExit):
        main([*argv[:9], "--balance", "1", "1", "2"])
    assert "--balance has 3 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv[:12], "--batch-size", "2"])
    assert "--batch-size 2 cannot be split into --microbatches 3" in capsys.readouterr().err


def test_a_stage_holds_the_batch_of_the_model_inputs_it_takes_only() -> None:
    units = (
        Unit("text", "text", (-1,), 0, 0),
        Unit("image", "image", (-2,), 0, 0),
        Unit("head", "head", (0, 1), 0, 0),
    )
    stats = tuple(UnitStats(1, 2, 1, 1, 0, 8, (False,) * len(u.inputs), False, 8) for u in units)
    profile = Profile("towers", units, {2: stats}, {2: (0.0, 0.0)}, 10 + 1000, (10, 1000))
    graph, stage_units = layout(profile, [[0], [1, 2]])
    cost = ProfileCost(profile, graph, stage_units, 2, 4)
    assert (cost.resident_bytes(0), cost.resident_bytes(1)) == (10 * 8, 1000 * 8)
