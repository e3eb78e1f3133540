"""What the batch check costs: training steps with and without it, side by side.

    python benchmarks/bench_fingerprint.py             # writes the 'fingerprint' section of docs
    python benchmarks/bench_fingerprint.py --rounds 3  # quicker, noisier

Every step starts with each rank sending a fingerprint of its batch to every other rank and
comparing (Note [batch fingerprint] in conveyor/runtime/fingerprint.py). Each model of the
accuracy benchmark (1F1B, 4 and 8 micro-batches, even split on 2 ranks) runs twice in the same
two processes, with the check and with the exchange left out, the two pipelines taking turns
round by round; a round is several steps back to back, as training runs them (no barrier
between steps), timed from the first rank's start to the last rank's end; medians. The
fingerprint alone is also timed in one process on batches of growing size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_accuracy import MODELS, _pipeline
from report import write_section

from conveyor.planner import trace_units
from conveyor.runtime.fingerprint import fingerprint

MICROBATCHES = (4, 8)


def _worker(rank: int, store: str, out: str, rounds: int, steps: int) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        rows = []
        for model in MODELS:
            workload = model.workload()
            units, placement = model.layouts("1f1b", len(trace_units(workload.model)[2]))[0]
            inputs, targets = workload.batch(model.batch_size)
            for m in MICROBATCHES:
                checked = _pipeline(model, workload, "1f1b", units, placement, m)
                unchecked = _without_check(_pipeline(model, workload, "1f1b", units, placement, m))
                times = _round_times([checked, unchecked], inputs, targets, rounds, steps)
                rows.append(
                    {
                        "model": model.name,
                        "microbatches": m,
                        "checked_s": statistics.median(times[0]) / steps,
                        "unchecked_s": statistics.median(times[1]) / steps,
                    }
                )
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _without_check(pipe: Any) -> Any:
    """``pipe`` with its steps' fingerprints neither computed nor exchanged."""
    inputs = pipe._inputs
    pipe._inputs = lambda *args: dataclasses.replace(inputs(*args), fingerprint=None)
    return pipe


def _round_times(
    pipes: list[Any], inputs: Any, targets: Any, rounds: int, steps: int
) -> list[list[float]]:
    """Seconds of ``steps`` back-to-back steps per round, each pipeline in turn. Collective."""
    times: list[list[float]] = [[] for _ in pipes]
    for round_index in range(rounds + 1):  # round 0 warms up
        for index, pipe in enumerate(pipes):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                pipe.step(inputs, targets)
            spans: list[Any] = [None, None]
            dist.all_gather_object(spans, (start, time.perf_counter()))
            if round_index:
                times[index].append(max(e for _, e in spans) - min(s for s, _ in spans))
    return times


def _fingerprint_alone() -> list[tuple[str, float]]:
    """Seconds to fingerprint one batch (inputs and targets), median of repeats."""
    torch.set_num_threads(1)
    batches = {
        "GPT tokens 32 x 64 int64": torch.randint(0, 96, (32, 64)),
        "images 32 x 3 x 64 x 64 float32": torch.randn(32, 3, 64, 64),
        "images 32 x 3 x 224 x 224 float32": torch.randn(32, 3, 224, 224),
    }
    found = []
    for name, batch in batches.items():
        targets = torch.randint(0, 10, (32,))
        samples = []
        for _ in range(20):
            start = time.perf_counter()
            fingerprint({"x": batch}, targets, True, torch.device("cpu"), 32)
            samples.append(time.perf_counter() - start)
        found.append((name, statistics.median(samples)))
    return found


def _markdown(
    rows: list[dict[str, Any]], alone: list[tuple[str, float]], command: str, seconds: float
) -> str:
    ratios = [r["checked_s"] / r["unchecked_s"] for r in rows]
    lines = [
        "## Batch check: every rank compares a fingerprint of its batch before a step",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min) on 2 CPU cores, 2 ranks on gloo, one "
        "torch thread each; other work may have been running. Each model of the accuracy "
        "benchmark (1F1B, even split) runs with the batch check (Note [batch fingerprint]) "
        "and with the exchange left out, the two pipelines taking turns in the same "
        "processes; each round runs its steps back to back, as training does; median step "
        "time.",
        "",
        f"**Step time with the check / without: median {statistics.median(ratios):.3f}, from "
        f"{min(ratios):.3f} to {max(ratios):.3f}.**",
        "",
        "| model | micro-batches | with check ms | without ms | ratio |",
        "|---|---|---|---|---|",
    ]
    for r, ratio in zip(rows, ratios, strict=True):
        lines.append(
            f"| {r['model']} | {r['microbatches']} | {r['checked_s'] * 1e3:.2f} "
            f"| {r['unchecked_s'] * 1e3:.2f} | {ratio:.3f} |"
        )
    lines += ["", "The fingerprint alone (one process, inputs and targets):", ""]
    lines += [f"- {name}: {s * 1e3:.3f} ms" for name, s in alone]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--steps", type=int, default=5, help="steps per round (default 5)")
    parser.add_argument("--no-write", action="store_true", help="print, don't update docs")
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory, "results.json")
        mp.spawn(
            _worker,
            args=(str(Path(directory, "store")), str(out), args.rounds, args.steps),
            nprocs=2,
            join=True,
        )
        rows = json.loads(out.read_text())
    alone = _fingerprint_alone()
    command = (
        "python benchmarks/bench_fingerprint.py"
        + (f" --rounds {args.rounds}" if args.rounds != 7 else "")
        + (f" --steps {args.steps}" if args.steps != 5 else "")
    )
    markdown = _markdown(rows, alone, command, time.perf_counter() - started)
    print(markdown)
    if not args.no_write:
        write_section("fingerprint", markdown)


if __name__ == "__main__":
    main()
