"""Multi-process harness: run a function on gloo ranks that never hang the test session."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GROUP_TIMEOUT_S = 20.0


def run_ranks(
    fn: Callable[..., Any],
    tmp_path: Path,
    world_size: int = 2,
    timeout_s: float = 90.0,
    **kwargs: Any,
) -> None:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` gloo ranks; re-raise a rank's
    error, and kill every rank if the whole run outlives ``timeout_s``."""
    store = tmp_path / f"store-{time.monotonic_ns()}"
    ctx = mp.start_processes(
        _entry,
        args=(fn, world_size, str(store), kwargs),
        nprocs=world_size,
        join=False,
        start_method="forkserver",  # See Note [rank fork server]
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{fn.__name__} did not finish in {timeout_s:.0f}s on {world_size} ranks; "
                    "a rank is likely blocked in recv; rerun with --log-level=debug"
                )
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, store: str, kwargs: dict[str, Any]
) -> None:
    torch.set_num_threads(1)  # two ranks on two cores: avoid oversubscription
    torch.manual_seed(0)  # every rank draws the same batch, as Pipeline.step expects
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    try:
        fn(rank, world_size, **kwargs)
    finally:
        dist.destroy_process_group()
