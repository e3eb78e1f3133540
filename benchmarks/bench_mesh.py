"""Data parallel x pipeline at scale, on paper: a 128-block GPT on 8 to 1024 ranks as dp x pp.

    python benchmarks/bench_mesh.py        # 'mesh' section of docs/benchmarks.md

Block, embedding, head and loss costs are measured here (bench_scale.py: a GPT block of width
256 over micro-batches of 4 sequences of 64 tokens, one thread), repeated 128 times. The
all-reduce link is fitted to all-reduces timed on two local gloo ranks
(conveyor.planner.measure_allreduce), and the ring model built on it
(conveyor.planner.Replicas) is first checked against all-reduces timed on their own. Each
layout is then simulated with 1F1B, an even split and its gradient reductions from each
stage's last backward on, behind the rest of the step (DDP's reducer, as the runtime runs
them; Note [reductions in flight]); the global batch is 16 sequences per rank (each replica gets
4 x pp micro-batches), as a weak-scaling run keeps the work per rank fixed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import MICROBATCH, _balance, measured_gpt, scaled_gpt
from report import write_section

from conveyor.graph import place
from conveyor.planner import Link, Profile, ProfileCost, Replicas, layout, predict, split_units
from conveyor.planner.calibrate import measure_allreduce, measure_link
from conveyor.schedule import SCHEDULES

WORLDS = (8, 32, 128, 512, 1024)
PIPELINES = (1, 2, 4, 8, 16, 32, 64)
SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)
FAST = Link(10e-6, 25e9)
"""An assumed interconnect of GPU clusters (about a 200 Gb/s InfiniBand NIC), not measured."""


BUDGET = 2**30
"""A memory budget per rank to show which layouts fit (as on a small accelerator)."""


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        measured = {"link": measure_link(), "reduce_link": measure_allreduce(), "timed": []}
        for size in SIZES:
            buffer = torch.ones(size // 4)
            samples = []
            for _ in range(12):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(buffer)
                samples.append(time.perf_counter() - start)
            measured["timed"].append((size, statistics.median(samples[2:])))
        if rank == 0:
            torch.save(measured, out)
    finally:
        dist.destroy_process_group()


def measure() -> dict[str, Any]:
    """Two local ranks: the point-to-point link, the all-reduce link fitted to timed
    all-reduces, and all-reduces of SIZES bytes timed on their own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "measured.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), out), nprocs=2)
        return dict(torch.load(out, weights_only=False))


@dataclass(frozen=True)
class Cell:
    """One simulated dp x pp layout."""

    dp: int
    pp: int
    rate: float
    """Sequences per second of the whole job."""
    idle: float
    """Share of rank-time not computing: the bubble and the reductions."""
    reduce: float
    """Share of the step the busiest rank spends reducing gradients."""
    memory: float
    """Bytes the fullest rank holds: parameters, gradients, optimizer state, activations."""

    def __str__(self) -> str:
        return f"{self.rate:,.0f} ({self.idle:.0%}, {self.reduce:.0%}, {self.memory / 2**30:.1f})"


def simulate(profile: Profile, world: int, pp: int, link: Link) -> Cell:
    """1F1B on ``pp`` ranks, ``world / pp`` replicas, 16 sequences per rank per step."""
    dp, m = world // pp, 4 * pp
    graph, units = layout(
        profile, split_units(profile.num_units, _balance(profile, pp)), place(pp, pp, "loop")
    )
    cost = ProfileCost(profile, graph, units, MICROBATCH, m, "never", Replicas(dp, link))
    prediction = predict(SCHEDULES["1f1b"](graph, m), graph, cost, record=False)
    step = prediction.step_time
    reduce = max(map(cost.reduce, range(pp))) / step
    return Cell(dp, pp, 16 * world / step, prediction.bubble_fraction, reduce,
                max(prediction.total_memory))  # fmt: skip


def grid(profile: Profile, link: Link) -> tuple[list[str], dict[int, list[Cell]]]:
    """Markdown rows and cells of every dp x pp layout of every world size."""
    rows = [
        "| ranks | " + " | ".join(f"pp={p}" for p in PIPELINES) + " | fastest | fastest in 1 GiB |",
        "|---|" + "---|" * (len(PIPELINES) + 2),
    ]
    cells: dict[int, list[Cell]] = {}
    for world in WORLDS:
        cells[world] = [simulate(profile, world, pp, link) for pp in PIPELINES if pp <= world]
        shown = [str(c) for c in cells[world]] + [""] * (len(PIPELINES) - len(cells[world]))
        best, fitting = _best(cells[world])
        rows.append(f"| {world} | " + " | ".join(shown) + f" | {best} | {fitting} |")
        print(rows[-1], flush=True)
    return rows, cells


def _fastest(cells: list[Cell], budget: float = float("inf")) -> Cell | None:
    fitting = [c for c in cells if c.memory <= budget]
    return max(fitting, key=lambda c: c.rate) if fitting else None


def _best(cells: list[Cell]) -> tuple[str, str]:
    names = [
        "none" if c is None else f"dp={c.dp} x pp={c.pp}"
        for c in (_fastest(cells), _fastest(cells, BUDGET))
    ]
    return names[0], names[1]


def _pipelines(cells: dict[int, list[Cell]], budget: float = float("inf")) -> str:
    """'pp=1 at every size', or the pipeline length chosen at each size."""
    chosen = {world: _fastest(row, budget) for world, row in cells.items()}
    lengths = {c.pp for c in chosen.values() if c is not None}
    if len(lengths) == 1 and None not in chosen.values():
        return f"pp={lengths.pop()} at every size"
    return ", ".join(f"pp={c.pp if c else '-'} at {w}" for w, c in chosen.items())


def findings(cells: dict[int, list[Cell]]) -> str:
    """What the measured-link grid shows, in words computed from it."""
    top = cells[WORLDS[-1]]
    pure, longest = top[0], top[-1]
    return (
        f"On the measured link the fastest layout is {_pipelines(cells)} (the rest data "
        f"parallel): at {WORLDS[-1]} ranks pure data parallelism loses {pure.reduce:.0%} of "
        f"its step to the all-reduce of the whole model's gradients, against the "
        f"{longest.idle:.0%} a {longest.pp}-stage pipeline leaves idle (its reductions move "
        f"1/{longest.pp} of the bytes: {longest.reduce:.1%} of its step). Within 1 GiB per "
        f"rank, where pure data parallelism does not fit ({pure.memory / 2**30:.1f} GiB per "
        f"rank), the fastest layout is {_pipelines(cells, BUDGET)}: as short a pipeline as "
        "memory allows, and data parallelism for the rest of the ranks."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()
    measured = measure()
    link, reduce_link = measured["link"], measured["reduce_link"]
    checks = [
        "| bytes | all_reduce, measured | ring over the all-reduce fit | ring over the "
        "point-to-point link |",
        "|---|---|---|---|",
    ]
    for size, seconds in measured["timed"]:
        fitted, p2p = (Replicas(2, lk).reduce_time(size) for lk in (reduce_link, link))
        checks.append(
            f"| {size / 2**20:.0f} MiB | {seconds * 1e3:.1f} ms | {fitted * 1e3:.1f} ms "
            f"({fitted / seconds:.2f}x) | {p2p * 1e3:.1f} ms ({p2p / seconds:.2f}x) |"
        )
        print(checks[-1], flush=True)
    scaled = scaled_gpt(measured_gpt())
    grad_bytes = sum(u.trainable_bytes for u in scaled.units)
    slow, cells = grid(scaled, reduce_link)
    fast, fast_cells = grid(scaled, FAST)
    markdown = "\n".join(
        [
            "## Data parallel x pipeline at scale, on paper",
            "",
            f"Command: `python benchmarks/bench_mesh.py` "
            f"({(time.perf_counter() - started) / 60:.1f} min; two gloo processes measure the "
            "links, the rest is simulation; load average of the shared machine "
            f"{load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end). The model: "
            "bench_scale's GPT block (width 256, costs measured here, one thread) repeated "
            "128 times, "
            f"{grad_bytes / 2**20:.0f} MiB of gradients (AdamW: 4 x that in parameters, "
            "gradients and moments). The all-reduce link, fitted to all-reduces timed on two "
            f"local gloo ranks (conveyor.planner.measure_allreduce): latency "
            f"{reduce_link.latency * 1e6:.0f} us, {reduce_link.bandwidth / 1e9:.2f} GB/s. The "
            "ring model on it (2(d-1) steps of 1/d of the bytes each; "
            "conveyor.planner.Replicas) against all-reduces timed on their own, and the same "
            "ring over the point-to-point link (ping-pong: latency "
            f"{link.latency * 1e6:.0f} us, {link.bandwidth / 1e9:.2f} GB/s, calls "
            f"{(link.send_per_byte + link.recv_per_byte) * 1e9:.2f} ns/byte), which "
            "`conveyor plan --world-size` uses only without a measured all-reduce:",
            "",
            *checks,
            "",
            "Predicted throughput (sequences/s) of every dp x pp layout, 1F1B, even split, "
            "global batch 16 sequences per rank (4 x pp micro-batches of 4 per replica); in "
            "brackets the share of rank-time not computing (bubble and the reductions' waits), "
            "the share of the step the busiest rank's reductions take (behind the rest of the "
            "step, from each stage's last backward on), and the memory of "
            "the fullest rank in GiB. On the all-reduce link measured here:",
            "",
            *slow,
            "",
            findings(cells),
            "",
            f"With an assumed GPU-cluster interconnect ({FAST.latency * 1e6:.0f} us, "
            f"{FAST.bandwidth / 1e9:.0f} GB/s; not measured), where the reductions all but "
            f"vanish (pp=1 at {WORLDS[-1]} ranks: {fast_cells[WORLDS[-1]][0].reduce:.1%}):",
            "",
            *fast,
            "",
            "At a fixed number of ranks and batch per rank, a longer pipeline costs throughput "
            "(its bubble, (p-1)/(m+p-1) of the step, grows with p), so pipeline parallelism "
            "is used as far as memory needs and data parallelism scales out.",
        ]
    )
    if not args.no_write:
        write_section("mesh", markdown)
    print(markdown)


if __name__ == "__main__":
    main()
