"""`conveyor plan`, `conveyor trace` and `conveyor simulate --profile`: argparse -> calls
into the planner, the simulator and the timeline renderers.

    conveyor plan --model gpt --ranks 2 --memory 1GiB --batch-size 32 --out plan.json
    conveyor run --plan plan.json --trace runs/t -n 2 train.py
    conveyor trace runs/t                  # summary, runs/t/timeline.png, runs/t/trace.json
    conveyor trace runs/t --step 3-5 --png steps.png   # three steps; writes steps.png only
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from conveyor.planner import (
    DEFAULT_TIME_BUDGET_S,
    Budget,
    Profile,
    ProfileCost,
    Workload,
    layout,
    load_workload,
    measured_profile,
    plan,
    plan_mesh,
    predict,
    split_units,
    with_reduce_link,
)
from conveyor.planner.budget import MAX_PROFILE_SHARE, PROFILE_SHARE
from conveyor.runtime.recompute import RECOMPUTE_MODES
from conveyor.schedule import build_program, stage_placement
from conveyor.split import even_balance
from conveyor.trace import Timeline, load_run, write_chrome, write_png

__all__: list[str] = []

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read the memory size {text!r}; write a number of bytes with "
            "an optional unit: 2GiB, 512MiB, 1.5GB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (stages, ranks, micro-batches, samples)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def seconds_or_none(text: str) -> float | None:
    """An argparse type: a positive number of seconds, or 'none' (no limit)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds or 'none', got {text!r}"
        )
    return value


def add_tool_commands(commands: Any) -> None:
    """Add the ``plan`` and ``trace`` subcommands to the ``conveyor`` parser."""
    _add_plan_command(commands)
    _add_trace_command(commands)


def _add_plan_command(commands: Any) -> None:
    planner = commands.add_parser(
        "plan",
        help="profile a model and find the fastest pipeline plan that fits",
        description="Profile the model once (and the link between two local ranks), search "
        "split x schedule x micro-batches x recomputation with the simulator, print the top "
        "plans and write the winner for Pipeline(plan=...) / conveyor run --plan.",
    )
    planner.add_argument(
        "--model",
        required=True,
        help="an example name (gpt, unbalanced, ...) or package.module:function "
        "returning a conveyor.planner.Workload",
    )
    planner.add_argument("--ranks", type=positive_int, help="pipeline ranks (or --world-size)")
    planner.add_argument(
        "--memory", type=parse_bytes, required=True, help="memory budget per rank, e.g. 2GiB"
    )
    planner.add_argument("--batch-size", type=positive_int, required=True, help="samples per step")
    planner.add_argument(
        "--schedules",
        nargs="+",
        default=None,
        help="schedules to consider (default: every registered one)",
    )
    planner.add_argument(
        "--microbatches",
        type=positive_int,
        nargs="+",
        default=None,
        help="micro-batch counts to consider (default: divisors of the batch)",
    )
    planner.add_argument(
        "--balance-by",
        nargs="+",
        default=["time", "memory", "both", "even"],
        choices=["time", "memory", "both", "even"],
        help="split objectives to try (default: all)",
    )
    planner.add_argument(
        "--no-recompute",
        "--no-checkpointing",  # the old name, kept for one release
        action="store_true",
        help="never recompute activations",
    )
    planner.add_argument("--profile", type=Path, help="reuse a saved profile instead of measuring")
    planner.add_argument("--save-profile", type=Path, help="write the measured profile here")
    planner.add_argument(
        "--no-link",
        action="store_true",
        help="profile in this process only: do not start two local ranks to "
        "measure runtime overheads and the link and to fit the profile to a "
        "traced run (the prediction then leaves them out)",
    )
    _add_plan_scope_flags(planner)
    planner.add_argument("--out", type=Path, help="write the best plan to this file")
    planner.add_argument("--top", type=positive_int, default=10, help="plans to print (default 10)")
    planner.set_defaults(command=_plan)


def _add_plan_scope_flags(planner: argparse.ArgumentParser) -> None:
    """The flags of ``conveyor plan`` that set what it plans for: a mesh, its time, its input."""
    planner.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="plan a mesh: split this many ranks into data-parallel replicas x pipeline "
        "ranks (--ranks is then ignored), the batch being the global one; the gradient "
        "reductions are simulated over the measured link",
    )
    planner.add_argument(
        "--fsdp", action="store_true", help="with --world-size: shard stages with FSDP"
    )
    planner.add_argument(
        "--time-budget",
        type=seconds_or_none,
        default=DEFAULT_TIME_BUDGET_S,
        metavar="SECONDS",
        help="seconds for planning, measuring included (not the seconds Python takes to "
        "start and import torch before it), or 'none' (default "
        f"{DEFAULT_TIME_BUDGET_S:g}): measuring stops at {PROFILE_SHARE * 100:.0f}-"
        f"{MAX_PROFILE_SHARE * 100:.0f}%% of it (the less, the longer the search looks), the "
        "search at its end, and what was not explored is printed",
    )
    planner.add_argument(
        "--input-ms",
        type=float,
        metavar="MS",
        help="milliseconds the training loader takes per batch (conveyor.planner."
        "loader_seconds measures it): the best plan is checked for waiting on its input",
    )


def _add_trace_command(commands: Any) -> None:
    tracer = commands.add_parser(
        "trace",
        help="render a run recorded with --trace DIR",
        description="Load the per-rank files of a traced run, print each rank's busy, bubble and "
        "communication-wait shares, and write a PNG Gantt chart and a Chrome/Perfetto trace.",
    )
    tracer.add_argument("directory", type=Path, help="the run's trace directory")
    tracer.add_argument(
        "--step",
        type=step_range,
        default=None,
        metavar="N|FIRST-LAST",
        help="step to render, or steps FIRST to LAST on one time axis, counted from 0 as "
        "Pipeline.step_index (default: the last step every rank recorded)",
    )
    tracer.add_argument(
        "--png",
        type=Path,
        help="write the Gantt chart here (default: DIR/timeline.png when neither --png nor "
        "--chrome is given)",
    )
    tracer.add_argument(
        "--chrome",
        type=Path,
        help="write the Chrome/Perfetto trace here (default: DIR/trace.json when neither "
        "--png nor --chrome is given)",
    )
    tracer.add_argument(
        "--compare",
        type=Path,
        help="a predicted timeline (conveyor simulate --save-timeline) to draw "
        "beneath the measured one",
    )
    tracer.set_defaults(command=_trace)


def add_simulate_flags(simulate: argparse.ArgumentParser) -> None:
    """Flags of ``conveyor simulate`` that predict a profiled model instead of unit costs."""
    simulate.add_argument(
        "--profile",
        type=Path,
        help="predict with a saved profile (conveyor plan --save-profile) instead of unit costs",
    )
    simulate.add_argument(
        "--balance",
        type=positive_int,
        nargs="+",
        help="with --profile: units per stage (default: even)",
    )
    simulate.add_argument(
        "--batch-size",
        type=positive_int,
        help="with --profile: samples per step (default: micro-batches x the "
        "profile's smallest micro-batch size)",
    )
    simulate.add_argument(
        "--recompute",
        "--checkpoint",  # the old name, kept for one release
        nargs="+",
        default=["never"],
        choices=RECOMPUTE_MODES,
        help="with --profile: activation recomputation, one mode or one per stage",
    )
    simulate.add_argument("--png", type=Path, help="with --profile: write the Gantt chart")
    simulate.add_argument("--chrome", type=Path, help="with --profile: write a Chrome trace")
    simulate.add_argument(
        "--save-timeline",
        type=Path,
        help="with --profile: write the predicted timeline (for conveyor trace --compare)",
    )


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.ranks and not args.world_size:
        raise ValueError("pass --ranks P (one pipeline) or --world-size N (dp x pp layouts)")
    budget = Budget(args.time_budget)  # one for everything below: See Note [planning budget]
    workload = load_workload(args.model)
    profile = Profile.load(args.profile) if args.profile else None
    if profile is None and not args.no_link:
        profile = measured_profile(
            workload,
            args.world_size or args.ranks,
            args.batch_size,
            args.microbatches,
            args.schedules,
            spec=args.model,
            time_budget_s=budget,
        )
    elif profile is not None and args.world_size and not args.no_link:
        profile = with_reduce_link(profile, budget)  # a saved profile may have none
    if args.world_size:
        return _plan_mesh(args, workload, profile, budget)
    report = plan(
        workload,
        args.ranks,
        args.memory,
        args.batch_size,
        profile=profile,
        schedules=args.schedules,
        microbatches=args.microbatches,
        objectives=args.balance_by,
        recompute=not args.no_recompute,
        time_budget_s=budget,
        input_s=None if args.input_ms is None else args.input_ms / 1e3,
    )
    if args.save_profile:
        report.profile.save(args.save_profile)
    print(
        f"{report.profile.model} on {args.ranks} ranks, batch {args.batch_size}, budget "
        f"{args.memory / 2**30:.2f} GiB per rank: {len(report.plans)} plans simulated in "
        f"{report.elapsed_s:.1f} s"
    )
    print(report.table(args.top))
    for note in report.notes:
        print(f"skipped {note}")
    if report.coverage is not None and report.unexplored:
        print("not explored: " + report.coverage.describe(separator="\n  "))
    best = report.best  # raises ValueError (exit 2) with the smallest memory any plan needs
    print(
        f"best: {best.schedule}, {best.num_microbatches} micro-batches, stages of "
        f"{list(best.balance)} units, recomputing {list(best.recompute)}: "
        f"{best.step_time * 1e3:.2f} ms/step, {best.samples_per_s:.1f} samples/s"
    )
    if report.input_bound():
        print(report.input_bound())
    if args.out:
        report.write(args.out)
        print(
            f"wrote {args.out}: use Pipeline(model, plan={str(args.out)!r}) or "
            f"conveyor run --plan {args.out} -n {args.ranks} train.py"
        )
    return 0


def step_range(text: str) -> tuple[int, int]:
    """An argparse type: 'N' -> (N, N); 'FIRST-LAST' -> (FIRST, LAST), FIRST <= LAST."""
    first, _, last = text.partition("-")
    try:
        steps = (int(first), int(last or first))
    except ValueError:
        steps = (-1, -1)
    if min(steps) < 0 or steps[0] > steps[1]:
        raise argparse.ArgumentTypeError(
            f"expected a step N or a range FIRST-LAST (FIRST <= LAST), got {text!r}"
        )
    return steps


def _plan_mesh(
    args: argparse.Namespace, workload: Workload, profile: Profile | None, budget: Budget
) -> int:
    """``conveyor plan --world-size N``: the best dp x pp layout and why."""
    report = plan_mesh(
        workload,
        args.world_size,
        args.memory,
        args.batch_size,
        profile=profile,
        fsdp=args.fsdp,
        schedules=args.schedules,
        microbatches=args.microbatches,
        objectives=args.balance_by,
        recompute=not args.no_recompute,
        time_budget_s=budget,
    )
    print(
        f"{args.model} on {args.world_size} ranks, global batch {args.batch_size}, budget "
        f"{args.memory / 2**30:.2f} GiB per rank{' (FSDP)' if args.fsdp else ''}:"
    )
    print(report.why())  # raises ValueError (exit 2) when no layout fits
    if args.out:
        report.write(args.out)
        best = report.best
        print(
            f"wrote {args.out}: conveyor run --plan {args.out} -n {args.world_size} train.py "
            f"(dp={best.dp} x pp={best.pp})"
        )
    return 0


def _trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    first, last = args.step or (None, None)
    measured = load_run(args.directory, first, last)
    print(measured.summary_text())
    timelines = [measured]
    if args.compare:
        predicted = Timeline.load(args.compare)
        timelines.append(predicted)
        print(predicted.summary_text())
    png, chrome = args.png, args.chrome
    if png is None and chrome is None:  # neither asked for: both, in the run's directory
        png, chrome = args.directory / "timeline.png", args.directory / "trace.json"
    written = [str(write_png(png, *timelines))] if png else []
    if chrome:
        written.append(f"{write_chrome(chrome, *timelines)} (open it at https://ui.perfetto.dev)")
    print(f"wrote {' and '.join(written)}")
    return 0


def simulate_profile(args: argparse.Namespace) -> int:
    """``conveyor simulate --profile``: predict one configuration of a profiled model."""
    profile = Profile.load(args.profile)
    placement = stage_placement(
        args.schedule, args.stages, virtual_stages=args.virtual_stages, style=args.placement
    )
    num_stages = len(placement)
    balance = args.balance or even_balance(profile.num_units, num_stages)
    if len(balance) != num_stages:
        raise ValueError(
            f"--balance has {len(balance)} stages; {args.stages} ranks need "
            f"{num_stages} stages for {args.schedule}"
        )
    m = args.microbatches
    batch = args.batch_size or m * profile.microbatch_sizes[0]
    if batch < m:
        raise ValueError(
            f"--batch-size {batch} cannot be split into --microbatches {m} (a micro-batch "
            "needs a sample); give a batch of at least as many samples as micro-batches"
        )
    graph, units = layout(profile, split_units(profile.num_units, balance), placement)
    program = build_program(args.schedule, graph, m)
    modes = args.recompute[0] if len(args.recompute) == 1 else list(args.recompute)
    prediction = predict(program, graph, ProfileCost(profile, graph, units, batch / m, m, modes))
    prediction.timeline.meta["schedule"] = args.schedule
    print(prediction.timeline.summary_text())
    print(
        f"predicted: {prediction.step_time * 1e3:.2f} ms/step, "
        f"{batch / prediction.step_time:.1f} samples/s, bubble "
        f"{prediction.bubble_fraction:.1%}"
    )
    for rank in range(args.stages):
        print(
            f"  rank {rank}: peak activations {prediction.peak_activation[rank] / 2**20:.2f} "
            f"MiB, total {prediction.total_memory[rank] / 2**20:.2f} MiB"
        )
    if args.png:
        write_png(args.png, prediction.timeline)
    if args.chrome:
        write_chrome(args.chrome, prediction.timeline)
    if args.save_timeline:
        prediction.timeline.save(args.save_timeline)
    return 0
