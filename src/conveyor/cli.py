"""The `conveyor` command: argparse -> configs -> calls into the modules; no logic of its own.

    conveyor demo                                   # train a GPT on 2 local ranks
    conveyor run -n 2 train.py --lr 1e-3            # any script, under torchrun
    conveyor simulate --schedule 1f1b --stages 4 --microbatches 8
    conveyor run --trace runs/t -n 2 train.py; conveyor trace runs/t    # a measured timeline
    conveyor plan --model gpt --ranks 2 --memory 1GiB --batch-size 32 --out plan.json
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import logging
import os
import sys
import tomllib
import types
import typing
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from conveyor.cli_tools import (
    add_simulate_flags,
    add_tool_commands,
    simulate_profile,
    take_run_options,
)
from conveyor.config import PipelineConfig
from conveyor.demo import DemoConfig, worker_args
from conveyor.graph import PLACEMENT_STYLES, chain, place
from conveyor.memory import alive_peak
from conveyor.schedule import SCHEDULES, build_program, layout_of
from conveyor.simulate import execute
from conveyor.trace import render_grid

__all__ = ["main"]

logger = logging.getLogger(__name__)


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor", description="Pipeline-parallel training: run scripts on N ranks, "
        "train the demo, simulate schedules, plan a configuration, render timelines.")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run", help="run a script on N local ranks under torchrun",
        description="Start a script on every rank with torchrun. Options before the script are "
        "torchrun's (--nnodes, --node-rank, --rdzv-endpoint, --max-restarts, ...), plus -n N "
        "for --nproc-per-node (default 2); without a rendezvous endpoint the ranks run on this "
        "machine (--standalone). conveyor's own: --trace DIR records every Pipeline's timeline "
        "to DIR (render with conveyor trace DIR); --plan FILE runs every Pipeline with a plan "
        "from conveyor plan --out FILE; --checkpoint-dir DIR is where every Checkpointer "
        "saves and resumes from (with --max-restarts N, a lost rank restarts them all, and "
        "they resume from the newest valid checkpoint).",
        usage="conveyor run [-n N] [torchrun options] script.py [script args]",
        prefix_chars="+", add_help=False)  # every token goes to torchrun's own parser
    run.add_argument("torchrun_args", nargs=argparse.REMAINDER,
                     help="[-n N] [torchrun options] script.py [script args]")
    run.set_defaults(command=_run, run_parser=run)

    demo = commands.add_parser("demo", help="train the shipped GPT, pipelined over local ranks")
    demo.add_argument("--config", type=Path, help="TOML file with demo and pipeline fields")
    demo.add_argument("--trace", metavar="DIR", dest="trace_dir", default=None,
                      help="record every step's timeline to DIR and render the last one "
                      "(DIR/timeline.png, DIR/trace.json)")
    add_dataclass_flags(demo, DemoConfig)
    add_dataclass_flags(demo, PipelineConfig, skip=("trace", "trace_dir"))
    demo.set_defaults(command=_demo)

    add_tool_commands(commands)

    simulate = commands.add_parser("simulate", help="print a schedule's Program as a "
                                   "rank x time grid, without starting processes")
    simulate.add_argument("--schedule", default="1f1b",
                          help=f"one of {sorted(SCHEDULES)}, or a schedule file")
    simulate.add_argument("--stages", type=int, default=4,
                          help="pipeline ranks, each holding --virtual-stages stages")
    simulate.add_argument("--virtual-stages", type=int, default=None,
                          help="stages per rank (default: the schedule's: 2 for "
                          "interleaved-1f1b and zb-v, else 1)")
    simulate.add_argument("--placement", choices=PLACEMENT_STYLES, default=None,
                          help="how stages share ranks: loop or v (default: the schedule's)")
    simulate.add_argument("--microbatches", type=int, default=8)
    simulate.add_argument("--actions", action="store_true",
                          help="also print every rank's actions, sends and receives included")
    add_simulate_flags(simulate)
    simulate.set_defaults(command=_simulate)
    return parser


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.torchrun_args or args.torchrun_args[0] in ("-h", "--help"):
        args.run_parser.print_help()
        return 0
    return _torchrun(take_run_options(_take_checkpoint_dir(args.torchrun_args)))


def _take_checkpoint_dir(tokens: Sequence[str]) -> list[str]:
    """Strip ``--checkpoint-dir DIR`` (before the script) and export it for every rank's
    Checkpointer (conveyor.checkpoint); returns the other tokens."""
    from conveyor.config import CHECKPOINT_DIR_ENV

    rest, tokens = [], list(tokens)
    while tokens:
        token = tokens.pop(0)
        name, _, value = token.partition("=")
        if name == "--checkpoint-dir":
            if not value and not tokens:
                raise ValueError("--checkpoint-dir needs a value: --checkpoint-dir DIR")
            os.environ[CHECKPOINT_DIR_ENV] = str(Path(value or tokens.pop(0)).resolve())
            continue
        rest.append(token)
        if token.endswith(".py") or token in ("-m", "--module"):
            return rest + tokens  # the script and its own arguments
    return rest


def _demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    values = _toml(args.config) if args.config else {}
    demo = build_dataclass(DemoConfig, args, values)
    pipeline = build_dataclass(PipelineConfig, args, values)
    return _torchrun(["--nproc-per-node", str(demo.ranks), "-m", "conveyor.demo",
                      *worker_args(demo, pipeline)])


def _simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.profile is not None:  # a profiled model: predicted time and memory
        return simulate_profile(args)
    layout = layout_of(args.schedule)
    per_rank = args.virtual_stages or layout.virtual_stages
    if args.stages < 1 or per_rank < 1:
        raise ValueError(f"--stages and --virtual-stages must be >= 1, got {args.stages} and "
                         f"{per_rank}")
    num_stages = args.stages * per_rank
    graph = chain(num_stages, placement=place(num_stages, args.stages,
                                              args.placement or layout.placement))
    program = build_program(args.schedule, graph, args.microbatches)
    timeline = execute(program, graph)
    print(render_grid(timeline))
    print(f"schedule={args.schedule} ranks={args.stages} stages={num_stages} "
          f"microbatches={args.microbatches} step={timeline.step_time:g} units "
          f"(per stage F=1, B=2 or I=1 + W=1) bubble={timeline.bubble_fraction:.1%} "
          f"peak activations={[alive_peak(actions) for actions in program]} "
          "(stage, micro-batch) sets per rank")
    if args.actions:
        print("\n".join(f"rank {r}: {' '.join(map(str, a))}" for r, a in enumerate(program)))
    return 0


_MULTI_NODE = ("--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr",
               "--nnodes", "--standalone")


def _torchrun(arguments: list[str]) -> int:
    """Start ranks with torchrun (torch.distributed.run); this machine alone unless the
    arguments name a rendezvous."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if not any(a.split("=")[0] in _MULTI_NODE for a in arguments):
        arguments = ["--standalone", *arguments]
    launcher = get_args_parser()
    launcher.add_argument("-n", dest="nproc_per_node", default="2", help="ranks per node")
    launch = launcher.parse_args(arguments)
    if int(launch.nproc_per_node) < 1:
        raise ValueError(f"-n must be >= 1, got {launch.nproc_per_node}")
    if not launch.module and not Path(launch.training_script).is_file():
        raise FileNotFoundError(f"script {launch.training_script!r} not found; usage: conveyor "
                                "run [-n N] [torchrun options] script.py [script args]")
    if launch.max_restarts:
        # a restarted group must not rendezvous through the store the lost one used: its stale
        # addresses make gloo connect to dead ports (pytorch/pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(launch)  # type: ignore[no-untyped-call]  # torchrun's entry point is untyped
    except ChildFailedError as error:  # each rank's own error is printed above
        rank, failure = error.get_first_failure()
        cause = failure.signal_name() if failure.exitcode < 0 else "an exception, see above"
        restarts = (f"no restarts left (--max-restarts {launch.max_restarts} used up)"
                    if launch.max_restarts
                    else "no restarts: pass --max-restarts N (and save with a Checkpointer) "
                    "to resume")
        logger.error("rank %d (local rank %d) failed first: exit code %d (%s); %s", rank,
                     failure.local_rank, failure.exitcode, cause, restarts)
        return 1
    except Exception as error:
        logger.error("%s", str(error).strip().splitlines()[0] if str(error) else error)
        return 1
    return 0


# -- flags from dataclasses ---------------------------------------------------------------


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type,
                        skip: Sequence[str] = ()) -> None:
    """One ``--field-name`` flag per dataclass field (but ``skip``); help comes from the
    field's docstring."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        kind, nargs = _flag_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"{docs.get(field.name, '')} (default: {default})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(flag, type=kind, nargs=nargs, default=None, help=help_text)


def build_dataclass(cls: type, args: argparse.Namespace, values: dict[str, Any]) -> Any:
    """An instance of ``cls`` from TOML ``values`` overridden by the flags that were given."""
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in values.items() if k in names}
    fields.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def _flag_type(hint: Any) -> tuple[type, str | None]:
    """The argparse type and nargs for a field's type hint."""
    options = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = options[0]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], "+"
    if typing.get_origin(hint) is typing.Literal:
        return str, None
    return hint, None


@cache
def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written beneath dataclass fields, read from the class's source, as
    argparse help."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]  # the class definition
    docs = {}
    for field, doc in itertools.pairwise(body):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)):
            # argparse formats help with %: a literal one must be doubled
            docs[field.target.id] = " ".join(str(doc.value.value).split()).replace("%", "%%")
    return docs


def _toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as file:
        return tomllib.load(file)


if __name__ == "__main__":
    sys.exit(main())
