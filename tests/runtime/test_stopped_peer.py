"""A stopped peer (SIGSTOP: alive, connections open, silent): every other rank exits with
PeerLostError within timeout_s + 5 s of the stop, naming the stopped rank by its global rank,
whatever it was waiting in (a step, a tied weight's sum, a checkpoint in flight, a data-parallel
reduction, a generation); the first failure on record names the stopped rank."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import Run, small_gpt, tied_gpt, windows

import conveyor
from conveyor.checkpoint.writer import Writer
from conveyor.cli.launch import failure_summary
from conveyor.models import gpt_loss
from conveyor.pipeline import faults
from conveyor.runtime.peers import FAILURES_ENV, read_failure

pytestmark = pytest.mark.dist

TIMEOUT_S = 3.0
"""The pipeline's timeout_s in every scenario: small, so that the tests are quick."""
BOUND_S = TIMEOUT_S + 5.0
"""Longest time from the stop to the exit of every other rank."""


# -- scenarios: each runs on every rank; the stopped rank stops itself inside -----------------


def _plain(rank: int, out: Path) -> None:
    """Three ranks; the last stops in the forward of step 2: rank 1 waits for it, rank 0 only
    for rank 1."""
    os.environ[faults.ENV] = "forward:rank=2:step=2:action=stop"
    pipe = conveyor.Pipeline(small_gpt(), loss_fn=gpt_loss, timeout_s=TIMEOUT_S)
    faults.install(pipe)
    for step in range(4):
        inputs, targets = windows()[8 * step : 8 * step + 8]
        pipe.step(inputs, targets)


def _slow_writes(seconds: float) -> None:
    """This rank's checkpoint writes take ``seconds`` longer (a large model's would), so its
    background save waits for its peers after the training thread has started to."""
    write_data = Writer.write_data

    def slow(self: Writer, plan: Any, planner: Any) -> Any:
        time.sleep(seconds)
        return write_data(self, plan, planner)

    Writer.write_data = slow  # type: ignore[method-assign]


def _save(rank: int, out: Path) -> None:
    """An asynchronous save in flight: rank 1 stops once it has written its data, while rank
    0 still writes its own; rank 0 trains on, and its save then waits for rank 1 too."""
    os.environ[faults.ENV] = "checkpoint.after_data:rank=1:step=2:action=stop"
    if rank == 0:
        _slow_writes(TIMEOUT_S)
    run = Run(out / "ckpt", pipeline={"timeout_s": TIMEOUT_S})
    with run.ckpt:
        run.train(0, 6)


def _mesh(rank: int, out: Path) -> None:
    """dp=2 x pp=2 with an asynchronous checkpoint every 2 steps; global rank 0 (replica 0,
    stage 0) stops in the forward of step 3, while rank 3 still writes step 2."""
    os.environ[faults.ENV] = "forward:rank=0:step=3:action=stop"
    if rank == 3:
        _slow_writes(TIMEOUT_S)  # its save of step 2 is in flight at the stop
    run = Run(out / "ckpt", pipeline={"timeout_s": TIMEOUT_S, "dp": 2})
    assert run.pipe.mesh is not None and run.pipe.num_replicas == 2
    with run.ckpt:
        run.train(0, 8)


def _tied(rank: int, out: Path) -> None:
    """Rank 1 stops where it would sum the tied gradient: rank 0 waits for its part."""
    pipe = conveyor.Pipeline(tied_gpt(), loss_fn=gpt_loss, timeout_s=TIMEOUT_S)
    inputs, targets = windows()[:8]
    pipe.step(inputs, targets)  # the tie spans the two ranks
    assert len(pipe.ties.params) == 1
    if rank == 1:
        pipe.ties._sum_gradients = lambda before: os.kill(os.getpid(), signal.SIGSTOP)  # type: ignore[method-assign]
    pipe.step(inputs, targets)


def _generate(rank: int, out: Path) -> None:
    """Rank 1 stops in the fourth attention of its decoding block."""
    pipe = conveyor.Pipeline(small_gpt(), loss_fn=gpt_loss, timeout_s=TIMEOUT_S)
    ids = windows()[:2][0][:, :4]
    pipe.generate(ids, max_new_tokens=2)
    if rank == 1:
        block = next(m for m in pipe.decoder._local_modules() if hasattr(m, "attend"))
        attend, calls = block.attend, [0]

        def stopping(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == 4:
                os.kill(os.getpid(), signal.SIGSTOP)
            return attend(*args, **kwargs)

        block.attend = stopping
    pipe.generate(ids, max_new_tokens=8)


SCENARIOS: dict[str, tuple[Callable[[int, Path], None], int, str]] = {
    "plain": (_plain, 3, "rank 2"),
    "save": (_save, 2, "rank 1"),
    "tied": (_tied, 2, "rank 1"),
    "mesh": (_mesh, 4, "rank 0 (replica 0, stage 0)"),
    "generate": (_generate, 2, "rank 1"),
}
"""Scenario -> (function, number of ranks, the rank that stops as messages name it)."""


# -- the harness ----------------------------------------------------------------------------


def _rank(rank: int, world_size: int, store: str, out: str, scenario: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ[FAILURES_ENV] = str(Path(out, "failures"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),  # far above the pipeline's: it must not be the one
    )
    report: dict[str, Any] = {}
    try:
        SCENARIOS[scenario][0](rank, Path(out))
        report["message"] = "finished"
    except BaseException as error:  # what the rank reports as it exits
        report["type"] = type(error).__name__
        report["message"] = "".join(traceback.format_exception_only(type(error), error))
        report["traceback"] = traceback.format_exc()[-2000:]
    report["raised"] = time.time()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    atexit._run_exitfuncs()  # as the interpreter would at exit; threads are joined next


def _is_stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] == "T"


def _run(tmp_path: Path, scenario: str) -> dict[int, dict[str, Any]]:
    """Run ``scenario`` on its ranks without a supervisor (which would stop the others);
    returns each other rank's report, with the time from the stop to its process's end."""
    _, world_size, name = SCENARIOS[scenario]
    stopped = int(name.split()[1])
    out = tmp_path / scenario
    (out / "failures").mkdir(parents=True)
    context = multiprocessing.get_context("forkserver")  # See Note [rank fork server]
    processes = [
        context.Process(target=_rank, args=(r, world_size, str(out / "store"), str(out), scenario))
        for r in range(world_size)
    ]
    stop_time: float | None = None
    exits: dict[int, float] = {}
    try:
        for process in processes:
            process.start()
        give_up = time.time() + 60 + 4 * world_size
        while len(exits) < world_size - 1 and time.time() < give_up:
            now = time.time()
            if stop_time is None and _is_stopped(processes[stopped].pid or 0):
                stop_time = now
            for r, process in enumerate(processes):
                if r != stopped and r not in exits and not process.is_alive():
                    exits[r] = now
            time.sleep(0.02)
    finally:
        for process in processes:
            process.kill()
            process.join()
    reports = {}
    for r in range(world_size):
        path = out / f"rank{r}.json"
        report = json.loads(path.read_text()) if path.exists() else {"message": "no report"}
        report["exit_s"] = exits[r] - stop_time if r in exits and stop_time else None
        reports[r] = report
    assert stop_time is not None, f"rank {stopped} never stopped: {reports}"
    del reports[stopped]
    return reports


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_other_rank_exits_in_bounded_time_naming_the_stopped_rank(
    tmp_path: Path, scenario: str
) -> None:
    """Each other rank raises PeerLostError naming the stopped rank, and its process has
    ended within timeout_s + 5 s of the stop; the first failure on record, which `conveyor
    run`'s summary reads, names the stopped rank, not the first rank whose wait timed out."""
    reports = _run(tmp_path, scenario)
    name = SCENARIOS[scenario][2]
    print(scenario, {rank: report["exit_s"] for rank, report in reports.items()})
    for rank, report in reports.items():
        assert report.get("type") == "PeerLostError", (scenario, rank, report)
        assert f": lost {name} while" in report["message"], (scenario, rank, report)
        assert report["exit_s"] is not None and report["exit_s"] <= BOUND_S, (scenario, rank)
    if scenario == "tied":  # only a timeout ends this wait: the heartbeat says why
        assert "Rank 1 has likely crashed, been killed or stopped" in reports[0]["message"]
    failure = read_failure(tmp_path / scenario / "failures", 0)
    assert failure is not None and failure.name(failure.culprit) == name, failure
    survivor = min(reports)  # what torchrun sees first: a rank that exited, not the stopped one
    summary = failure_summary(f"rank {survivor}", survivor, "exit code 1", failure)
    assert summary.startswith(f"{name} failed first: "), summary
