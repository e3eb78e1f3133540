"""Calibration (conveyor.planner.calibrate): the runtime's overheads and the link, measured on
two gloo ranks, and a profile fitted to a measured step."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_profile import _model, _workload

from conveyor.planner import (
    Link,
    Overheads,
    ProfileCost,
    fit,
    layout,
    measure_between_work,
    measure_link,
    measure_overheads,
    predict,
    profile_model,
    split_units,
)
from conveyor.planner.calibrate import busy_warning
from conveyor.schedule import build_program
from conveyor.trace import Event, Timeline
from dist import run_ranks


def _overheads_worker(rank: int, world_size: int, out: str) -> None:
    overheads = measure_overheads(steps=6)
    link = measure_link(sizes=(1 << 10, 1 << 18), repeats=3)
    between = [
        measure_between_work(kind, sizes=(1 << 10, 1 << 18), work_s=1e-4, repeats=3)
        for kind in ("exchange", "all_reduce")
    ]
    if rank == 0:
        Path(out).write_text(repr((overheads, link, between)))


@pytest.mark.dist
def test_runtime_overheads_and_link_are_measured_on_two_ranks(tmp_path: Path) -> None:
    out = tmp_path / "measured.txt"
    run_ranks(_overheads_worker, tmp_path, timeout_s=120, out=str(out))
    overheads, link, between = eval(out.read_text(), {"Overheads": Overheads, "Link": Link})
    assert overheads.forward > 0 and overheads.backward >= 0 and overheads.send > 0
    assert overheads.recv > 0 and overheads.wait >= 0
    assert link.latency > 0 and link.bandwidth > 0
    assert link.transfer(1 << 20) > link.transfer(1 << 10)
    for measured in between:  # messages after work: exchanges and all-reduces
        assert measured.latency > 0 and measured.bandwidth > 0


def test_overheads_need_two_ranks() -> None:
    with pytest.raises(RuntimeError, match="exactly two ranks"):
        measure_overheads()


def test_fit_scales_the_profile_to_a_measured_step() -> None:
    profile = profile_model(_workload(_model()), [2], min_time_s=0.0, min_repeats=1)
    profile.overheads = Overheads(forward=1e-4, backward=1e-4, send=1e-5, recv=1e-5)
    graph, units = layout(profile, split_units(profile.num_units, [2, 3]))
    program = build_program("1f1b", graph, 4)
    predicted = predict(program, graph, ProfileCost(profile, graph, units, 2, 4)).timeline
    slower = {"forward": 1.5, "backward": 2.0}  # what the "machine" did to the units' work
    own = 1e-4  # the runtime's per-action overhead, measured apart: not scaled
    compute = Timeline(
        2,
        [
            Event(e.rank, e.action, e.start, e.start + own + (e.duration - own) * slower[e.kind])
            if e.kind in slower
            else e
            for e in predicted.events
        ],
    )
    measured = compute
    for _ in range(3):  # calls take 0.1 ms more, plus 2 ms per unit of their peer's busy share
        busy = [measured.busy_time(r) / measured.step_time for r in range(2)]
        measured = Timeline(
            2,
            [
                e
                if e.kind not in ("send", "recv")
                else Event(e.rank, e.action, e.start, e.end + 1e-4 + 2e-3 * busy[1 - e.rank])
                for e in compute.events
            ],
        )
    fitted = fit(profile, measured, predicted)
    again = predict(program, graph, ProfileCost(fitted, graph, units, 2, 4)).timeline
    for kind, factor in slower.items():
        want = sum(own + (e.duration - own) * factor for e in predicted.events if e.kind == kind)
        assert sum(e.duration for e in again.events if e.kind == kind) == pytest.approx(want)
    assert fitted.overheads.busy_call == pytest.approx(2e-3, rel=0.3)
    assert fitted.overheads.send - profile.overheads.send == pytest.approx(1e-4, abs=1e-4)
    assert fitted.calibration[2][1] == pytest.approx(profile.calibration[2][1] * 2.0)
    with pytest.raises(ValueError, match="share no kind of action"):
        fit(profile, Timeline(2), predicted)


def test_measuring_on_a_busy_machine_is_told() -> None:
    """Other processes slow every measured cost: the planner says so (its own 2 ranks make a
    load of about 2)."""
    assert busy_warning(2.3, 2) is None and busy_warning(9.0, 32) is None
    warning = busy_warning(5.0, 2)
    assert warning is not None and "load average 5.0 on 2 cores" in warning
    assert "measure again on an idle machine" in warning
