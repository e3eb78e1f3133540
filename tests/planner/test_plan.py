"""The planner: optimal splits, budgets, plan files, and (on two gloo ranks) a planned Pipeline
that trains like the plain model."""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from conveyor import Pipeline
from conveyor.config import read_plan
from conveyor.planner import (
    PlanReport,
    Profile,
    Unit,
    UnitStats,
    Workload,
    load_workload,
    plan,
    profile_model,
)
from conveyor.schedule import SCHEDULES
from dist import run_ranks


def _profile(forward: list[float], saved: int = 1000, params: int = 100) -> Profile:
    n = len(forward)
    units = tuple(Unit(f"u{i}", str(i), (i - 1,), params, params) for i in range(n))
    stats = {
        size: tuple(
            UnitStats(
                f * size,
                2 * f * size,
                f * size,
                f * size,
                saved * size,
                10 * size,
                (True,),
                False,
                10 * size,
                10,
            )
            for f in forward
        )
        for size in (1, 2, 4, 8)
    }
    return Profile("synthetic", units, stats, {s: (0.0, 0.0) for s in stats}, 8)


def test_an_unbalanced_model_gets_an_uneven_split_that_beats_the_even_one() -> None:
    profile = _profile([8.0, 1, 1, 1, 1, 1, 1, 1, 1])
    report = plan(None, 2, 1 << 40, 8, profile=profile, schedules=["1f1b"])
    best = report.best
    assert best.balance == (1, 8) and best.fits
    even = [
        p
        for p in report.plans
        if p.balanced_by == "even" and p.num_microbatches == best.num_microbatches
    ]
    assert even and min(p.step_time for p in even) > 1.2 * best.step_time


def test_every_schedule_is_planned_or_said_why_not() -> None:
    report = plan(None, 2, 1 << 40, 8, profile=_profile([1.0] * 6))
    planned = {p.schedule for p in report.plans}
    skipped = {note.split(" with ")[0] for note in report.notes}
    assert planned | skipped == set(SCHEDULES)
    assert report.plans == sorted(
        report.plans, key=lambda p: (not p.fits, p.step_time, max(p.total_memory))
    )


def test_plans_over_the_budget_are_never_recommended() -> None:
    profile = _profile([1.0] * 6)
    unlimited = plan(None, 2, 1 << 40, 8, profile=profile, schedules=["gpipe", "1f1b"])
    budget = max(unlimited.best.total_memory) - 1  # the fastest plan no longer fits
    report = plan(None, 2, budget, 8, profile=profile, schedules=["gpipe", "1f1b"])
    assert any(max(p.total_memory) > budget for p in unlimited.plans)
    for p in report.plans:
        assert p.fits == (max(p.total_memory) <= budget)
    assert report.best.fits and max(report.best.total_memory) <= budget
    assert report.best.step_time >= unlimited.best.step_time
    assert (
        report.best.schedule,
        report.best.num_microbatches,
        report.best.stage_units,
        report.best.recompute,
    ) != (
        unlimited.best.schedule,
        unlimited.best.num_microbatches,
        unlimited.best.stage_units,
        unlimited.best.recompute,
    )


def test_a_tight_budget_turns_on_recomputation_and_too_tight_a_budget_says_what_is_needed() -> None:
    profile = _profile([1.0] * 6, saved=100_000)
    free = plan(None, 2, 1 << 40, 8, profile=profile, schedules=["gpipe"], microbatches=[8])
    assert set(free.best.recompute) == {"never"}
    smallest = min(max(p.total_memory) for p in free.plans)
    tight = plan(None, 2, smallest, 8, profile=profile, schedules=["gpipe"], microbatches=[8])
    assert tight.best.fits and "never" not in set(tight.best.recompute)
    hopeless = plan(
        None, 2, smallest - 1, 8, profile=profile, schedules=["gpipe"], microbatches=[8]
    )
    assert smallest < 2**20  # a tiny model: the message says KiB, not "0.0 MiB"
    with pytest.raises(
        ValueError, match=f"smallest memory any plan needs is {smallest / 2**10:.1f} KiB"
    ):
        _ = hopeless.best


def test_impossible_requests_are_explained() -> None:
    profile = _profile([1.0] * 3)
    with pytest.raises(ValueError, match=r"too few for 4 ranks.*at most 3 ranks"):
        plan(None, 4, 1 << 40, 8, profile=profile)
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        plan(None, 0, 1 << 40, 8, profile=profile)
    with pytest.raises(ValueError, match="unknown schedules"):
        plan(None, 2, 1 << 40, 8, profile=profile, schedules=["nope"])
    with pytest.raises(ValueError, match=r"must lie in 1\.\.8"):
        plan(None, 2, 1 << 40, 8, profile=profile, microbatches=[16])


def test_workloads_load_by_example_name_or_import_path() -> None:
    assert load_workload("unbalanced").name == "unbalanced"
    made = load_workload("test_plan:_factory")
    assert isinstance(made.model, nn.Sequential) and made.name == "test_plan:_factory"
    with pytest.raises(ValueError, match="unknown example 'nope'"):
        load_workload("nope")
    with pytest.raises(ValueError, match="cannot import"):
        load_workload("no.such.module:f")


def test_a_plan_of_an_sequentials_own_layers_is_a_balance() -> None:
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(5))).double()
    report = plan(
        Workload("linear", model, _batch, _loss),
        2,
        1 << 30,
        4,
        microbatches=[2],
        schedules=["1f1b"],
    )
    fields = report.pipeline_config()
    assert fields["balance"] == list(report.best.balance) and "split_points" not in fields
    assert (fields["schedule"], fields["num_microbatches"]) == ("1f1b", 2)
    # what the prediction assumed, "never" included, so it overrides a script's recompute
    assert fields["stage_recompute"] == list(report.best.recompute)


def _factory() -> tuple[nn.Module, object, object]:
    return _model(), _batch, _loss


# -- a planned Pipeline on two ranks --------------------------------------------------------


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    widths = [8, 64, 64, 8, 8, 8, 8]
    layers = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(widths)]
    return nn.Sequential(*layers).double()


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    return (
        torch.randn(size, 8, generator=generator, dtype=torch.float64),
        torch.randn(size, 8, generator=generator, dtype=torch.float64),
    )


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _planned_worker(rank: int, world_size: int, plan_file: str) -> None:
    fields = read_plan(plan_file)
    inputs, targets = _batch(8)
    pipe = Pipeline(_model(), loss_fn=_loss, plan=plan_file)
    assert pipe.config.schedule == fields["schedule"]
    assert pipe.config.num_microbatches == fields["num_microbatches"]
    reference = _model()
    expected = _loss(reference(inputs), targets)
    expected.backward()
    loss = pipe.step(inputs, targets)
    if loss is not None:
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-10)
    grads = dict(reference.named_parameters())
    for name, parameter in pipe.named_parameters():
        assert parameter.grad is not None
        torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def measured() -> PlanReport:
    """The small model planned on a profile measured here, once for the module and briefly
    (its units take microseconds: the default minimum times would take seconds)."""
    workload = Workload("planned", _model(), _batch, _loss)
    profile = profile_model(workload, [4, 2], min_time_s=0.003, passes=1)
    return plan(workload, 2, 1 << 30, 8, microbatches=[2, 4], profile=profile)


@pytest.mark.dist
def test_a_plan_file_runs_as_planned_and_trains_like_the_plain_model(
    tmp_path: Path, measured: PlanReport
) -> None:
    report = measured
    path = report.write(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    # the layers are nn.Sequential(Linear, Tanh) pairs, opened up: the plan names split points
    starts = [report.profile.units[units[0]].target for units in report.best.stage_units[1:]]
    assert data["pipeline"]["split_points"] == starts and "balance" not in data["pipeline"]
    assert data["prediction"]["step_time_s"] == report.best.step_time
    assert read_plan(path)["schedule"] == report.best.schedule
    run_ranks(_planned_worker, tmp_path, timeout_s=120, plan_file=str(path))
    checkpointed = report.pipeline_config(
        next((p for p in report.plans if "always" in p.recompute), report.best)
    )
    path.write_text(json.dumps({"pipeline": checkpointed}))
    run_ranks(_planned_worker, tmp_path, timeout_s=120, plan_file=str(path))


# -- the command line --------------------------------------------------------------------------


@pytest.mark.dist  # a process of its own, or seconds of measuring
def test_plan_command_prints_plans_and_writes_the_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], measured: PlanReport
) -> None:
    from conveyor.cli import main

    saved = tmp_path / "profile.json"
    measured.profile.save(saved)
    out_file = tmp_path / "plan.json"
    argv = [
        "plan",
        "--model",
        "test_plan:_factory",
        "--ranks",
        "2",
        "--memory",
        "1GiB",
        "--batch-size",
        "8",
        "--microbatches",
        "2",
        "4",
        "--profile",
        str(saved),
        "--out",
        str(out_file),
        "--top",
        "3",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "plans simulated" in out and "best:" in out and len(out.splitlines()) >= 5
    assert read_plan(out_file)["num_microbatches"] in (2, 4)
    with pytest.raises(SystemExit) as exit_info:
        main([*argv[:6], "1KiB", *argv[7:]])
    assert exit_info.value.code == 2
    assert "smallest memory any plan needs" in capsys.readouterr().err
    # a mesh: 4 ranks as dp x pp (the saved profile has no link: reductions are free)
    mesh = [*argv[:3], "--world-size", "4", *argv[5:14], "--out", str(out_file)]
    assert main(mesh) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks, global batch 8" in out and "chosen dp=" in out
    chosen = re.search(r"chosen dp=(\d+) x pp=(\d+)", out)
    assert chosen is not None and int(chosen[1]) * int(chosen[2]) == 4
    assert read_plan(out_file).get("dp", 1) == int(chosen[1])


def test_memory_sizes_read_with_units() -> None:
    from conveyor.cli.tools import parse_bytes

    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="2GiB, 512MiB"):
        parse_bytes("lots")


def test_a_graph_model_gets_its_branches_on_separate_ranks() -> None:
    # forward runs a1, b1, a2, b2, head(a2, b2): two branches interleaved in forward order
    inputs = {"a1": (-1,), "b1": (-2,), "a2": (0,), "b2": (1,), "head": (2, 3)}
    units = tuple(Unit(name, name, ins, 100, 100) for name, ins in inputs.items())
    stats = {
        size: tuple(
            UnitStats(
                0.2 if u.name == "head" else 1.0 * size,
                2.0 * size,
                1.0,
                1.0,
                10,
                10,
                (True,) * len(u.inputs),
                False,
                10,
                10,
            )
            for u in units
        )
        for size in (1, 2, 4)
    }
    profile = Profile("towers", units, stats, {s: (0.0, 0.0) for s in stats}, 16, (8, 8))
    report = plan(
        None, 3, 1 << 40, 8, profile=profile, schedules=["1f1b", "gpipe"], microbatches=[4]
    )
    assert report.best.stage_units[0] == (0, 2)  # branch a whole on rank 0, b beside it
    modules = report.pipeline_config()["stage_modules"]
    assert modules[0] == "a1,a2" and "b1" in modules[1]
    in_forward_order = [
        p for p in report.plans if [u for units in p.stage_units for u in units] == list(range(5))
    ]
    assert in_forward_order
    assert min(p.step_time for p in in_forward_order) > report.best.step_time


@pytest.mark.dist
def test_the_cli_profile_is_made_on_two_local_ranks_and_fitted_to_a_traced_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from conveyor.planner import profile_local

    caplog.set_level(logging.INFO, logger="conveyor.planner.local")
    profile = profile_local(  # one size: each takes seconds (two sizes: test_profile.py)
        "test_plan:_factory", [4], depth=1, batch_size=8, microbatch_counts=[2], timeout_s=240
    )
    # a line per phase as the ranks end it, not one at the end of minutes of silence
    for phase in ("runtime overheads:", "link:", "all-reduce link:", "profiled on both", "fitted"):
        assert f"two local ranks: {phase}" in caplog.text
    assert profile.link is not None and profile.overheads.forward > 0
    assert profile.reduce_link is not None and not profile.budget_notes
    assert sorted(profile.stats) == [4] and profile.num_units == 12
    assert all(forward > 0 and backward > 0 for forward, backward in profile.calibration.values())
    plan(
        Workload("f", _model(), _batch, _loss), 2, 1 << 30, 8, profile=profile, microbatches=[2]
    )  # the fitted profile still matches its model


def test_a_mesh_plan_weighs_the_bubble_against_the_reduction_and_says_why() -> None:
    from conveyor.planner import Link, Replicas, plan_mesh

    assert Replicas(4, Link(1e-3, 1e6)).reduce_time(4000) == pytest.approx(2 * 3 * 2e-3)
    assert Replicas(4, Link(1e-3, 1e6), fsdp=True).reduce_time(4000) == pytest.approx(3 * 2e-3)
    profile = _profile([1.0] * 8, params=10**6)
    sizes = {"world_size": 4, "memory_budget": 1 << 40, "batch_size": 16}
    cheap = replace(profile, link=Link(1e-6, 1e12))  # reductions nearly free: no bubble wins
    report = plan_mesh(None, profile=cheap, schedules=["1f1b"], **sizes)
    assert (report.best.dp, report.best.pp) == (4, 1)
    assert report.why().startswith("chosen dp=4 x pp=1: 1f1b")
    assert "not dp=1 x pp=4" in report.why()
    dear = replace(profile, link=Link(1e-6, 1e4))  # reducing 8 MB takes longer than the bubble
    report = plan_mesh(None, profile=dear, schedules=["1f1b"], **sizes)
    assert (report.best.dp, report.best.pp) == (1, 4)
    assert report.best.reduction_s() == 0.0 < report.layouts[-1].reduction_s()
    assert report.best.report.pipeline_config().get("dp") is None
    two = next(m for m in report.layouts if m.dp == 2)
    assert two.report.pipeline_config(two.best)["dp"] == 2
    odd = plan_mesh(None, 4, 1 << 40, 6, profile=cheap, schedules=["1f1b"])
    assert odd.skipped == ["dp=4 x pp=1: the batch of 6 does not split over 4 replicas"]
    with pytest.raises(ValueError, match="no dp x pp layout of 4 ranks fits"):
        _ = plan_mesh(None, 4, 1, 16, profile=cheap, schedules=["1f1b"]).best


# -- the time budget ---------------------------------------------------------------------------


class _Slow(nn.Module):
    """A layer that takes at least 2 ms per forward: profiling a model of them takes seconds
    (about 6 s for 8 at 3 micro-batch sizes) however fast the machine."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return torch.tanh(self.linear(x))


def _slow() -> Workload:
    return Workload("slow", nn.Sequential(*(_Slow() for _ in range(8))).double(), _batch, _loss)


# A bound, not a benchmark: the planner stops between pieces of work it cannot interrupt
# (one layer's measurement: ~0.1 s here; one simulation of a 2-rank plan: milliseconds), so
# 10 s covers a loaded 2-core machine many times over.
_OVERRUN_S = 10.0


@pytest.mark.dist  # a process of its own, or seconds of measuring
def test_a_small_time_budget_bounds_the_whole_plan_and_says_what_it_left_out() -> None:
    began = time.monotonic()
    report = plan(_slow(), 2, 1 << 30, 8, time_budget_s=2.0)
    elapsed = time.monotonic() - began
    assert elapsed <= 2.0 + _OVERRUN_S
    assert report.elapsed_s <= elapsed and report.best.fits  # a valid plan, as ever
    coverage = report.coverage  # a loaded machine may not even finish one pass: default_only
    assert coverage is not None and not coverage.is_complete
    assert coverage.unprofiled and coverage.profile_notes  # profiling all of it takes ~6 s
    assert report.unexplored.startswith("cut short by the 2 s time budget")
    assert "or None to search everything" in report.unexplored
    assert coverage.tried and all(name in SCHEDULES for name, _ in coverage.tried)
    profiled = {round(8 / m) for m in {m for _, m in coverage.tried}}
    assert profiled <= set(report.profile.microbatch_sizes)  # counts searched were measured


def test_a_budget_below_one_profile_returns_the_default_plan_and_says_so() -> None:
    began = time.monotonic()
    report = plan(_slow(), 2, 1 << 30, 8, time_budget_s=0.01)
    assert time.monotonic() - began <= 0.01 + _OVERRUN_S
    best = report.best
    assert (best.schedule, best.balanced_by, best.balance) == ("1f1b", "even", (4, 4))
    assert report.coverage is not None and report.coverage.default_only
    assert "returned the default (1f1b, 4 micro-batches, an even split) unsearched" in (
        report.unexplored
    )
    assert "of 8 at micro-batch size 2 timed quickly (median of 3 runs)" in report.unexplored
    assert report.profile.unmeasured_sizes == (4, 1)


def test_the_search_keeps_its_budget_without_a_profile_to_make() -> None:
    profile = _profile([1.0] * 64)
    began = time.monotonic()
    report = plan(None, 32, 1 << 40, 64, profile=profile, time_budget_s=0.5)
    assert time.monotonic() - began <= 0.5 + _OVERRUN_S
    assert report.best.fits and report.coverage is not None
    assert report.coverage.untried or report.coverage.unsimulated
    unlimited = plan(None, 2, 1 << 40, 8, profile=_profile([1.0] * 6), time_budget_s=None)
    assert unlimited.coverage is not None and unlimited.coverage.is_complete
    assert unlimited.unexplored == ""
    with pytest.raises(ValueError, match="positive number of seconds or None"):
        plan(None, 2, 1 << 40, 8, profile=_profile([1.0] * 6), time_budget_s=0)


def test_a_profile_cut_by_its_deadline_keeps_its_first_size_and_says_what_it_lacks(
    tmp_path: Path,
) -> None:
    profile = profile_model(_slow(), [4, 2, 1], deadline=time.monotonic())
    assert profile.microbatch_sizes == [4] and profile.unmeasured_sizes == (2, 1)
    assert profile.budget_notes[0] == "micro-batch sizes [2, 1] not profiled"
    assert "1 of 3 passes at micro-batch size 4" in profile.budget_notes
    profile.save(tmp_path / "cut.json")
    assert Profile.load(tmp_path / "cut.json") == profile


@pytest.mark.dist  # a process of its own, or seconds of measuring
def test_too_small_a_budget_for_two_ranks_profiles_here_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from conveyor.planner import measured_profile

    caplog.set_level(logging.WARNING)
    profile = measured_profile(_slow(), 2, 8, spec="test_plan:_slow", time_budget_s=2.0)
    assert "not measuring on two local ranks" in caplog.text  # no ranks started
    assert profile.link is None and profile.reduce_link is None
    assert "runtime overheads, link, all-reduce link not measured" in profile.budget_notes


def test_a_loader_slower_than_the_step_is_reported_with_a_reuse_factor() -> None:
    from conveyor.planner import input_bound, loader_seconds

    def slow() -> Any:
        while True:
            time.sleep(0.02)
            yield torch.zeros(1)

    seconds = loader_seconds(slow(), count=3)
    assert 0.015 < seconds < 0.5
    warning = input_bound(seconds, step_s=seconds / 2.5)
    assert "input-bound" in warning and "Refurbish with reuse=3" in warning
    assert input_bound(seconds, step_s=seconds * 2) == "" and input_bound(None, 1.0) == ""
    with pytest.raises(ValueError, match="gave 2 batches, 4 are needed"):
        loader_seconds([1, 2], count=3)
