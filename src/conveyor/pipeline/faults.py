"""Named fault-injection points, armed by the CONVEYOR_FAULTS environment variable.

    CONVEYOR_FAULTS="backward:rank=1:step=3" conveyor run -n 2 --max-restarts 1 \\
        --checkpoint-dir ckpt examples/train_resumable.py
    # rank 1 kills itself (SIGKILL) in the backward of the step after step 3

A fault is ``POINT[:rank=R][:step=S][:attempt=A][:action=kill|stop|enospc]``; several are separated
by commas. It fires once, when its point is reached on rank R (any rank if omitted) at step S
(the first time if omitted), in torchrun attempt A (default 0: the first attempt only, so the
restarted run goes through). ``step=S`` always means "after S completed optimizer steps": the
forward, backward and optimizer step of the step that follows step S, or the checkpoint of
step S. Without the variable no hook is installed and nothing is checked.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from conveyor.pipeline.core import Pipeline
from conveyor.torch_compat import pytree

__all__ = ["ACTIONS", "ENV", "POINTS", "Fault", "attempt", "configured", "fire", "install", "parse"]

logger = logging.getLogger(__name__)

ENV = "CONVEYOR_FAULTS"

POINTS: dict[str, str] = {
    "forward": "a stage's forward starts",
    "backward": "a stage's backward starts",
    "optimizer_step": "optimizer.step() starts",
    "checkpoint.after_snapshot": "the in-memory snapshot is taken; training may go on",
    "checkpoint.write": "half of the first write to this rank's data file is on disk",
    "checkpoint.after_data": "this rank's data files are written and hashed",
    "checkpoint.after_metadata": "every rank's data files and the .metadata file are written",
    "checkpoint.before_rename": "the manifest is written; the directory is not renamed yet",
}
"""Injection points and when each fires."""

ACTIONS = ("kill", "stop", "enospc")
"""``kill``: SIGKILL this process (a lost process). ``stop``: SIGSTOP it (a hung process: alive,
connections open, silent). ``enospc``: raise OSError(ENOSPC) (a full disk); meaningful at the
checkpoint points, where a writer raising is what a full disk does."""

Action = Literal["kill", "stop", "enospc"]


@dataclass(frozen=True)
class Fault:
    """One armed fault; see the module docstring for the text form."""

    point: str
    rank: int | None = None
    step: int | None = None
    attempt: int = 0
    action: Action = "kill"

    def __str__(self) -> str:
        text = self.point
        for name in ("rank", "step"):
            if getattr(self, name) is not None:
                text += f":{name}={getattr(self, name)}"
        return text + f":attempt={self.attempt}:action={self.action}"


def parse(text: str) -> tuple[Fault, ...]:
    """Faults from their text form; raises ValueError naming the part that is wrong."""
    faults = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        point, *options = item.split(":")
        if point not in POINTS:
            raise ValueError(
                f"{ENV}: unknown injection point {point!r} in {item!r}; expected "
                f"one of {sorted(POINTS)}"
            )
        fields: dict[str, Any] = {}
        for option in options:
            name, _, value = option.partition("=")
            if name in ("rank", "step", "attempt") and value.isdigit():
                fields[name] = int(value)
            elif name == "action" and value in ACTIONS:
                fields[name] = value
            else:
                raise ValueError(
                    f"{ENV}: cannot read {option!r} in {item!r}; expected "
                    "rank=N, step=N, attempt=N or action=kill|stop|enospc, e.g. "
                    "'backward:rank=1:step=3'"
                )
        faults.append(Fault(point, **fields))
    return tuple(faults)


_parsed: dict[str, tuple[Fault, ...]] = {}
_fired: set[Fault] = set()


def configured() -> tuple[Fault, ...]:
    """The faults armed in this process's environment (parsed once per value)."""
    text = os.environ.get(ENV, "")
    if text not in _parsed:
        _parsed[text] = parse(text)
    return _parsed[text]


def attempt() -> int:
    """This process's torchrun attempt: 0 first, 1 after the first restart, ..."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def fire(point: str, *, step: int | None, rank: int | None = None) -> None:
    """Trigger the fault armed for ``point`` here (this rank, ``step``, this attempt), if any.

    ``rank`` defaults to this process's global rank.
    """
    faults = configured()
    if not faults:
        return
    assert point in POINTS, f"unknown injection point {point!r}"
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    for fault in faults:
        if (
            fault.point == point
            and fault not in _fired
            and fault.attempt == attempt()
            and fault.rank in (None, rank)
            and fault.step in (None, step)
        ):
            _fired.add(fault)
            _trigger(fault, rank, step)


def _trigger(fault: Fault, rank: int, step: int | None) -> None:
    where = f"rank {rank}, step {step}, attempt {fault.attempt}"
    if fault.action == "enospc":
        logger.warning("[rank %d] injected fault %s: raising ENOSPC (%s)", rank, fault, where)
        raise OSError(errno.ENOSPC, f"No space left on device (injected fault {fault}, {where})")
    sig = signal.SIGKILL if fault.action == "kill" else signal.SIGSTOP
    print(
        f"[rank {rank}] injected fault {fault}: {sig.name} ({where})", file=sys.stderr, flush=True
    )
    os.kill(os.getpid(), sig)


def install(
    pipe: Pipeline, optimizer: torch.optim.Optimizer | None = None
) -> list[RemovableHandle]:
    """Hook the training points (forward, backward, optimizer_step) into ``pipe``'s stages and
    ``optimizer`` when a fault for one of them is armed; returns the hooks (empty if none).

    Hooks are placed on the stage modules and the optimizer, so the runtime is untouched: a
    forward pre-hook, a gradient hook on the stage's first output that carries a gradient
    (it fires when that stage's backward starts), and an optimizer step pre-hook.
    """
    points = {fault.point for fault in configured()}
    if not points & {"forward", "backward", "optimizer_step"}:
        return []
    handles = []
    for module in pipe.stages.values():
        handles.append(
            module.register_forward_pre_hook(
                lambda _module, _args: fire("forward", step=pipe.step_index)
            )
        )
        handles.append(module.register_forward_hook(_backward_hook(pipe)))
    if optimizer is not None:
        # Pipeline.step has counted the step already when the optimizer runs
        handles.append(
            optimizer.register_step_pre_hook(
                lambda _opt, _args, _kwargs: fire("optimizer_step", step=pipe.step_index - 1)
            )
        )
    return handles


def _backward_hook(pipe: Pipeline) -> Callable[[torch.nn.Module, Any, Any], None]:
    def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        step = pipe.step_index
        for leaf in pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(  # type: ignore[no-untyped-call]  # torch leaves it untyped
                    lambda _grad: fire("backward", step=step)
                )
                return

    return hook
