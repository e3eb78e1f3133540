"""The conveyor command: simulate without processes, demo and run under torchrun, bad input."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conveyor.cli import main
from conveyor.cli.launch import failure_summary
from conveyor.planner import Workload, profile_model
from conveyor.runtime.peers import Failure, read_failure
from conveyor.trace import load_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [[], ["run"], ["demo"], ["simulate"], ["plan"], ["trace"]])
def test_every_help_prints_every_option(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main([*command, "--help"])
    except SystemExit as exit_:  # argparse's own help exits
        code = exit_.code
    assert code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: conveyor")
    if command == ["demo"]:  # options made from PipelineConfig's fields and their docs
        assert "--measure-memory" in out and "1.4-6% of a step" in out


def test_simulate_prints_the_grid_and_the_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0 | 0F0 0F1 0F2 0F3")
    assert "bubble=27.3%" in out  # (p - 1) / (m + p - 1) = 3 / 11


def test_simulate_reads_a_schedule_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schedule = tmp_path / "mine.txt"
    schedule.write_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1\n")
    assert (
        main(
            [
                "simulate",
                "--schedule",
                str(schedule),
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--actions",
            ]
        )
        == 0
    )
    assert "rank 1: 1RF0<0 1RF1<0 1F0" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--schedule", "ifib"], "unknown schedule 'ifib'"),
        (["demo", "--checkpoint", "sometimes"], "invalid choice: 'sometimes'"),
        (["demo", "--num-microbatches", "0"], "num_microbatches must be >= 1"),
        (["run", "-n", "2", "missing.py"], "script 'missing.py' not found"),
        (["simulate", "--microbatches", "0"], "--microbatches: expected a whole number >= 1"),
        (["simulate", "--stages", "two"], "--stages: expected a whole number >= 1, got 'two'"),
        (["run", "--checkpoint-dir", "-n", "2", "x.py"], "--checkpoint-dir needs a value"),
        (
            ["run", "-n", "2", "--checkpoint-dir", "train.py"],
            "no script to run: --checkpoint-dir took 'train.py' as its DIR",
        ),
        (["run", "--checkpoint-dir", __file__], "no script to run: --checkpoint-dir took"),
        (["trace", "runs", "--step", "5-3"], "expected a step N or a range FIRST-LAST"),
        (["run", "-n", "2", "--dp", "3", "x.py"], "-n 2 ranks do not split into --dp 3 x --tp 1"),
        (["run", "-n4", "--dp", "3", "x.py"], "-n 4 ranks do not split into --dp 3"),
        (["run", "--dp", "3", "x.py"], "-n 2 ranks do not split"),  # the default: 2 ranks
        (["run", "--trace", __file__, "x.py"], "is a file, not a directory"),
        (["simulate", "--png", "x.png"], "--png only works with --profile; add it or drop"),
        (["simulate", "--balance", "1", "1", "--chrome", "x"], "--balance, --chrome only work"),
        (["simulate", "--groups", "3"], "--groups only works with --decode"),
        (["simulate", "--groups", "2"], "--groups only works with --decode"),  # its default
        (["simulate", "--decode", "--profile", "p.json"], "Drop one of them"),
        (
            ["simulate", "--decode", "--schedule", "gpipe", "--microbatches", "4"],
            "--schedule, --microbatches describe a training schedule, but --decode",
        ),
        (["generate", "--prompt-ids", "1,2,x"], "expected token ids separated by commas"),
        (["generate", "--balance", "1", "3", "2"], "pass --ranks 3 or a balance of 2 entries"),
    ],
)
def test_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_a_config_file_with_an_unknown_field_is_refused(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.toml"
    config.write_text("num_microbatch = 8\n")  # a typo of num_microbatches
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--config", str(config)])
    assert exit_info.value.code == 2
    assert "sets unknown fields ['num_microbatch']" in capsys.readouterr().err


@pytest.mark.dist
def test_demo_trains(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "4", "--log-every", "2", "--dim", "32"]) == 0
    out = capfd.readouterr()
    assert "step 4/4 | loss" in out.out + out.err
    # captured output is no terminal: one log line per log_every steps, no progress bar
    assert [line.split(" |")[0] for line in out.err.splitlines() if "/4 | loss" in line] == [
        "step 2/4",
        "step 4/4",
    ]
    assert "\r" not in out.err


# `conveyor run` launching a script on every rank: tests/cli/test_examples.py runs each example
# the way its docstring does


def test_the_run_summary_names_the_rank_the_ranks_reported() -> None:
    exited, how = "rank 0 (local rank 0)", "exit code 1 (an exception, see above)"
    # rank 1 hung: rank 0 timed out waiting for it and exited first
    hung = Failure(rank=0, lost=1, doing="receiving 0RB0<1", cause="Timed out waiting 60000ms")
    assert failure_summary(exited, 0, how, hung) == (
        "rank 1 failed first: rank 0 lost rank 1 while receiving 0RB0<1; "
        "rank 0 (local rank 0) exited first: exit code 1 (an exception, see above)"
    )
    raised = Failure(rank=0, lost=None, doing="step 3", cause="ValueError: bad")
    assert failure_summary(exited, 0, how, raised) == (
        "rank 0 (local rank 0) failed first: exit code 1 (an exception, see above): "
        "rank 0 abandoned step 3 after an error of its own: ValueError: bad"
    )
    assert failure_summary(exited, 0, how, None) == f"{exited} failed first: {how}"


def test_the_summary_reads_the_last_attempts_record_only(tmp_path: Path) -> None:
    failure = Failure(rank=0, lost=1, doing="receiving 0RB0<1", cause="Connection closed")
    (tmp_path / "attempt-0.json").write_text(failure.to_json())
    assert read_failure(tmp_path, 0) == failure
    assert read_failure(tmp_path, 1) is None  # the restart failed before any rank recorded


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_two_nodes_on_localhost_train_two_replicas_and_trace_them(tmp_path: Path) -> None:
    # two torchrun agents meet through a c10d rendezvous, as two machines would: node 0
    # holds ranks 0-1 (stage 0 of both replicas), node 1 ranks 2-3 (stage 1)
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    script = str(ROOT / "examples" / "scale_out.py")
    command = [
        sys.executable, "-m", "conveyor.cli", "run", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"localhost:{port}", "-n", "2", "--dp", "2", "--trace", "trace",
        "--max-restarts", "0", script, "--steps", "5", "--every", "5", "--checkpoint-dir", "ckpt",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    env.pop("RANK", None)
    output = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    nodes = [subprocess.Popen(command, cwd=tmp_path, env=env, **output) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=360)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)[-4000:]
    assert "step 5 | loss" in "".join(outputs)
    assert (tmp_path / "ckpt" / "step-00000005" / "manifest.json").exists()
    timeline = load_run(tmp_path / "trace")  # 4 files, one timeline: a row per (replica, rank)
    assert timeline.num_ranks == 4
    assert [timeline.label(r) for r in range(4)] == [
        "replica 0 rank 0", "replica 0 rank 1", "replica 1 rank 0", "replica 1 rank 1",
    ]  # fmt: skip
    assert {e.action for e in timeline.events if e.kind == "reduce"} == {"reduce 0", "reduce 1"}


# -- conveyor plan: its time budget and what it says -----------------------------------------


def test_plan_without_a_link_says_the_reduction_was_not_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_plan import _batch, _loss, _model

    saved = tmp_path / "profile.json"
    workload = Workload("f", _model(), _batch, _loss)
    profile_model(workload, [4, 2], passes=1, min_time_s=0.001).save(saved)
    argv = ["plan", "--model", "test_plan:_factory", "--world-size", "2", "--memory", "1GiB"]
    argv += ["--batch-size", "8", "--microbatches", "2", "--profile", str(saved), "--no-link"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dp=2 x pp=1: " in out and "gradient reduction 0.00" not in out
    assert "gradient reduction not measured (no link between ranks: --no-link" in out
    assert "dp=1 x pp=2: " in out and "no gradient reduction (one replica)" in out


@pytest.mark.dist  # a process of its own, or seconds of measuring
def test_plan_logs_each_phase_and_keeps_its_time_budget(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    argv = ["plan", "--model", "test_plan:_slow", "--ranks", "2", "--memory", "1GiB"]
    began = time.monotonic()
    assert main([*argv, "--batch-size", "8", "--no-link", "--time-budget", "2"]) == 0
    assert time.monotonic() - began <= 2 + 10  # a bound: see test_plan._OVERRUN_S
    logged = [record.getMessage() for record in caplog.records]
    for phase in ("profiling slow: 8 units", "searching schedules", "planned slow for 2 ranks"):
        assert any(line.startswith(phase) for line in logged), (phase, logged)
    out = capsys.readouterr().out
    assert "not explored: cut short by the 2 s time budget" in out
    assert "\n  profile: " in out  # one line per thing left out


def test_plan_says_when_the_best_plan_would_wait_for_its_loader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_plan import _batch, _loss, _model

    saved = tmp_path / "profile.json"
    workload = Workload("f", _model(), _batch, _loss)
    profile_model(workload, [4, 2], passes=1, min_time_s=0.001).save(saved)
    argv = ["plan", "--model", "test_plan:_factory", "--ranks", "2", "--memory", "1GiB"]
    argv += ["--batch-size", "8", "--profile", str(saved), "--no-link"]
    assert main([*argv, "--input-ms", "100000"]) == 0
    assert "input-bound: the loader takes 100000.0 ms per batch" in capsys.readouterr().out
    assert main([*argv, "--input-ms", "0.000001"]) == 0
    assert "input-bound" not in capsys.readouterr().out
