"""Fault injection: kill any rank at any point, the run resumes bitwise; a lost peer fails every
rank quickly, naming it; a full disk leaves earlier checkpoints intact."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conveyor.checkpoint import CheckpointError, list_checkpoints, read_checkpoint, verify
from conveyor.runtime import faults
from dist import run_ranks
from test_checkpoint import Run, assert_same

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_resumable.py"


# -- the fault specification ------------------------------------------------------------------


def test_faults_parse_and_name_what_is_wrong() -> None:
    assert faults.parse("backward:rank=1:step=3, checkpoint.after_data:attempt=2") == (
        faults.Fault("backward", rank=1, step=3),
        faults.Fault("checkpoint.after_data", attempt=2),
    )
    assert faults.parse("checkpoint.write:action=enospc")[0].action == "enospc"
    assert faults.parse("") == ()
    with pytest.raises(ValueError, match="unknown injection point 'backwards'"):
        faults.parse("backwards:rank=1")
    with pytest.raises(ValueError, match="cannot read 'rank=one'"):
        faults.parse("forward:rank=one")


def test_a_fault_fires_once_at_its_rank_step_and_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "checkpoint.after_data:rank=1:step=4:action=enospc")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    faults.fire("checkpoint.after_data", step=4, rank=0)  # another rank
    faults.fire("checkpoint.after_data", step=2, rank=1)  # another step
    faults.fire("checkpoint.after_metadata", step=4, rank=1)  # another point
    with pytest.raises(OSError, match="No space left on device"):
        faults.fire("checkpoint.after_data", step=4, rank=1)
    faults.fire("checkpoint.after_data", step=4, rank=1)  # fired already
    monkeypatch.setenv(faults.ENV, "forward:attempt=1:action=enospc")
    faults.fire("forward", step=0, rank=0)  # first attempt: the fault is for the restart
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(OSError):
        faults.fire("forward", step=0, rank=0)


def test_a_kill_fault_kills_the_process_with_sigkill() -> None:
    code = (
        "from conveyor.runtime import faults; faults.fire('forward', step=3, rank=0); "
        "print('alive')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, faults.ENV: "forward:step=3"},
        timeout=120,
    )
    assert result.returncode == -9 and "alive" not in result.stdout
    assert "injected fault forward:step=3:attempt=0:action=kill: SIGKILL" in result.stderr


# -- a full disk ----------------------------------------------------------------------------


def _disk_full(rank: int, world_size: int, root: str, async_save: bool) -> None:
    directory = Path(root) / f"async-{async_save}"
    os.environ[faults.ENV] = "checkpoint.write:rank=1:step=4:action=enospc"
    run = Run(directory, async_save=async_save, keep=0)
    run.train(0, 3)  # step 2 saved
    message = (
        rf"checkpoint {directory}/\.tmp-step-00000004-\w+-1: saving step 4 failed: "
        r"rank 1: RuntimeError: rank 1: writing __1_0\.distcp in .*: OSError: \[Errno 28\] "
        r"No space left on device .*; the checkpoint was not published and earlier ones "
        rf"in {directory} are untouched"
    )
    with pytest.raises(CheckpointError, match=message):
        run.train(3, 4)  # saves step 4: raises at once when synchronous
        run.ckpt.wait()  # else when the background write is waited for
    dist.barrier()
    assert [step for step, _ in list_checkpoints(directory)] == [2]
    verify(directory / "step-00000002")
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000002"]  # no debris
    run.train(4, 6)  # space again: the next save goes through
    run.ckpt.close()
    assert [step for step, _ in list_checkpoints(directory)] == [6, 2]
    del os.environ[faults.ENV]


@pytest.mark.dist
@pytest.mark.parametrize("async_save", [True, False])
def test_full_disk_keeps_earlier_checkpoints_and_says_so(tmp_path: Path, async_save: bool) -> None:
    run_ranks(_disk_full, tmp_path, 2, timeout_s=150, root=str(tmp_path), async_save=async_save)


# -- killed ranks under torchrun restarts --------------------------------------------------


def _conveyor_run(
    tmp_path: Path, name: str, steps: int, fault_list: list[str], max_restarts: int
) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    directory, log = tmp_path / name, tmp_path / f"{name}.jsonl"
    env = {**os.environ, faults.ENV: ",".join(fault_list), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "conveyor.cli",
        "run",
        "-n",
        "2",
        "--max-restarts",
        str(max_restarts),
        "--checkpoint-dir",
        str(directory),
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--every",
        "2",
        "--loss-log",
        str(log),
    ]
    # a session of its own, so a timeout stops torchrun's workers too, not only torchrun
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=500)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), directory, log


def _losses(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def _check_against_reference(tmp_path: Path, steps: int, fault_list: list[str]) -> None:
    reference, reference_dir, reference_log = _conveyor_run(tmp_path, "reference", steps, [], 0)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = {entry["step"]: entry["loss"] for entry in _losses(reference_log)}
    assert sorted(expected) == list(range(1, steps + 1))

    result, directory, log = _conveyor_run(tmp_path, "faulted", steps, fault_list, len(fault_list))
    assert result.returncode == 0, result.stderr[-3000:]
    for fault in faults.parse(",".join(fault_list)):  # every fault really fired
        assert f"injected fault {fault}: SIGKILL" in result.stderr, fault
    entries = _losses(log)
    assert {entry["attempt"] for entry in entries} == set(range(len(fault_list) + 1))
    for entry in entries:  # every step, in every attempt that ran it, bit for bit
        assert entry["loss"] == expected[entry["step"]], entry
    assert {entry["step"] for entry in entries} == set(expected)
    final = f"step-{steps:08d}"
    assert_same(read_checkpoint(directory / final), read_checkpoint(reference_dir / final))


TRAINING_FAULTS = [
    "forward:rank=0:step=1:attempt=0",
    "forward:rank=1:step=3:attempt=1",
    "backward:rank=0:step=5:attempt=2",
    "backward:rank=1:step=7:attempt=3",
    "optimizer_step:rank=0:step=9:attempt=4",
    "optimizer_step:rank=1:step=11:attempt=5",
]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_killed_in_training_resumes_bitwise(tmp_path: Path) -> None:
    """SIGKILL each rank in forward, backward and the optimizer step, one after the other."""
    _check_against_reference(tmp_path, 14, TRAINING_FAULTS)


CHECKPOINT_PHASES = ["after_snapshot", "write", "after_data", "after_metadata", "before_rename"]
CHECKPOINT_FAULTS = [
    f"checkpoint.{phase}:rank={rank}:step={2 * (2 * i + rank + 1)}:attempt={2 * i + rank}"
    for i, phase in enumerate(CHECKPOINT_PHASES)
    for rank in (0, 1)
]


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_killed_while_checkpointing_resumes_bitwise(tmp_path: Path) -> None:
    """SIGKILL each rank (rank 0 coordinates the save) at every phase of a checkpoint write."""
    _check_against_reference(tmp_path, 22, CHECKPOINT_FAULTS)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_lost_rank_without_restarts_left_fails_the_run_naming_it(tmp_path: Path) -> None:
    lost = ["backward:rank=1:step=2:attempt=0", "forward:rank=0:step=3:attempt=1"]
    result, _, log = _conveyor_run(tmp_path, "lost", 8, lost, 1)
    assert result.returncode == 1
    assert (
        "rank 0 (local rank 0) failed first: exit code -9 (SIGKILL); no restarts left "
        "(--max-restarts 1 used up)"
    ) in result.stderr
    # rank 1 fails on its own, naming rank 0, unless torchrun has stopped it first
    assert "lost rank 0" in result.stderr or "SIGTERM" in result.stderr
    assert {entry["attempt"] for entry in _losses(log)} == {0, 1}
    assert max(entry["step"] for entry in _losses(log)) == 3


# -- a lost peer, every survivor fails quickly naming it -----------------------------------


def _survivor(rank: int, world_size: int, store: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    start = time.monotonic()
    try:
        Run(Path(out) / "ckpt", pipeline={"timeout_s": 30.0}, timeout_s=30.0).train(0, 6)
        message = "finished"
    except BaseException as error:  # what the rank reports as it exits
        message = "".join(traceback.format_exception_only(type(error), error))
    Path(out, f"rank{rank}.txt").write_text(f"{time.monotonic() - start:.1f}\n{message}")
    os._exit(0 if message == "finished" else 1)


def _lose(tmp_path: Path, lost: int, world_size: int = 3) -> dict[int, tuple[int, str]]:
    """Start ``world_size`` ranks without a supervisor that would stop the survivors; kill
    rank ``lost`` in the backward of step 3; returns each survivor's exit code and report."""
    out = tmp_path / f"lost-{lost}"
    out.mkdir()
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_survivor, args=(r, world_size, str(out / "store"), str(out)))
        for r in range(world_size)
    ]
    os.environ[faults.ENV] = f"backward:rank={lost}:step=2"
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(90)
    finally:
        del os.environ[faults.ENV]
        for process in processes:
            if process.is_alive():
                process.kill()
    assert processes[lost].exitcode == -9
    return {
        r: (processes[r].exitcode, (out / f"rank{r}.txt").read_text())
        for r in range(world_size)
        if r != lost
    }


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_lost_peer_fails_every_rank_naming_it(tmp_path: Path) -> None:
    for rank, (code, report) in _lose(tmp_path, lost=1).items():
        assert code == 1, report
        assert f"PeerLostError: rank {rank}: lost rank 1 while" in report
        assert "Connection" in report, "the backend saw the peer go; no timeout was needed"
    reports = _lose(tmp_path, lost=2)  # the last rank: rank 0 only sees rank 1 go
    assert reports[1][0] == 1 and "rank 1: lost rank 2 while" in reports[1][1]
    assert reports[0][0] == 1 and "rank 0: lost rank 1 while" in reports[0][1]
    assert "Rank 1 reported losing rank 2 first." in reports[0][1]
