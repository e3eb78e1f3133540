"""The `conveyor` command: argparse -> configs -> calls into the modules; no logic of its own.

conveyor demo                                   # train a GPT on 2 local ranks
conveyor run -n 2 train.py --lr 1e-3            # any script, under torchrun
conveyor run -n 4 --dp 2 train.py               # 2 replicas of a 2-rank pipeline
conveyor simulate --schedule 1f1b --stages 4 --microbatches 8
conveyor generate --prompt "def " --max-new-tokens 64      # pipelined generation, 2 ranks
conveyor run --trace runs/t -n 2 train.py; conveyor trace runs/t    # a measured timeline
conveyor plan --model gpt --ranks 2 --memory 1GiB --batch-size 32 --out plan.json
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from conveyor.cli.flags import add_dataclass_flags, build_dataclass, read_toml
from conveyor.cli.generate import add_decode_flags, add_generate_command, simulate_decode
from conveyor.cli.launch import take_run_options, torchrun
from conveyor.cli.tools import (
    add_simulate_flags,
    add_tool_commands,
    positive_int,
    simulate_profile,
)
from conveyor.config import PipelineConfig
from conveyor.demo import DemoConfig, worker_args
from conveyor.graph import PLACEMENT_STYLES, chain
from conveyor.runtime.memory import alive_peak
from conveyor.runtime.peers import leave
from conveyor.schedule import SCHEDULES, build_program, stage_placement
from conveyor.simulator import simulate
from conveyor.trace import render_grid

__all__ = ["command", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``conveyor`` command; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(message)s")
    try:
        return int(args.command(args, parser))
    except (ValueError, TypeError, FileNotFoundError) as error:
        parser.error(str(error))
    return 2  # parser.error exits; this keeps type checkers content


def command() -> NoReturn:
    """The ``conveyor`` console script and ``python -m conveyor.cli``: ``main``, then exit
    without finalizing the interpreter, which costs half a second once torch is imported
    (the command's own threads and files are done by then; See Note [threads at exit])."""
    leave(main())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="Pipeline-parallel training: run scripts on N ranks, "
        "train the demo, simulate schedules, plan a configuration, render timelines.",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    _add_run_command(commands)
    _add_demo_command(commands)
    add_tool_commands(commands)
    add_generate_command(commands)
    _add_simulate_command(commands)
    return parser


def _add_run_command(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run a script on N local ranks under torchrun",
        description="Start a script on every rank with torchrun. Options before the script are "
        "torchrun's (--nnodes, --node-rank, --rdzv-endpoint, --max-restarts, ...), plus -n N "
        "for --nproc-per-node (default 2); without a rendezvous endpoint the ranks run on this "
        "machine (--standalone). conveyor's own: --trace DIR records every Pipeline's timeline "
        "to DIR (render with conveyor trace DIR); --plan FILE runs every Pipeline with a plan "
        "from conveyor plan --out FILE; --checkpoint-dir DIR is where every Checkpointer "
        "saves and resumes from (with --max-restarts N, a lost rank restarts them all, and "
        "they resume from the newest valid checkpoint); --dp N runs every Pipeline as N "
        "data-parallel replicas (the ranks are dp x pp, e.g. -n 4 --dp 2: 2 replicas of a "
        "2-rank pipeline), --tp N splits every stage over N tensor-parallel ranks.",
        usage="conveyor run [-n N] [torchrun options] script.py [script args]",
        prefix_chars="+",
        add_help=False,
    )  # every token goes to torchrun's own parser
    run.add_argument(
        "torchrun_args",
        nargs=argparse.REMAINDER,
        help="[-n N] [torchrun options] script.py [script args]",
    )
    run.set_defaults(command=_run, run_parser=run)


def _add_demo_command(commands: Any) -> None:
    demo = commands.add_parser("demo", help="train the shipped GPT, pipelined over local ranks")
    demo.add_argument("--config", type=Path, help="TOML file with demo and pipeline fields")
    demo.add_argument(
        "--trace",
        metavar="DIR",
        dest="trace_dir",
        default=None,
        help="record every step's timeline to DIR and render the last one "
        "(DIR/timeline.png, DIR/trace.json)",
    )
    add_dataclass_flags(demo, DemoConfig)
    add_dataclass_flags(demo, PipelineConfig, skip=("trace", "trace_dir"))
    demo.set_defaults(command=_demo)


def _add_simulate_command(commands: Any) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="print a schedule's Program as a rank x time grid, without starting processes",
    )
    simulate.add_argument(
        "--schedule", default="1f1b", help=f"one of {sorted(SCHEDULES)}, or a schedule file"
    )
    simulate.add_argument(
        "--stages",
        type=positive_int,
        default=4,
        help="pipeline ranks, each holding --virtual-stages stages",
    )
    simulate.add_argument(
        "--virtual-stages",
        type=positive_int,
        default=None,
        help="stages per rank (default: the schedule's: 2 for interleaved-1f1b and zb-v, else 1)",
    )
    simulate.add_argument(
        "--placement",
        choices=PLACEMENT_STYLES,
        default=None,
        help="how stages share ranks: loop or v (default: the schedule's)",
    )
    simulate.add_argument("--microbatches", type=positive_int, default=8)
    simulate.add_argument(
        "--actions",
        action="store_true",
        help="also print every rank's actions, sends and receives included",
    )
    add_simulate_flags(simulate)
    add_decode_flags(simulate)
    simulate.set_defaults(command=_simulate, simulate_parser=simulate)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.torchrun_args or args.torchrun_args[0] in ("-h", "--help"):
        args.run_parser.print_help()
        return 0
    return torchrun(take_run_options(args.torchrun_args))


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    values = read_toml(args.config, DemoConfig, PipelineConfig) if args.config else {}
    demo = build_dataclass(DemoConfig, args, values)
    pipeline = build_dataclass(PipelineConfig, args, values)
    return torchrun(
        ["--nproc-per-node", str(demo.ranks), "-m", "conveyor.demo", *worker_args(demo, pipeline)]
    )


_NEEDS = {
    "--profile": ("balance", "batch_size", "recompute", "png", "chrome", "save_timeline"),
    "--decode": ("groups", "new_tokens", "prompt_chunks"),
}
"""Flags of ``conveyor simulate`` that only mean something with another flag."""

_TRAINING_ONLY = ("schedule", "microbatches", "virtual_stages", "placement")
"""Flags of ``conveyor simulate`` that describe a training schedule, which --decode ignores."""


def _check_simulate_flags(args: argparse.Namespace) -> None:
    """Refuse flags that the chosen kind of simulation would ignore."""
    if args.decode and args.profile is not None:
        raise ValueError(
            "simulate: --decode simulates a decode Program in unit costs; --profile predicts "
            "training steps. Drop one of them"
        )
    chosen = {"--profile": args.profile is not None, "--decode": args.decode}
    for needed, names in _NEEDS.items():
        given = _given(args, names)
        if given and not chosen[needed]:
            verb = "works" if len(given) == 1 else "work"
            flags = ", ".join(given)
            them = "it" if len(given) == 1 else "them"
            raise ValueError(f"simulate: {flags} only {verb} with {needed}; add it or drop {them}")
    given = _given(args, _TRAINING_ONLY)
    if given and args.decode:
        raise ValueError(
            f"simulate: {', '.join(given)} describe a training schedule, but --decode simulates "
            "a decode Program (its flags: --stages, --groups, --new-tokens, --prompt-chunks); "
            "drop them"
        )


def _given(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The flags among ``names`` set to other than their defaults, as typed ('--new-tokens')."""
    parser = args.simulate_parser
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) != parser.get_default(n)]


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    _check_simulate_flags(args)
    if args.decode:
        return simulate_decode(args)
    if args.profile is not None:  # a profiled model: predicted time and memory
        return simulate_profile(args)
    placement = stage_placement(
        args.schedule, args.stages, virtual_stages=args.virtual_stages, style=args.placement
    )
    num_stages = len(placement)
    graph = chain(num_stages, placement=placement)
    program = build_program(args.schedule, graph, args.microbatches)
    timeline = simulate(program, graph)
    print(render_grid(timeline))
    print(
        f"schedule={args.schedule} ranks={args.stages} stages={num_stages} "
        f"microbatches={args.microbatches} step={timeline.step_time:g} units "
        f"(per stage F=1, B=2 or I=1 + W=1) bubble={timeline.bubble_fraction:.1%} "
        f"peak activations={[alive_peak(actions) for actions in program]} "
        "(stage, micro-batch) sets per rank"
    )
    if args.actions:
        print("\n".join(f"rank {r}: {' '.join(map(str, a))}" for r, a in enumerate(program)))
    return 0
