"""The data-parallel gradient reduction: conveyor (FSDP2 replicate, once per step) vs torch DDP
on the same gradients, side by side on 2 processes.

    python benchmarks/bench_reduce.py      # 'reduce' section of docs/benchmarks.md

Two gloo processes (one thread each) train the same GPT (4 blocks of width 256, 3.3 M
parameters) on their halves of a batch of 8 sequences of 64 tokens, in alternating blocks of
steps: conveyor with dp=2 (pp=1: one stage, so the step is one forward and one backward, as
DDP's), and DistributedDataParallel with and without gradient sync (``no_sync``). conveyor's
reduction is its traced ``reduce 0`` action (the all-reduce after the last backward); DDP's is
what gradient sync adds to its backward (DDP overlaps its bucketed all-reduces with the
backward, so this is what it costs the step).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section

import conveyor
from conveyor.models import gpt, gpt_loss, text_batches


def _conveyor_step(
    pipe: conveyor.Pipeline, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, float]:
    """(step seconds, reduction seconds) of one conveyor step."""
    start = time.perf_counter()
    pipe.step(x, y)
    elapsed = time.perf_counter() - start
    for param in pipe.parameters():
        param.grad = None
    assert pipe.recorder is not None
    reduce = [e.duration for e in pipe.recorder.steps[-1][1] if e.kind == "reduce"]
    return elapsed, sum(reduce)


def _ddp_step(ddp: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor, sync: bool) -> float:
    """Seconds of one DDP forward and backward (with or without gradient sync)."""
    start = time.perf_counter()
    if sync:
        gpt_loss(ddp(x), y).backward()
    else:
        with ddp.no_sync():
            gpt_loss(ddp(x), y).backward()
    elapsed = time.perf_counter() - start
    ddp.zero_grad(set_to_none=True)
    return elapsed


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    try:
        torch.manual_seed(0)
        model = gpt(seq_len=64, dim=256, num_layers=4, num_heads=8, dropout=0.0)
        pipe = conveyor.Pipeline(
            copy.deepcopy(model), dp=2, num_microbatches=1, loss_fn=gpt_loss, trace=True
        )
        ddp = DistributedDataParallel(copy.deepcopy(model))
        x, y = text_batches(8, 64, 1)[0]
        x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
        samples: dict[str, list[float]] = {"step": [], "reduce": [], "sync": [], "nosync": []}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            block: dict[str, list[float]] = {k: [] for k in samples}
            for _ in range(args.steps):
                dist.barrier()
                step, reduce = _conveyor_step(pipe, x, y)
                block["step"].append(step)
                block["reduce"].append(reduce)
            for sync in (True, False):
                for _ in range(args.steps):
                    dist.barrier()
                    block["sync" if sync else "nosync"].append(_ddp_step(ddp, x, y, sync))
            if round_:
                for key, values in block.items():
                    samples[key] += values
        if rank == 0:
            torch.save(samples, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "samples.pt")
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=2)
        samples: dict[str, Any] = torch.load(out)
    median = {k: statistics.median(v) for k, v in samples.items()}
    ddp_reduce = median["sync"] - median["nosync"]
    ratio = median["reduce"] / ddp_reduce if ddp_reduce > 0 else float("inf")
    rows = [
        "| | conveyor (dp=2, pp=1) | torch DDP | conveyor / DDP |",
        "|---|---|---|---|",
        f"| step (forward + backward + reduction) | {median['step'] * 1e3:.1f} ms | "
        f"{median['sync'] * 1e3:.1f} ms | {median['step'] / median['sync']:.2f} |",
        f"| gradient reduction (what it adds to the step) | {median['reduce'] * 1e3:.1f} ms | "
        f"{ddp_reduce * 1e3:.1f} ms | {ratio:.2f} |",
        f"| step without reduction (DDP no_sync) | | {median['nosync'] * 1e3:.1f} ms | |",
    ]
    markdown = "\n".join(
        [
            "## Data-parallel gradient reduction: conveyor vs torch DDP",
            "",
            f"Command: `python benchmarks/bench_reduce.py` "
            f"({(time.perf_counter() - started) / 60:.1f} min; {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, 2 gloo processes, 1 thread each). "
            f"{len(samples['step'])} steps of each, in {args.rounds} alternating blocks; "
            "medians. Same model, same halves of the batch, same 13 MiB of gradients.",
            "",
            *rows,
        ]
    )
    if not args.no_write:
        write_section("reduce", markdown)
    print(markdown)


if __name__ == "__main__":
    main()
