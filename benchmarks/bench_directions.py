"""One gloo group both ways, or one per direction? Step time and stalled calls, side by side.

    python benchmarks/bench_directions.py             # writes the 'directions' section of docs
    python benchmarks/bench_directions.py --rounds 3  # quicker, noisier

Every configuration of the accuracy benchmark (three models, every schedule, 4 and 8
micro-batches) runs twice in the same two processes: once with the runtime's transport
(messages to higher ranks in one group, to lower ranks in another: Note [a group per
direction] in conveyor/comm.py), once with both directions in the pipeline's own group, as
before. The two pipelines of each configuration take turns round by round (medians). Stalled
calls: sends and receive postings over 1 ms, per step, from traces of the same steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch.distributed as dist
from bench_accuracy import (
    MICROBATCHES,
    MODELS,
    _pipeline,
    join_two_ranks,
    spawn_two_ranks,
    step_times,
)
from report import write_section

from conveyor.planner import trace_units
from conveyor.schedule import SCHEDULES


def _worker(rank: int, store: str, out: str, rounds: int, steps: int) -> None:
    join_two_ranks(rank, store)
    try:
        rows = []
        for model in MODELS:
            workload = model.workload()
            num_units = len(trace_units(workload.model)[2])
            inputs, targets = workload.batch(model.batch_size)
            for name in SCHEDULES:
                for units, placement in model.layouts(name, num_units):
                    for m in MICROBATCHES:
                        rows.append(
                            _compare(
                                model,
                                workload,
                                name,
                                units,
                                placement,
                                m,
                                inputs,
                                targets,
                                rounds,
                                steps,
                            )
                        )
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _compare(
    model: Any,
    workload: Any,
    name: str,
    units: list[list[int]],
    placement: list[int],
    m: int,
    inputs: Any,
    targets: Any,
    rounds: int,
    steps: int,
) -> dict[str, Any]:
    """Median step times and stalled calls per step of one configuration, both transports."""
    split = _pipeline(model, workload, name, units, placement, m, trace=True)
    with mock.patch("conveyor.runtime.comm._directions", lambda group, timeout: (None, None)):
        shared = _pipeline(model, workload, name, units, placement, m, trace=True)
    times = step_times([split, shared], inputs, targets, rounds, steps)
    stalls = [_stalled(pipe, rounds * steps) for pipe in (split, shared)]
    return {
        "model": model.name,
        "schedule": name,
        "stages": len(units),
        "microbatches": m,
        "split_s": statistics.median(times[0]),
        "shared_s": statistics.median(times[1]),
        "split_stalls": stalls[0],
        "shared_stalls": stalls[1],
    }


def _stalled(pipe: Any, num_steps: int) -> float:
    """Sends and receive postings that took over 1 ms, per step, both ranks."""
    count = sum(
        1
        for step in range(-num_steps, 0)
        for e in pipe.timeline(step).events
        if e.kind in ("send", "recv") and e.duration > 1e-3
    )
    return count / num_steps


def _markdown(rows: list[dict[str, Any]], command: str, seconds: float) -> str:
    ratios = [r["split_s"] / r["shared_s"] for r in rows]
    lines = [
        "## Transport: a gloo group per direction vs one group both ways",
        "",
        f"Command: `{command}` ({seconds / 60:.1f} min) on 2 CPU cores, 2 ranks on gloo, one "
        "torch thread each; other work may have been running. Every configuration of the "
        "accuracy benchmark runs with the runtime's transport (a group per direction, Note [a "
        "group per direction]) and with both directions in one group, the two pipelines "
        "taking turns in the same processes; median step time. Stalled calls: sends and "
        "receive postings over 1 ms per step (both ranks), from traces of the timed steps.",
        "",
        f"**Step time per direction / one group: median {statistics.median(ratios):.3f}, "
        f"from {min(ratios):.3f} to {max(ratios):.3f}; stalled calls per step "
        f"{statistics.mean(r['split_stalls'] for r in rows):.2f} against "
        f"{statistics.mean(r['shared_stalls'] for r in rows):.2f} (mean over "
        f"configurations).**",
        "",
        "| model | schedule | stages | micro-batches | per direction ms | one group ms | ratio "
        "| stalled calls per step, per direction / one group |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, ratio in zip(rows, ratios, strict=True):
        lines.append(
            f"| {r['model']} | {r['schedule']} | {r['stages']} | {r['microbatches']} "
            f"| {r['split_s'] * 1e3:.1f} | {r['shared_s'] * 1e3:.1f} | {ratio:.3f} | "
            f"{r['split_stalls']:.2f} / {r['shared_stalls']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="steps per round (default 4)")
    parser.add_argument("--no-write", action="store_true", help="print, don't update docs")
    args = parser.parse_args()
    started = time.perf_counter()
    rows, _ = spawn_two_ranks(_worker, args.rounds, args.steps)
    command = (
        "python benchmarks/bench_directions.py"
        + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
        + (f" --steps {args.steps}" if args.steps != 4 else "")
    )
    markdown = _markdown(rows, command, time.perf_counter() - started)
    print(markdown)
    if not args.no_write:
        write_section("directions", markdown)


if __name__ == "__main__":
    main()
