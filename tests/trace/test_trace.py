"""Timelines: summary arithmetic, the recorder, run files, Chrome trace and PNG renderers, and
(on two gloo ranks) recorded runs of every schedule against their Programs."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor import Pipeline
from conveyor.graph import place
from conveyor.schedule import SCHEDULES, spec_of
from conveyor.trace import (
    Event,
    Recorder,
    Timeline,
    chrome_trace,
    load_run,
    render_grid,
    trace_file_name,
    write_chrome,
    write_png,
)
from dist import run_ranks


def _two_ranks() -> Timeline:
    # rank 0: F, send, waits 2.0 for a gradient sent at 2.5 (0.5 of it is transfer), B
    # rank 1: waits 1.5 for an activation sent at 1.0, F, B, sends the gradient
    return Timeline(
        2,
        [
            Event(0, "0F0", 0.0, 1.0, memory=100),
            Event(0, "0SF0>1", 1.0, 1.1, bytes=64),
            Event(0, "wait 0RB0<1", 1.1, 3.0, bytes=64),
            Event(0, "0B0", 3.0, 5.0),
            Event(1, "wait 1RF0<0", 0.0, 1.5),
            Event(1, "1F0", 1.5, 2.5, memory=50),
            Event(1, "1B0", 2.5, 2.5),
            Event(1, "1SB0>0", 2.5, 2.6, bytes=64),
        ],
        meta={"schedule": "gpipe", "microbatches": 1},
    )


def test_summary_splits_each_rank_into_busy_comm_wait_and_bubble() -> None:
    timeline = _two_ranks()
    rank0, rank1 = timeline.summary()
    assert timeline.step_time == 5.0
    assert rank0.busy == pytest.approx(3.0 / 5)
    assert rank0.comm_wait == pytest.approx((0.1 + (3.0 - 2.5)) / 5)  # the send, then transfer
    assert rank0.bubble == pytest.approx(1 - 3.0 / 5 - 0.6 / 5)
    assert rank1.busy == pytest.approx(1.0 / 5)
    assert rank1.comm_wait == pytest.approx((0.5 + 0.1) / 5)  # from the send at 1.0, and its own
    assert (rank0.peak_memory, rank1.peak_memory) == (100, 50)
    assert timeline.bubble_fraction == pytest.approx(1 - 4.0 / 10)
    text = timeline.summary_text()
    assert "schedule=gpipe" in text and "step 5000.00 ms" in text
    assert "idle 60.0% (bubble + comm wait)" in text
    assert text.splitlines()[2].split()[:4] == ["0", "60.0%", "28.0%", "12.0%"]


def test_events_know_their_kind_stage_and_microbatch() -> None:
    kinds = {
        a: Event(0, a, 0, 1).kind
        for a in (
            "1F2",
            "1B2",
            "1I2",
            "1W2",
            "0SF3>1",
            "1RB0<2",
            "wait 1RF0<0",
            "wait sends",
            "recompute 1F2",
        )
    }
    assert kinds == {
        "1F2": "forward",
        "1B2": "backward",
        "1I2": "backward_input",
        "1W2": "backward_weight",
        "0SF3>1": "send",
        "1RB0<2": "recv",
        "wait 1RF0<0": "wait",
        "wait sends": "wait",
        "recompute 1F2": "recompute",
    }
    assert (Event(0, "3I12", 0, 1).stage, Event(0, "3I12", 0, 1).microbatch) == (3, 12)
    assert Event(0, "wait 1RF0<0", 0, 1).waited_for == "1RF0<0"
    assert Event(0, "wait sends", 0, 1).waited_for is None


def test_timeline_files_round_trip(tmp_path: Path) -> None:
    timeline = _two_ranks()
    timeline.save(tmp_path / "t.json")
    assert Timeline.load(tmp_path / "t.json") == timeline


def test_recorder_moves_compute_past_its_waits_and_gives_bytes_to_their_action() -> None:
    recorder = Recorder(rank=1, keep=2)
    for step in range(3):
        recorder.begin_step(step)
        recorder.sent(40)
        recorder.add("1SF0>2", 10.0, 10.5)
        recorder.wait("1RB0<2", 10.5, 12.0, bytes=8)
        recorder.add("1B0", 10.5, 13.0, memory=7)
        recorder.end_step()
    assert [index for index, _ in recorder.steps] == [1, 2]  # keeps the last two
    send, wait, backward = recorder.steps[-1][1]
    assert (send.bytes, wait.action, wait.bytes) == (40, "wait 1RB0<2", 8)
    assert (backward.start, backward.end, backward.memory) == (12.0, 13.0, 7)
    part = recorder.timeline(num_ranks=3)
    assert part.num_ranks == 3 and part.events[0].start == pytest.approx(
        10.0 + recorder.clock_offset
    )
    with pytest.raises(RuntimeError, match="no step recorded"):
        Recorder(0).timeline(1)


def test_recorder_finds_a_step_by_its_index_or_back_from_the_last() -> None:
    recorder = Recorder(rank=0, keep=2)
    for step in range(3):
        recorder.begin_step(step)
        recorder.add("0F0", float(step), step + 0.5)
        recorder.end_step()
    offset = recorder.clock_offset
    assert recorder.timeline(1, step=1).events[0].start == pytest.approx(1.0 + offset)
    assert recorder.timeline(1, step=-2).events[0].start == pytest.approx(1.0 + offset)
    assert recorder.timeline(1).events[0].start == pytest.approx(2.0 + offset)
    for missing in (0, 3, -3):
        with pytest.raises(ValueError, match=f"step {missing} is not kept; .* steps 1 to 2"):
            recorder.timeline(1, step=missing)


def _write_run(
    directory: Path, ranks: dict[int, dict[int, list[list[object]]]], num_ranks: int = 2
) -> None:
    for rank, steps in ranks.items():
        lines = [
            json.dumps(
                {
                    "rank": rank,
                    "host": "h",
                    "clock_offset": 0.0,
                    "meta": {"ranks": num_ranks, "schedule": "1f1b"},
                }
            )
        ]
        lines += [json.dumps({"step": s, "events": e}) for s, e in steps.items()]
        (directory / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")


def test_replicas_enter_a_step_each_at_its_own_pace(tmp_path: Path) -> None:
    """Replica 1 starts 5 s after replica 0: nothing of replica 0 is clipped by it."""
    for replica, start in ((0, 100.0), (1, 105.0)):
        for rank in (0, 1):
            head = {"rank": rank, "replica": replica, "meta": {"ranks": 2, "replicas": 2}}
            event = [f"{rank}F0", start, start + rank + 1.0, 0, 0]
            step = {"step": 0, "events": [event]}
            path = tmp_path / trace_file_name(rank, replica)
            path.write_text(json.dumps(head) + "\n" + json.dumps(step) + "\n")
    timeline = load_run(tmp_path)
    assert sorted((e.rank, e.start, e.end) for e in timeline.events) == [
        (0, 0.0, 1.0),  # replica 0 from its own start, not clipped by replica 1's
        (1, 0.0, 2.0),
        (2, 5.0, 6.0),
        (3, 5.0, 7.0),
    ]


def test_load_run_merges_one_step_from_when_every_rank_has_entered_it(tmp_path: Path) -> None:
    _write_run(
        tmp_path,
        {
            0: {0: [["0F0", 100.0, 101.0, 0, 5]], 1: [["0F0", 200.0, 201.0, 0, 5]]},
            1: {0: [["1F0", 100.5, 102.0, 0, 3]], 1: [["1F0", 199.5, 202.0, 0, 3]]},
        },
    )
    last = load_run(tmp_path)
    assert last.meta["step"] == 1 and last.meta["schedule"] == "1f1b"
    # rank 1 entered step 1 at 199.5, rank 0 at 200.0: the step starts at 200.0
    assert [(e.rank, e.action, e.start, e.end) for e in last.events] == [
        (0, "0F0", 0.0, 1.0),
        (1, "1F0", 0.0, 2.0),
    ]
    first = load_run(tmp_path, step=0)  # rank 0 at 100.0, rank 1 at 100.5
    assert [(e.start, e.end) for e in first.events] == [(0.0, 0.5), (0.0, 1.5)]
    with pytest.raises(ValueError, match=r"recorded steps: 0\.\.1"):
        load_run(tmp_path, step=5)


def test_load_run_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="conveyor run --trace DIR"):
        load_run(tmp_path)
    _write_run(tmp_path, {0: {0: [["0F0", 0.0, 1.0, 0, 0]]}})
    with pytest.raises(ValueError, match="the run had 2 ranks"):
        load_run(tmp_path)


def test_chrome_trace_has_one_track_per_rank_and_timeline(tmp_path: Path) -> None:
    measured = _two_ranks()
    predicted = Timeline(2, [Event(0, "0F0", 0.0, 2.0), Event(1, "1F0", 2.0, 3.0)], "simulated")
    trace = chrome_trace(measured)
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(measured.events)
    backward = next(e for e in spans if e["name"] == "0B0")
    assert (backward["ts"], backward["dur"], backward["pid"], backward["cat"]) == (
        3e6,
        2e6,
        0,
        "backward",
    )
    both = json.loads(write_chrome(tmp_path / "both.json", measured, predicted).read_text())
    names = {
        e["pid"]: e["args"]["name"] for e in both["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {
        0: "measured rank 0",
        1: "measured rank 1",
        2: "simulated rank 0",
        3: "simulated rank 1",
    }


def test_png_gantt_chart_is_written(tmp_path: Path) -> None:
    recomputed = _two_ranks()
    recomputed.events.append(Event(0, "recompute 0F0", 3.0, 4.0))  # inside 0B0
    path = write_png(tmp_path / "t.png", recomputed, _two_ranks().shifted(-1.0), title="two")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    with pytest.raises(ValueError, match="at least one timeline"):
        write_png(tmp_path / "none.png")
    with pytest.raises(ValueError, match="timeline 0 has no events to draw"):
        write_png(tmp_path / "empty.png", Timeline(2, []))


def test_render_grid_draws_whole_units() -> None:
    timeline = Timeline(
        2,
        [
            Event(0, "0F0", 0, 1),
            Event(0, "0B0", 2, 4),
            Event(1, "1F0", 1, 2),
            Event(1, "wait 1RB0<1", 0, 1),
        ],
    )
    assert render_grid(timeline).splitlines() == [
        "rank 0 | 0F0  .  0B0 0B0",
        "rank 1 |  .  1F0  .   . ",
    ]
    for start in (1.7e9, 0.0):  # Recorder.timeline's times, or a loaded run's
        measured = Timeline(1, [Event(0, "0F0", start, start + 0.006)])
        with pytest.raises(ValueError, match="draw a measured or profiled timeline"):
            render_grid(measured)


# -- recorded runs on two ranks ----------------------------------------------------------------


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)), nn.Linear(8, 4)
    ).double()


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _recorded_worker(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(1)
    inputs = torch.randn(8, 8, dtype=torch.float64)
    targets = torch.randn(8, 4, dtype=torch.float64)
    for name in sorted(SCHEDULES):
        wanted = spec_of(name)
        num_stages = wanted.virtual_stages * world_size
        placement = tuple(place(num_stages, world_size, wanted.placement))
        balance = (5,) if num_stages == 1 else {2: (3, 2), 4: (2, 1, 1, 1)}[num_stages]
        common = {
            "loss_fn": _loss,
            "schedule": name,
            "placement": placement,
            "balance": balance,
            "num_microbatches": 4,
        }
        plain = Pipeline(_model(), **common)
        traced = Pipeline(_model(), trace_dir=str(Path(root, name)), measure_memory=True, **common)
        with pytest.raises(RuntimeError, match="trace=True"):
            plain.timeline()
        for _ in range(2):
            loss, traced_loss = plain.step(inputs, targets), traced.step(inputs, targets)
            if loss is not None:
                assert traced_loss is not None
                torch.testing.assert_close(traced_loss, loss, rtol=0, atol=0)
        timeline = traced.timeline()
        for r in range(world_size):
            events = timeline.on(r)
            recorded = [e.action for e in events if not e.action.startswith("wait")]
            assert recorded == [str(a) for a in traced.program[r]], (name, r)
            assert all(e.end >= e.start for e in events)
            for e in events:
                if e.kind == "send" and "SF" in e.action:  # activations and the RNG state
                    assert e.bytes == 2 * 8 * 8 + torch.get_rng_state().numel(), e
                elif e.kind == "send":  # 2 samples x 8 float64 gradients
                    assert e.bytes == 2 * 8 * 8, e
        assert timeline.peak_memory(rank) == traced.memory().peak_bytes
        if rank == 0:
            Path(root, f"{name}.json").write_text(json.dumps(timeline.to_dict()))
    recomputing = Pipeline(
        _model(), trace=True, recompute="always", loss_fn=_loss, balance=(3, 2), num_microbatches=4
    )
    recomputing.step(inputs, targets)
    timeline = recomputing.timeline()
    for r in range(world_size):  # its own kind, inside the backward it belongs to
        events = timeline.on(r)
        redone = [e for e in events if e.kind == "recompute"]
        assert [e.action for e in redone] == [f"recompute {r}F{k}" for k in range(4)], r
        for e in redone:
            backward = next(b for b in events if b.action == f"{r}B{e.microbatch}")
            assert backward.start <= e.start <= e.end <= backward.end, (e, backward)


@pytest.mark.dist
def test_recorded_runs_match_their_programs_and_their_files(tmp_path: Path) -> None:
    run_ranks(_recorded_worker, tmp_path, timeout_s=240, root=str(tmp_path))
    for name in sorted(SCHEDULES):
        gathered = Timeline.from_dict(json.loads((tmp_path / f"{name}.json").read_text()))
        from_files = load_run(tmp_path / name)
        assert from_files.meta["step"] == 1 and from_files.meta["schedule"] == name
        assert [(e.rank, e.action) for e in from_files.events] == [
            (e.rank, e.action) for e in gathered.events
        ]
        for a, b in zip(from_files.events, gathered.events, strict=True):
            assert a.duration == pytest.approx(b.duration, abs=1e-9)
            assert a.start == pytest.approx(b.start, abs=1e-9)


# -- the command line --------------------------------------------------------------------------


def test_trace_command_prints_the_summary_and_writes_the_pictures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conveyor.cli import main

    _write_run(
        tmp_path,
        {
            0: {3: [["0F0", 10.0, 11.0, 0, 5], ["0B0", 12.0, 14.0, 0, 0]]},
            1: {3: [["wait 1RF0<0", 10.0, 11.0, 0, 0], ["1F0", 11.0, 12.0, 0, 3]]},
        },
    )
    predicted = Timeline(2, [Event(0, "0F0", 0.0, 1.0), Event(1, "1F0", 1.0, 2.0)], "simulated")
    predicted.save(tmp_path / "predicted.json")
    assert main(["trace", str(tmp_path), "--compare", str(tmp_path / "predicted.json")]) == 0
    out = capsys.readouterr().out
    assert "measured schedule=1f1b: step 4000.00 ms, idle 50.0% (bubble + comm wait)" in out
    assert "simulated: step 2000.00 ms" in out
    assert (tmp_path / "timeline.png").stat().st_size > 0
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        "measured rank 0",
        "measured rank 1",
        "simulated rank 0",
        "simulated rank 1",
    }
    with pytest.raises(SystemExit):  # the Chrome trace it wrote is no Timeline to compare
        main(["trace", str(tmp_path), "--compare", str(tmp_path / "trace.json")])
    assert "trace.json' is not a saved conveyor Timeline" in capsys.readouterr().err


def test_files_of_an_older_run_and_a_line_cut_short_are_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 3-rank run, then a 2-rank run into the same directory: rank2.jsonl is the older
    run's, and must not become a row of the newer one."""
    _write_run(tmp_path, {r: {0: [[f"{r}F0", 0.0, 1.0, 0, 0]]} for r in range(3)}, num_ranks=3)
    os.utime(tmp_path / "rank2.jsonl", (1e9, 1e9))
    _write_run(tmp_path, {r: {0: [[f"{r}F0", 0.0, 1.0, 0, 0]]} for r in range(2)})
    with (tmp_path / "rank1.jsonl").open("a") as file:
        file.write('{"step": 1, "eve')  # killed in the middle of a step's line
    with caplog.at_level(logging.WARNING, logger="conveyor.trace"):
        timeline = load_run(tmp_path)
    assert timeline.num_ranks == 2 and timeline.meta["step"] == 0
    assert "leaving out ['rank2.jsonl']" in caplog.text and "line 3, cut short" in caplog.text


def test_a_file_that_is_no_trace_is_named_with_its_line(tmp_path: Path) -> None:
    _write_run(tmp_path, {0: {0: [["0F0", 0.0, 1.0, 0, 0]]}, 1: {0: [["1F0", 0.0, 1.0, 0, 0]]}})
    path = tmp_path / "rank1.jsonl"
    for text, line, why in [
        ('{"meta": {}}\n', 1, "KeyError: 'rank'"),
        ("not json\n", 1, "JSONDecodeError"),
        (path.read_text() + '{"step": 1}\n', 3, "KeyError: 'events'"),
    ]:
        path.write_text(text)
        with pytest.raises(
            ValueError, match=f"rank1.jsonl' line {line} is not a conveyor trace \\({why}"
        ):
            load_run(tmp_path)


def test_trace_command_writes_only_what_is_asked_for_and_a_range_of_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conveyor.cli import main

    steps = {s: [["0F0", 10.0 * s, 10.0 * s + 1, 0, 0]] for s in (3, 4)}
    later = {s: [["1F0", 10.0 * s + 0.5, 10.0 * s + 2, 0, 0]] for s in steps}
    _write_run(tmp_path, {0: steps, 1: later})
    png = tmp_path / "out" / "steps.png"
    png.parent.mkdir()
    assert main(["trace", str(tmp_path), "--step", "3-4", "--png", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "trace.json").exists() and not (tmp_path / "timeline.png").exists()
    assert "measured schedule=1f1b: steps 3-4 11500.00 ms" in capsys.readouterr().out
    both = load_run(tmp_path, 3, 4)  # each step from when the last rank entered it (at x.5)
    assert [(e.rank, e.action, e.start, e.end) for e in both.events] == [
        (0, "0F0", 0.0, 0.5),
        (0, "0F0", 10.0, 10.5),  # on one axis from step 3's start: the gap is kept
        (1, "1F0", 0.0, 1.5),
        (1, "1F0", 10.0, 11.5),
    ]
    assert both.meta["steps"] == [3, 4] and "step" not in both.meta
    chrome = tmp_path / "out" / "one.json"
    assert main(["trace", str(tmp_path), "--step", "4", "--chrome", str(chrome)]) == 0
    assert json.loads(chrome.read_text())["traceEvents"]
    assert not (tmp_path / "timeline.png").exists()
    with pytest.raises(ValueError, match="step 5 was not recorded by every rank"):
        load_run(tmp_path, 3, 5)


def test_run_options_are_taken_before_the_script_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from conveyor.cli.launch import take_run_options

    monkeypatch.delenv("CONVEYOR_TRACE_DIR", raising=False)
    rest = take_run_options(["-n", "2", f"--trace={tmp_path}", "train.py", "--trace", "x"])
    assert rest == ["-n", "2", "train.py", "--trace", "x"]
    assert Path(str(__import__("os").environ["CONVEYOR_TRACE_DIR"])) == tmp_path.resolve()
    with pytest.raises(ValueError, match="--trace needs a value"):
        take_run_options(["--trace"])
    with pytest.raises(ValueError, match="no 'pipeline' section"):
        (tmp_path / "p.json").write_text("{}")
        take_run_options(["--plan", str(tmp_path / "p.json"), "train.py"])
    monkeypatch.setenv("CONVEYOR_DP", "")  # restored (unset) after the test
    assert take_run_options(["-n", "4", "--dp", "2", "train.py"]) == ["-n", "4", "train.py"]
    assert __import__("os").environ["CONVEYOR_DP"] == "2"
    with pytest.raises(ValueError, match="positive number of ranks, got 'two'"):
        take_run_options(["--dp", "two", "train.py"])


_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
import conveyor
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
pipe = conveyor.Pipeline(model, loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                         num_microbatches=2)
for _ in range(3):
    pipe.step(torch.randn(4, 4), torch.randn(4, 2))
dist.destroy_process_group()
"""


@pytest.mark.dist
def test_conveyor_run_trace_records_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conveyor.cli import main

    monkeypatch.delenv("CONVEYOR_TRACE_DIR", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    assert main(["run", "--trace", str(tmp_path / "run"), "-n", "2", str(script)]) == 0
    timeline = load_run(tmp_path / "run")
    assert timeline.meta["step"] == 2 and timeline.num_ranks == 2
    assert [e.action for e in timeline.on(0) if e.is_compute] == ["0F0", "0F1", "0B0", "0B1"]


def test_trace_files_of_replicas_merge_into_one_timeline(tmp_path: Path) -> None:
    from conveyor.trace import load_run, trace_file_name

    meta = {"ranks": 2, "replicas": 2, "tp": 1, "schedule": "1f1b"}
    for replica in (0, 1):
        for rank in (0, 1):
            head = {"rank": rank, "replica": replica, "tp": 0, "meta": meta}
            events = [
                [f"{rank}F0", 10.0 + replica, 11.0 + replica, 0, 0],
                [f"reduce {rank}", 12.0, 12.5, 0, 0],
            ]
            step = {"step": 3, "events": events}
            path = tmp_path / trace_file_name(rank, replica)
            path.write_text(json.dumps(head) + "\n" + json.dumps(step) + "\n")
    timeline = load_run(tmp_path)
    assert timeline.num_ranks == 4
    assert [timeline.label(r) for r in range(4)] == [
        "replica 0 rank 0", "replica 0 rank 1", "replica 1 rank 0", "replica 1 rank 1",
    ]  # fmt: skip
    assert [e.kind for e in timeline.on(3)] == ["forward", "reduce"]
    assert "replica 1 rank 1" in timeline.summary_text()
    (tmp_path / "replica1-rank1.jsonl").unlink()
    with pytest.raises(ValueError, match=r"lacks the trace files \['replica1-rank1.jsonl'\]"):
        load_run(tmp_path)
