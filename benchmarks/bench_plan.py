"""Is the planner's choice good? Measured on 2 gloo ranks against a grid of hand
configurations (every schedule x micro-batch counts x an even split), side by side, for three
models; and how long planning a 48-layer model for 64 ranks takes.

    python benchmarks/bench_plan.py          # writes the 'plan' section of docs/benchmarks.md

Both ranks profile each model at once and fit the profile to a traced run, as `conveyor plan`
does; the planner plans with it (memory budget 1 GiB per rank, so memory does not decide),
then the plan and every grid configuration run interleaved, round by round, every step after
a barrier, timed from the first rank's start to the last rank's end; medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import MODELS, Model, join_two_ranks, spawn_two_ranks, step_times
from report import write_section

from conveyor import Pipeline
from conveyor.models.unbalanced import MLPBlock, mse, regression_batch
from conveyor.planner import Workload, fit_to_run, plan, profile_together, trace_units
from conveyor.schedule import SCHEDULES, spec_of

BUDGET = 1 << 30
GRID = (2, 4, 8, 16)


def _worker(rank: int, store: str, out: str, rounds: int, steps: int) -> None:
    overheads, link = join_two_ranks(rank, store)
    try:
        results = [_compare(model, rank, rounds, steps, overheads, link) for model in MODELS]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def _compare(
    model: Model, rank: int, rounds: int, steps: int, overheads: Any, link: Any
) -> dict[str, Any]:
    workload = model.workload()
    sizes = sorted({model.batch_size // m for m in GRID})
    profile = profile_together(workload, sizes)
    profile.overheads, profile.link = overheads, link
    # as conveyor plan does: fit the profile to a traced run (the default schedule)
    torch.manual_seed(0)
    profile = fit_to_run(model.workload(), profile, model.batch_size, GRID)
    report = plan(workload, 2, BUDGET, model.batch_size, profile=profile, microbatches=GRID)
    chosen = report.pipeline_config()
    configs: list[tuple[str, dict[str, Any]]] = [("plan", chosen)]
    for name in SCHEDULES:
        for m in GRID:
            configs.append((f"{name} m={m}", _even(model, workload.model, name, m)))
    pipes = []
    for label, fields in configs:
        try:
            torch.manual_seed(0)
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
            pipes.append(
                (
                    label,
                    fields,
                    Pipeline(model.workload().model, loss_fn=workload.loss_fn, **options),
                )
            )
        except ValueError as error:  # a schedule that cannot run this model's even split
            if rank == 0:
                print(f"skip {model.name} {label}: {str(error).splitlines()[0]}", flush=True)
    inputs, targets = workload.batch(model.batch_size)
    times = step_times([pipe for *_, pipe in pipes], inputs, targets, rounds, steps)
    measured = {label: statistics.median(t) for (label, _, _), t in zip(pipes, times, strict=True)}
    if rank == 0:
        print(model.name, json.dumps(measured), flush=True)
    best = report.best
    return {
        "model": model.name,
        "plan": chosen,
        "predicted_s": best.step_time,
        "plan_units": [len(u) for u in best.stage_units],
        "measured": measured,
        "top": [
            (p.schedule, p.num_microbatches, [len(u) for u in p.stage_units], p.step_time)
            for p in report.plans[:4]
        ],
        "fields": {label: fields for label, fields, _ in pipes},
        "planning_s": report.elapsed_s,
    }


def _even(model: Model, module: nn.Module, schedule: str, m: int) -> dict[str, Any]:
    """The Pipeline's own default for ``schedule``: an even split in its layout."""
    fields: dict[str, Any] = {"schedule": schedule, "num_microbatches": m}
    if not isinstance(module, nn.Sequential):  # cut before the middle layer
        targets = [u.target for u in trace_units(module)[2] if u.target]
        num_stages = 2 * spec_of(schedule).virtual_stages
        fields["split_points"] = [
            targets[round(i * len(targets) / num_stages)] for i in range(1, num_stages)
        ]
    return fields


def _planning_speed() -> tuple[float, float, str]:
    """Seconds to profile and to plan a 48-layer model (residual MLP blocks) for 64 ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(*(MLPBlock(64, 256) for _ in range(48)))
    workload = Workload("mlp-48", model, lambda n: regression_batch(n, 64), mse)
    began = time.perf_counter()
    report = plan(workload, 64, BUDGET, 256)
    total = time.perf_counter() - began
    best = report.best
    return (
        total,
        report.elapsed_s,
        (
            f"{best.schedule}, {best.num_microbatches} micro-batches,"
            f" {len(report.plans)} plans simulated, {report.pruned} "
            "pruned by their bound"
        ),
    )


def _markdown(
    results: list[dict[str, Any]],
    speed: tuple[float, float, str],
    command: str,
    minutes: float,
    load: tuple[float, float],
) -> str:
    lines = [
        "## Plan quality (planner vs hand configurations, measured)",
        "",
        f"Command: `{command}` ({minutes:.1f} min). Machine: 2 CPU cores, 2 ranks on gloo, one "
        f"torch thread each; load average {load[0]:.2f} before, {load[1]:.2f} after (other "
        "work may have been running). The planner's profile is made on both ranks and fitted "
        "to a traced run, as `conveyor plan` does. The grid is every schedule x micro-batch "
        "counts "
        f"{list(GRID)} x the Pipeline's even split; everything runs interleaved in one session "
        "(medians of barrier-synchronised steps).",
        "",
        "| model | planner's choice | predicted ms | measured ms | best hand configuration "
        "| its measured ms | plan vs best hand | even split, same schedule and m |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        measured = dict(r["measured"])
        plan_ms = measured.pop("plan")
        best_label = min(measured, key=measured.__getitem__)
        fields = r["plan"]
        same = f"{fields['schedule']} m={fields['num_microbatches']}"
        split = fields.get("balance") or fields.get("split_points") or "even"
        ckpt = fields.get("stage_recompute", "never")
        same_ms = f"{measured[same] * 1e3:.1f}" if same in measured else "-"
        lines.append(
            f"| {r['model']} | {fields['schedule']}, m={fields['num_microbatches']}, split "
            f"{split}, units {r['plan_units']}, checkpoint {ckpt} | "
            f"{r['predicted_s'] * 1e3:.1f} | {plan_ms * 1e3:.1f} | {best_label} | "
            f"{measured[best_label] * 1e3:.1f} | {plan_ms / measured[best_label] - 1:+.1%} | "
            f"{same_ms} |"
        )
    lines += [
        "",
        "The planner's top plans, predicted ms (ties within the model's error are "
        "decided by its small differences):",
        "",
    ]
    lines += [
        f"- {r['model']}: "
        + "; ".join(
            f"{name} m={m} units {units}: {seconds * 1e3:.1f}"
            for name, m, units, seconds in r["top"]
        )
        for r in results
    ]
    lines += [
        "",
        "Every hand configuration, measured ms:",
        "",
        "| model | " + " | ".join(f"m={m}" for m in GRID) + " |",
        "|---|" + "---|" * len(GRID),
    ]
    for r in results:
        for name in SCHEDULES:
            cells = [r["measured"].get(f"{name} m={m}") for m in GRID]
            if any(c is not None for c in cells):
                lines.append(
                    f"| {r['model']} {name} | "
                    + " | ".join("-" if c is None else f"{c * 1e3:.1f}" for c in cells)
                    + " |"
                )
    total, search, what = speed
    lines += [
        "",
        f"Planning a 48-layer model (residual MLP blocks of width 64, traced into "
        f"240 layers: the model has fewer blocks than ranks) for 64 ranks, batch 256: "
        f"{total:.1f} s in all, of which {search:.1f} s search after profiling "
        f"({what}; search time budget 50 s).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per round (default 3)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()[0]
    results, _ = spawn_two_ranks(_worker, args.rounds, args.steps)
    speed = _planning_speed()
    command = (
        "python benchmarks/bench_plan.py"
        + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
        + (f" --steps {args.steps}" if args.steps != 3 else "")
    )
    markdown = _markdown(
        results, speed, command, (time.perf_counter() - started) / 60, (load, os.getloadavg()[0])
    )
    print(markdown)
    if not args.no_write:
        write_section("plan", markdown)


if __name__ == "__main__":
    main()
