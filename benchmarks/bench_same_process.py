"""SAME PROCESSES: every schedule, conveyor and torch.distributed.pipelining in one pair of
processes, with activation memory. For speed, out of the box, see bench_schedules.py.

    python benchmarks/bench_same_process.py               # GPT, 8 blocks, d 256, m 8, 2 ranks
    python benchmarks/bench_same_process.py --repeats 2 --steps 2 --no-write   # a quick look

This is not how a user runs either system: both share the processes, so conveyor's process-wide
host-memory setting (``keep_host_memory``) applies to torch's pipelines too and the step times
compare the runtimes, not the systems out of the box. What it measures well is memory. Two gloo
processes (one thread each) build every pipeline once, then time them in alternating blocks of
steps, so machine noise hits all alike; medians are reported. One more, untimed step per
pipeline measures peak activation memory per rank: the bytes of tensors autograd saved for
backward and had not released yet (conveyor.runtime.memory.LiveSavedTensors, the same instrument for
both), and conveyor's (stage, micro-batch) sets against the schedule's theory. Results go to the
`schedules-same-process` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_section

import conveyor
from conveyor.graph import place
from conveyor.models import gpt, gpt_loss, text_batches
from conveyor.runtime.memory import LiveSavedTensors, alive_peak
from conveyor.schedule import spec_of

RANKS = 2


@dataclass(frozen=True)
class Case:
    """One schedule and its counterpart in torch.distributed.pipelining, if it has one."""

    name: str
    peer: type | None
    peer_name: str


CASES = [
    Case("gpipe", ScheduleGPipe, "ScheduleGPipe"),
    Case("1f1b", Schedule1F1B, "Schedule1F1B"),
    Case("interleaved-1f1b", ScheduleInterleaved1F1B, "ScheduleInterleaved1F1B"),
    # with one stage per rank, torch's interleaved zero bubble schedule is ZB-H1
    Case("zb-h1", ScheduleInterleavedZeroBubble, "ScheduleInterleavedZeroBubble"),
    Case("zb-v", ScheduleZBVZeroBubble, "ScheduleZBVZeroBubble"),
]


def model(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return gpt(seq_len=args.seq_len, dim=args.dim, num_layers=args.layers, num_heads=8, dropout=0.0)


def balance(num_layers: int, num_stages: int) -> list[int]:
    """Blocks spread evenly; the embedding joins the first stage, the head the last."""
    blocks = [
        num_layers // num_stages + (1 if i < num_layers % num_stages else 0)
        for i in range(num_stages)
    ]
    blocks[0] += 1
    blocks[-1] += 1
    return blocks


def timed(step: Callable[[], None], zero: Callable[[], None], steps: int) -> list[float]:
    """Seconds per step (the slowest rank's), after one warm-up step."""
    step()
    zero()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
        zero()
    return times


class Runs:
    """The pipelines of one rank, by label, with what the report needs about each."""

    def __init__(self) -> None:
        self.steps: dict[str, Callable[[], None]] = {}
        self.zero: dict[str, Callable[[], None]] = {}
        self.memory: dict[str, Callable[[], dict[str, float]]] = {}


def add_conveyor(
    runs: Runs, case: Case, args: argparse.Namespace, rank: int, x: torch.Tensor, y: torch.Tensor
) -> None:
    stages = spec_of(case.name).virtual_stages * RANKS
    pipe, metered = (
        conveyor.Pipeline(
            model(args),
            balance=balance(args.layers, stages),
            schedule=case.name,
            num_microbatches=args.microbatches,
            loss_fn=gpt_loss,
            timeout_s=300,
            measure_memory=measured,
        )
        for measured in (False, True)
    )
    optimizerless = list(pipe.parameters())

    def step() -> None:
        pipe.step(x, y)

    def memory() -> dict[str, float]:
        metered.reset_memory()
        metered.step(x, y)
        report = metered.memory()
        return {
            "saved": report.peak_saved_bytes,
            "sets": report.peak_microbatches,
            "theory": alive_peak(pipe.program[rank]),
        }

    runs.steps[f"conveyor {case.name}"] = step
    runs.zero[f"conveyor {case.name}"] = lambda: [setattr(p, "grad", None) for p in optimizerless]
    runs.memory[f"conveyor {case.name}"] = memory


def add_peer(
    runs: Runs, case: Case, args: argparse.Namespace, rank: int, x: torch.Tensor, y: torch.Tensor
) -> None:
    assert case.peer is not None
    layout = spec_of(case.name)
    num_stages = layout.virtual_stages * RANKS
    ranks = place(num_stages, RANKS, layout.placement)
    layers = list(model(args).children())
    bounds = [0]
    for count in balance(args.layers, num_stages):
        bounds.append(bounds[-1] + count)
    local = [s for s in range(num_stages) if ranks[s] == rank]
    modules = {s: nn.Sequential(*layers[bounds[s] : bounds[s + 1]]) for s in local}
    stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in local]
    schedule = case.peer(
        stages if layout.virtual_stages > 1 or case.name == "zb-h1" else stages[0],
        args.microbatches,
        loss_fn=gpt_loss,
    )
    first, last = 0 in local, num_stages - 1 in local
    parameters = [p for m in modules.values() for p in m.parameters()]

    def step() -> None:
        inputs = (x,) if first else ()
        if last:
            schedule.step(*inputs, target=y, losses=[], return_outputs=False)
        else:
            schedule.step(*inputs, return_outputs=False)

    def memory() -> dict[str, float]:
        live = LiveSavedTensors(parameters)
        with live.watching():
            step()
        for p in parameters:
            p.grad = None
        return {"saved": live.peak_bytes}

    runs.steps[f"torch {case.name}"] = step
    runs.zero[f"torch {case.name}"] = lambda: [setattr(p, "grad", None) for p in parameters]
    runs.memory[f"torch {case.name}"] = memory


def worker(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=RANKS,
        timeout=timedelta(seconds=600),
    )
    x, y = text_batches(args.batch, args.seq_len, 1)[0]
    runs = Runs()
    for case in CASES:
        if case.name in args.schedules:
            add_conveyor(runs, case, args, rank, x, y)
            if case.peer is not None:
                add_peer(runs, case, args, rank, x, y)
    times: dict[str, list[float]] = {label: [] for label in runs.steps}
    for _ in range(args.repeats):
        for label, step in runs.steps.items():
            times[label] += timed(step, runs.zero[label], args.steps)
    memory = {label: measure() for label, measure in runs.memory.items()}
    gathered: list[Any] = [None] * RANKS
    dist.all_gather_object(gathered, memory)
    if rank == 0:
        torch.save({"times": times, "memory": gathered}, out)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", default="8,4", help="micro-batch counts, one table each")
    parser.add_argument("--schedules", default=",".join(c.name for c in CASES))
    parser.add_argument("--repeats", type=int, default=5, help="alternating blocks of steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    parser.add_argument("--no-write", action="store_true", help="print, leave the docs alone")
    args = parser.parse_args()
    args.schedules = args.schedules.split(",")
    counts = [int(m) for m in args.microbatches.split(",")]
    tables = []
    for count in counts:
        args.microbatches = count
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "results.pt")
            mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=RANKS)
            results = torch.load(out)
        tables.append(table(args, results))
        print(tables[-1], flush=True)
    markdown = "\n\n".join([header(args, counts), *tables])
    if not args.no_write:
        write_section("schedules-same-process", markdown)


def header(args: argparse.Namespace, counts: list[int]) -> str:
    b = args.batch
    lines = [
        "## Same processes (not out of the box): schedules, step time and activation memory",
        "",
        f"GPT with {args.layers} blocks (d_model {args.dim}, 8 heads, sequence {args.seq_len}, "
        f"vocabulary 96, no dropout, untied embeddings), batch {b} in "
        f"{' or '.join(map(str, counts))} micro-batches, "
        f"{RANKS} ranks (gloo, 1 thread each). Two stages ({balance(args.layers, 2)} layers) "
        f"for one stage per rank; four ({balance(args.layers, 4)}) for interleaved-1f1b "
        "(loop placement) and zb-v (V placement). Step time: median over "
        f"{args.repeats} alternating blocks of {args.steps} steps, the slowest rank's. "
        "Peak saved: most bytes of tensors autograd had saved for backward and not yet "
        "released, per rank, measured the same way for both (conveyor.runtime.memory."
        "LiveSavedTensors). Sets: conveyor's measured peak of (stage, micro-batch) activation "
        "sets alive, against the schedule's theory (conveyor.runtime.memory.alive_peak of its "
        "program).",
        "",
        f"Command: `python benchmarks/bench_same_process.py` on {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__}; other work may have been "
        "running on the machine. conveyor's Pipeline keeps freed host memory for reuse "
        "(`keep_host_memory`, glibc, process-wide: Note [freed host memory]), so torch's "
        "pipelines, built in the same processes, run with it too.",
    ]
    return "\n".join(lines)


def table(args: argparse.Namespace, results: dict[str, Any]) -> str:
    times, memory = results["times"], results["memory"]
    median = {label: statistics.median(values) for label, values in times.items()}
    lines = [
        f"### {args.microbatches} micro-batches",
        "",
        "| schedule | conveyor step (ms) | torch step (ms) | conveyor / torch time "
        "| conveyor peak saved, rank 0 / 1 (MB) | torch peak saved (MB) "
        "| conveyor sets, rank 0 / 1 (theory) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        if case.name not in args.schedules:
            continue
        ours, theirs = f"conveyor {case.name}", f"torch {case.name}"
        mine = [memory[r][ours] for r in range(RANKS)]
        sets = " / ".join(f"{int(m_['sets'])} ({int(m_['theory'])})" for m_ in mine)
        saved = " / ".join(f"{m_['saved'] / 1e6:.1f}" for m_ in mine)
        if theirs in median:
            peer = " / ".join(f"{memory[r][theirs]['saved'] / 1e6:.1f}" for r in range(RANKS))
            row = (
                f"| {case.name} | {median[ours] * 1e3:.0f} | {median[theirs] * 1e3:.0f} "
                f"({case.peer_name}) | {median[ours] / median[theirs]:.2f} | {saved} | "
                f"{peer} | {sets} |"
            )
        else:
            row = f"| {case.name} | {median[ours] * 1e3:.0f} | - | - | {saved} | - | {sets} |"
        lines.append(row)
    if "conveyor zb-h1" in median and "conveyor 1f1b" in median:
        ratio = median["conveyor zb-h1"] / median["conveyor 1f1b"]
        lines += [
            "",
            f"ZB-H1 / 1F1B step time (conveyor, same 2 stages): {ratio:.3f}; the "
            f"simulator's ideal (F = I = W): "
            f"{(3 * args.microbatches + 1) / (3 * args.microbatches + 3):.3f}.",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
