"""Fault injection: kill any rank at any point, the run resumes bitwise; a lost peer fails every
rank quickly, naming it; a full disk leaves earlier checkpoints intact."""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from test_checkpoint import Run, assert_same
from torch import nn

import conveyor
from conveyor.checkpoint import CheckpointError, list_checkpoints, read_checkpoint, verify
from conveyor.cli.launch import failure_summary
from conveyor.pipeline import faults
from conveyor.runtime.peers import Failure, PeerLostError
from dist import run_ranks

ROOT = Path(__file__).resolve().parents[2]
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


def test_a_failure_record_places_its_ranks_and_the_summary_blames_the_lost_one() -> None:
    """On a mesh a record keeps where its ranks sit; the summary names the rank lost (which
    never exits when stopped), not the first rank torchrun saw exit."""
    places = ((3, "replica 1, stage 1"), (0, "replica 0, stage 0"))
    failure = Failure(3, 0, "reducing stage 1's gradients", "Timed out", places)
    assert Failure.from_json(failure.to_json()) == failure
    assert Failure.from_json('{"rank": 1, "lost": 0, "doing": "x", "cause": "y"}').places == ()
    assert failure_summary("rank 1 (local rank 1)", 1, "exit code 1", failure) == (
        "rank 0 (replica 0, stage 0) failed first: rank 3 (replica 1, stage 1) lost rank 0 "
        "(replica 0, stage 0) while reducing stage 1's gradients; rank 1 (local rank 1) exited "
        "first: exit code 1"
    )


@pytest.mark.dist  # a process of its own, or seconds of measuring
def test_a_kill_fault_kills_the_process_with_sigkill() -> None:
    code = (
        "from conveyor.pipeline import faults; faults.fire('forward', step=3, rank=0); "
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
    assert sorted(p.name for p in directory.iterdir()) == [".lock", "step-00000002"]  # no debris
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


CHECKPOINT_PHASES = ["after_snapshot", "write", "after_data", "after_metadata", "before_rename"]
TRAINING_PHASES = ["forward", "backward", "optimizer_step"]


def _kills() -> list[str]:
    """A kill in forward, backward and the optimizer step, and at every phase of a checkpoint
    write, the phases taking turns between the ranks (rank 0 coordinates the save): a kill per
    attempt, at a later step each time, in one run (checkpoints every 2 steps). Each restart
    costs about 4 s of starting ranks, so each phase is killed on one rank."""
    timed = [(2 * i + 1, f"{phase}:rank={i % 2}") for i, phase in enumerate(TRAINING_PHASES)]
    timed += [(2 * (i + 1), f"checkpoint.{phase}:rank={i % 2}")
              for i, phase in enumerate(CHECKPOINT_PHASES)]  # fmt: skip
    timed.sort()
    return [f"{fault}:step={step}:attempt={attempt}" for attempt, (step, fault) in enumerate(timed)]


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_killed_anywhere_resumes_bitwise(tmp_path: Path) -> None:
    """SIGKILL a rank in forward, backward and the optimizer step, and at every phase of a
    checkpoint write, one after the other, both ranks in turn; every step's loss and the
    final checkpoint equal an uninterrupted run's, bit for bit."""
    kills = _kills()
    assert len(kills) == 8 and {k.split(":")[1] for k in kills} == {"rank=0", "rank=1"}
    _check_against_reference(tmp_path, 12, kills)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_lost_rank_without_restarts_left_fails_the_run_naming_it(tmp_path: Path) -> None:
    lost = ["backward:rank=1:step=2:attempt=0", "forward:rank=0:step=3:attempt=1"]
    result, _, log = _conveyor_run(tmp_path, "lost", 8, lost, 1)
    assert result.returncode == 1
    assert re.search(  # with what rank 1 recorded, unless torchrun stopped it first
        r"rank 0 \(local rank 0\) failed first: exit code -9 \(SIGKILL\)"
        r"(: rank 1 lost rank 0 while \S+ 1RF0<0)?; no restarts left \(--max-restarts 1 used up\)",
        result.stderr,
    ), result.stderr[-3000:]
    # rank 1 fails on its own, naming rank 0, unless torchrun has stopped it first
    assert "lost rank 0" in result.stderr or "SIGTERM" in result.stderr
    assert {entry["attempt"] for entry in _losses(log)} == {0, 1}
    assert max(entry["step"] for entry in _losses(log)) == 3


# -- a lost peer, every survivor fails quickly naming it -----------------------------------


def _survivor(rank: int, world_size: int, store: str, out: str, fault: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ[faults.ENV] = fault  # See Note [rank fork server]
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
    context = multiprocessing.get_context("forkserver")  # See Note [rank fork server]
    fault = f"backward:rank={lost}:step=2"
    processes = [
        context.Process(target=_survivor, args=(r, world_size, str(out / "store"), str(out), fault))
        for r in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        for process in processes:
            process.join(90)
    finally:
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
    assert reports[0][0] == 1 and "rank 0: lost rank 2 while" in reports[0][1]
    # rank 0 blames rank 2 (its heartbeat stopped) and says rank 1 went down after it, whether
    # it read rank 1's record of the loss first or the heartbeats did
    assert re.search(r"lost rank 2 while .*rank 1 went down", reports[0][1]), reports[0][1]


# -- a stopped peer (SIGSTOP: alive, connections open, silent) costs timeout_s, named -------


def _stopped_peer(rank: int, world_size: int, store: str, out: str, scenario: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),  # far above the pipeline's: it must not be the one
    )
    report: dict[str, Any] = {}
    try:
        STOPPED[scenario](rank, Path(out), report)
        report["message"] = "finished"
    except BaseException as error:  # what the rank reports as it exits
        report["message"] = "".join(traceback.format_exception_only(type(error), error))
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)


def _stop_in_save(rank: int, out: Path, report: dict[str, Any]) -> None:
    """Bad checkpoint directories fail at once; then rank 1 stops in a background save and
    rank 0 leaves the ``with`` block, which waits for that save."""
    read_only, a_file = out / "read-only", out / "a-file"
    if rank == 0:
        read_only.mkdir(mode=0o555)
        a_file.write_text("not a directory")
    dist.barrier()
    with (
        _as_unprivileged(),
        pytest.raises(
            CheckpointError,
            match=rf"checkpoint {re.escape(str(read_only))}: cannot write into the checkpoint "
            r"directory \(rank 0: PermissionError: .*; rank 1: PermissionError: .*\); make it "
            "writable by every rank, or pass another directory",
        ),
    ):
        Run(read_only, pipeline={"timeout_s": 3.0})
    with pytest.raises(CheckpointError, match="a-file: is a file, not a directory"):
        Run(a_file, pipeline={"timeout_s": 3.0})
    os.environ[faults.ENV] = "checkpoint.after_data:rank=1:step=2:action=stop"
    run = Run(out / "ckpt", pipeline={"timeout_s": 3.0})
    report["timeout"] = run.ckpt.timeout.total_seconds()  # the pipeline's: none given
    start = time.monotonic()
    try:
        with run.ckpt:
            for step in (1, 2):
                inputs, targets = next(run.batches)
                run.pipe.step(inputs, targets)
                run.optimizer.step()
                run.optimizer.zero_grad()
                run.ckpt.maybe_save(step)  # step 2: rank 1 stops after writing its data
            start = time.monotonic()
    finally:
        report["seconds"] = time.monotonic() - start


STOPPED: dict[str, Callable[[int, Path, dict[str, Any]], None]] = {"save": _stop_in_save}


@contextmanager
def _as_unprivileged() -> Iterator[None]:
    """This thread without CAP_DAC_OVERRIDE, so that root too is refused by file modes."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0
    saved = data[0].effective
    data[0].effective = saved & ~(1 << 1)  # CAP_DAC_OVERRIDE
    assert libc.capset(ctypes.byref(header), data) == 0
    try:
        yield
    finally:
        data[0].effective = saved
        assert libc.capset(ctypes.byref(header), data) == 0


def _stop(tmp_path: Path, scenario: str) -> dict[str, Any]:
    """Run ``scenario`` on two ranks without a supervisor; rank 1 stops itself (SIGSTOP) in
    it; returns rank 0's report once it has finished, then kills rank 1."""
    out = tmp_path / scenario
    out.mkdir()
    context = multiprocessing.get_context("forkserver")  # See Note [rank fork server]
    processes = [
        context.Process(target=_stopped_peer, args=(r, 2, str(out / "store"), str(out), scenario))
        for r in range(2)
    ]
    try:
        for process in processes:
            process.start()
        processes[0].join(90)
    finally:
        for process in processes:
            process.kill()
    report: dict[str, Any] = json.loads((out / "rank0.json").read_text())
    return report


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_stopped_peer_costs_the_timeout_and_is_named(tmp_path: Path) -> None:
    """The peer is alive with its connections open, so no backend error comes: only the
    timeout (the pipeline's 3 s, which the checkpoint's group takes) ends the wait, and the
    heartbeat names the rank that stopped (test_stopped_peer.py times every other case)."""
    save = _stop(tmp_path, "save")
    assert save["timeout"] == 3.0
    assert re.search(  # the save finds it, or the wait for the save watching the heartbeats
        r"(Error: checkpoint \S+: saving step 2 failed: |PeerLostError: )rank 0: lost rank 1 "
        r"while \w+ step 2 \((waited at most|silent for) 3s\): its heartbeat stopped",
        save["message"],
    ), save
    assert save["seconds"] <= 3.0 + 5.0, save


# -- a rank whose step raised and that stays alive tells its peers at once ------------------


class _Raising(nn.Module):
    """The identity, until armed: then it raises, as a user's stage may."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _Raising.armed:
            raise ValueError("bad value in stage 2")
        return x


def _four_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), _Raising(), nn.Linear(8, 8)).double()


def _abandoned_step(rank: int, world_size: int, root: str) -> None:
    plan = Path(root, "plan.json")
    if rank == 0:
        plan.write_text(json.dumps({"pipeline": {"balance": [2, 2, 2]}}))
    dist.barrier()
    with pytest.raises(
        ValueError,
        match=rf"covers 6 layers but the model has 4.* plan file '{re.escape(str(plan))}'",
    ):
        conveyor.Pipeline(_four_layers(), plan=plan, loss_fn=F.mse_loss)
    options: dict[str, Any] = {"balance": (1, 1, 2), "num_microbatches": 2, "timeout_s": 15.0}
    pipe = conveyor.Pipeline(_four_layers(), loss_fn=F.mse_loss, **options)
    x = torch.randn(4, 8, dtype=torch.float64)
    pipe.step(x, x)
    _Raising.armed = rank == 2
    cause = "rank 2 abandoned step 1 after an error of its own: ValueError: bad value in stage 2"
    expected = {
        2: (ValueError, r"^bad value in stage 2\nconveyor: rank 2 \(stage 2\), forward of"),
        1: (PeerLostError, rf"^rank 1: lost rank 2 while [^:]+: {cause}\. Fix that error"),
        0: (PeerLostError, rf"^rank 0: lost rank 1 while [^:]+: {cause} \(rank 1 went down"),
    }
    start = time.monotonic()
    with pytest.raises(expected[rank][0], match=expected[rank][1]):
        pipe.step(x, x)
    assert time.monotonic() - start < 7.5, "told at once, not after timeout_s (15 s)"
    with pytest.raises(RuntimeError, match=rf"rank {rank}: this Pipeline abandoned step 1 \("):
        pipe.step(x, x)
    _Raising.armed = False
    fresh = conveyor.Pipeline(_four_layers(), loss_fn=F.mse_loss, **options)  # new connections
    loss = fresh.step(x, x)
    if rank == 2:
        assert loss is not None
        torch.testing.assert_close(loss, F.mse_loss(_four_layers()(x), x), rtol=0, atol=1e-12)


@pytest.mark.dist
def test_a_rank_whose_step_raised_tells_its_peers_at_once(tmp_path: Path) -> None:
    run_ranks(_abandoned_step, tmp_path, 3, timeout_s=120, root=str(tmp_path))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_conveyor_run_names_the_rank_that_failed_not_the_first_to_exit(tmp_path: Path) -> None:
    """Rank 1's stage raises: both ranks exit (rank 0 with PeerLostError), in an order
    torchrun may see either way; the summary names rank 1 and its error."""
    result, _, _ = _conveyor_run(tmp_path, "raised", 2, ["forward:rank=1:step=1:action=enospc"], 0)
    assert result.returncode == 1
    assert re.search(
        r"rank 1 (\(local rank 1\) )?failed first: .*rank 1 abandoned step 1 after an error "
        r"of its own: OSError: \[Errno 28\] No space left on device",
        result.stderr,
    ), result.stderr[-3000:]
