"""The data-parallel gradient reduction: conveyor (DDP's reducer driven by the pipeline, once
per step) vs torch DDP on the same gradients, side by side on 2 processes.

    python benchmarks/bench_reduce.py      # 'reduce' section of docs/benchmarks.md

Two gloo processes (one thread each) train the same GPT (4 blocks of width 256, 3.3 M
parameters) on their halves of a batch of 8 sequences of 64 tokens, four kinds of step
taking turns: conveyor with dp=2 (pp=1: one stage, so the step is one forward and one backward, as
DDP's) and with one replica per process (dp=1, nothing reduced), and DistributedDataParallel
with and without gradient sync (``no_sync``). What data parallelism costs each is the
difference between its step with and without the reduction (both overlap bucketed
all-reduces with the backward; conveyor waits for them at the step's end, DDP at the end of
the backward). conveyor's traced ``reduce 0``, that wait, is shown too.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import two_ranks, write_section

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
        alone = conveyor.Pipeline(
            copy.deepcopy(model), group=dist.new_group([rank]), num_microbatches=1,
            loss_fn=gpt_loss, trace=True,
        )  # fmt: skip
        ddp = DistributedDataParallel(copy.deepcopy(model))
        x, y = text_batches(8, 64, 1)[0]
        x, y = x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]
        flat = torch.zeros(sum(p.numel() for p in model.parameters()))
        samples: dict[str, list[float]] = {
            "step": [], "reduce": [], "alone": [], "sync": [], "nosync": [], "raw": [],
        }  # fmt: skip
        for index in range(args.steps + 2):  # the first two warm up
            # the four kinds of step take turns, so a busy spell of the machine hits all alike
            dist.barrier()
            step, reduce = _conveyor_step(pipe, x, y)
            dist.barrier()
            times = {"step": step, "reduce": reduce, "alone": _conveyor_step(alone, x, y)[0]}
            for sync in (True, False):
                dist.barrier()
                times["sync" if sync else "nosync"] = _ddp_step(ddp, x, y, sync)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)  # the floor: the same bytes in one all-reduce, nothing else
            times["raw"] = time.perf_counter() - start
            if index >= 2:
                for key, value in times.items():
                    samples[key].append(value)
        if rank == 0:
            torch.save(samples, out)
        # the last collective's worker thread must let go of its tensor (which takes the GIL)
        # before a group's last owner frees it: a group is freed holding the GIL and joins
        # its threads, so freeing DDP right after a collective can hang (torch 2.13, gloo)
        dist.barrier()
        del pipe, alone, ddp
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()
    samples: dict[str, Any] = two_ranks(worker, args)
    median = {k: statistics.median(v) for k, v in samples.items()}
    added = median["step"] - median["alone"]
    ddp_added = median["sync"] - median["nosync"]

    def row(name: str, mine: float, theirs: float) -> str:
        return f"| {name} | {mine * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | {mine / theirs:.2f} |"

    rows = [
        "| | conveyor | torch DDP | conveyor / DDP |",
        "|---|---|---|---|",
        row("step with gradient sync (dp=2; DDP)", median["step"], median["sync"]),
        row("step without (dp=1; DDP no_sync)", median["alone"], median["nosync"]),
        row("what data parallelism adds to the step", added, ddp_added),
        f"| conveyor's wait for it at the step's end (traced `reduce 0`) | "
        f"{median['reduce'] * 1e3:.1f} ms | | |",
        f"| one gloo all_reduce of the same bytes (the floor) | {median['raw'] * 1e3:.1f} ms | | |",
    ]
    reading = (
        "Reading: a replicated stage under a schedule without a split backward is reduced by "
        "DDP's own reducer (Note [reductions in flight]), armed just before the stage's last "
        "backward: it all-reduces 25 MiB buckets (the first 1 MiB) while the backward still "
        "fills them, with the gradients views of its buckets, so nothing is copied back, and "
        "the step waits for them only at its end (the traced `reduce 0`); DDP waits at the "
        "end of the backward. With one stage, as here, there is nothing after the backward "
        "to hide the rest behind, so what is left between the two is DDP copying each "
        "reduced bucket back into the gradients (by default, as run here), which conveyor "
        "does not; with several stages, conveyor's wait also moves behind the input "
        "gradients sent on and the other stages' work. On this machine the all-reduce "
        "competes with the backward for the two cores (each process has a compute thread "
        "and gloo's), "
        "which is why it costs more than the floor. The one other collective of the step, "
        "adding up the replicas' loss counts (so that the gradients are the global batch's "
        "mean), runs while the first forward does, and only on the last stage's replicas. "
        "Before this, conveyor reduced replicated "
        "stages with FSDP2's replicate after the backward, in line: 1.34-1.49x DDP's cost, "
        "from FSDP2 copying the gradients three times around its all-reduce."
    )
    markdown = "\n".join(
        [
            "## Data-parallel gradient reduction: conveyor vs torch DDP",
            "",
            f"Command: `python benchmarks/bench_reduce.py` "
            f"({(time.perf_counter() - started) / 60:.1f} min; {platform.machine()}, "
            f"{os.cpu_count()} CPU cores, 2 gloo processes, 1 thread each). "
            f"{len(samples['step'])} steps of each, taking turns step by step; medians. Same "
            "model, same halves of the batch, same 13 MiB of gradients. Load average of the "
            f"(shared) machine during the run: {load[0]:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end.",
            "",
            *rows,
            "",
            reading,
        ]
    )
    if not args.no_write:
        write_section("reduce", markdown)
    print(markdown)


if __name__ == "__main__":
    main()
