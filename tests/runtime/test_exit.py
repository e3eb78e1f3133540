"""A run that succeeded, or caught its error, exits 0 with or without destroy_process_group,
however its Pipelines were built: nothing conveyor starts is inside torch's C++ when the
interpreter finalizes (See Note [threads at exit] in conveyor.runtime.peers).

Each case is a torchrun job of two ranks that runs this file as a script. A job builds every
kind of Pipeline in turn, so that whatever each one leaves behind (threads, process groups,
trace files, a Checkpointer with a save in flight) is alive at exit together, and ends right
after building one more: the moment the heartbeat thread raced the interpreter's exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

import conveyor
from conveyor.runtime import peers
from conveyor.runtime.fingerprint import BatchMismatchError

TIMEOUT_S = 90.0
"""Longest a job may take (two ranks importing torch on two cores take a few seconds)."""


class _Net(nn.Module):
    """Four layers by name, for split points, stage modules and auto_split."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(torch.relu(self.b(self.a(x)))))


def _chain() -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))


def _gpt2() -> nn.Module:
    import transformers  # imported only where installed (HAS_TRANSFORMERS)

    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
_TEXT = {"input_ids": torch.arange(32).view(4, 8), "labels": torch.arange(32).view(4, 8)}
"""A batch of the Hugging Face model, which computes its own loss from the labels."""
_OPTIONS: dict[str, Any] = {"num_microbatches": 2, "loss_fn": F.mse_loss, "timeout_s": 20}
BUILDS: dict[str, Callable[[Path], conveyor.Pipeline]] = {
    "balance": lambda _: conveyor.Pipeline(_chain(), balance=[2, 2], **_OPTIONS),
    "split_points": lambda _: conveyor.Pipeline(_Net(), split_points=["c"], **_OPTIONS),
    "stage_modules": lambda _: conveyor.Pipeline(_Net(), stage_modules=("a,b", "c,d"), **_OPTIONS),
    "auto_split": lambda _: conveyor.Pipeline(
        _Net(), auto_split=True, example_inputs=torch.zeros(8, 8), **_OPTIONS
    ),
    "trace": lambda directory: conveyor.Pipeline(
        _chain(), trace_dir=str(directory / "trace"), **_OPTIONS
    ),
    "checkpointer": lambda _: conveyor.Pipeline(_chain(), **_OPTIONS),
    "huggingface": lambda _: conveyor.Pipeline(  # split through torch.export
        _gpt2(),
        split_points=["transformer.h.1"],
        example_inputs=_TEXT,
        **{**_OPTIONS, "loss_fn": None},
    ),
}


def _run(name: str, directory: Path, is_error: bool) -> None:
    """Build a Pipeline the way ``name`` says and train a step; with ``is_error``, then give
    the ranks different batches and catch the BatchMismatchError every rank raises."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    pipe = BUILDS[name](directory)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    if name == "huggingface":
        inputs, targets = _TEXT, None
    else:
        inputs, targets = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(inputs, targets)
    optimizer.step()
    if name == "checkpointer":  # never closed: its save runs on as the job goes on
        checkpointer = conveyor.Checkpointer(pipe, optimizer, directory=directory / "ckpt")
        checkpointer.save(1)
    if name == "trace":
        pipe.timeline()
    if is_error:
        if isinstance(inputs, dict):
            inputs = {name: (ids + rank) % 32 for name, ids in inputs.items()}
        with pytest.raises(BatchMismatchError):
            pipe.step(inputs if isinstance(inputs, dict) else inputs + rank, targets)


def main(argv: Sequence[str] | None = None) -> int:
    """One job: every build in ``--builds`` in turn, then one more Pipeline, and exit."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--builds", default=",".join(BUILDS))
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--error", action="store_true", help="each build ends with an error")
    parser.add_argument("--destroy", action="store_true", help="destroy_process_group at the end")
    parser.add_argument("--heartbeat-s", type=float, help="beat this often (to race the exit)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.heartbeat_s is not None:
        peers.HEARTBEAT_S = args.heartbeat_s
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    for name in args.builds.split(","):
        _run(name, args.directory, args.error)
    conveyor.Pipeline(_chain(), **_OPTIONS)  # the script ends right after
    rank = dist.get_rank()
    if args.destroy:
        dist.destroy_process_group()
    print(f"rank {rank}: exiting", flush=True)
    return 0


def _job(directory: Path, *args: str) -> None:
    """Run this file as a two-rank torchrun job; it must exit 0 and nothing may abort."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "conveyor.cli", "run", "-n", "2", __file__]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    try:
        done = subprocess.run(
            [*command, "--directory", str(directory), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the job {args} did not finish in {TIMEOUT_S:.0f}s: {error}")
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the job {args} exited {done.returncode}:\n{output[-4000:]}"
    assert "terminate called" not in output, output[-4000:]
    assert done.stdout.count(": exiting") == 2, output[-4000:]


_QUICK = [name for name in BUILDS if name != "huggingface"]
"""Every build but the Hugging Face model's, whose export adds as long as a whole job."""
_RACING = ("--heartbeat-s", "0.001")
"""A heartbeat every millisecond: before it was stopped at exit, 6 of 7 jobs ending right
after building a Pipeline without destroy_process_group aborted (13 of 50 at 1 s)."""


@pytest.mark.dist
@pytest.mark.timeout(2 * TIMEOUT_S)
@pytest.mark.parametrize(
    ("flags", "with_huggingface"),
    [([], False), (["--error"], True), (["--destroy"], False), (["--error", "--destroy"], False)],
    ids=["left-success", "left-error", "destroyed-success", "destroyed-error"],
)
def test_every_way_of_building_a_pipeline_exits_0(
    tmp_path: Path, flags: list[str], with_huggingface: bool
) -> None:
    builds = _QUICK + ["huggingface"] * (with_huggingface and HAS_TRANSFORMERS)
    _job(tmp_path, "--builds", ",".join(builds), *_RACING, *flags)


if __name__ == "__main__":
    sys.exit(main())


@pytest.mark.dist
def test_leave_runs_exit_handlers_flushes_and_exits_with_the_code() -> None:
    """conveyor's own rank entry points end with ``leave``: what an exit handler and the
    program wrote reaches the pipe (not lost with the skipped finalization), with the code."""
    script = (
        "import atexit, logging\n"
        "from conveyor.runtime.peers import leave\n"
        "atexit.register(lambda: print('handler ran', flush=False))\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "logging.info('logged')\n"
        "print('printed', end='; ')\n"
        "leave(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "printed; handler ran\n", done.stdout
    assert done.stderr == "logged\n", done.stderr
