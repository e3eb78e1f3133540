"""Start ranks with torchrun, after taking conveyor's own options off its arguments.

    torchrun(take_run_options(["--trace", "runs/t", "-n", "4", "--dp", "2", "train.py"]))
conveyor's options come before the script and reach every rank as environment variables
(conveyor.config: PLAN_ENV, TRACE_ENV, CHECKPOINT_DIR_ENV, DP_ENV, TP_ENV); everything else
is torchrun's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from conveyor.config import CHECKPOINT_DIR_ENV, DP_ENV, PLAN_ENV, TP_ENV, TRACE_ENV, read_plan
from conveyor.runtime.peers import FAILURES_ENV, Failure, read_failure

__all__: list[str] = []

logger = logging.getLogger(__name__)


def _check_plan(path: str) -> str:
    read_plan(path)  # fail now, not on every rank
    return str(Path(path).resolve())


def _directory(value: str) -> str:
    path = Path(value).resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{value!r} is a file, not a directory; pass a directory (it is made)")
    return str(path)


def _size(value: str) -> str:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--dp and --tp take a positive number of ranks, got {value!r}")
    return value


RUN_OPTIONS: dict[str, tuple[str, str, Callable[[str], str]]] = {
    "--trace": (TRACE_ENV, "DIR", _directory),
    "--plan": (PLAN_ENV, "FILE", _check_plan),
    "--checkpoint-dir": (CHECKPOINT_DIR_ENV, "DIR", _directory),
    "--dp": (DP_ENV, "N", _size),
    "--tp": (TP_ENV, "N", _size),
}
"""conveyor run's own options: flag -> (environment variable, value name, check that returns
the value to export)."""

_MULTI_NODE = (
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--master-addr",
    "--master_addr",
    "--nnodes",
    "--standalone",
)


def take_run_options(tokens: Sequence[str]) -> list[str]:
    """Strip conveyor's options (before the script) from ``conveyor run``'s arguments and
    export each as its environment variable (paths made absolute); returns the rest for
    torchrun.

    Raises:
        ValueError: an option without its value, or one that took the script as its value.
    """
    rest: list[str] = []
    tokens = list(tokens)
    taken: list[tuple[str, str]] = []
    while tokens:
        token = tokens.pop(0)
        name, _, value = token.partition("=")
        if name in RUN_OPTIONS:
            if not value:
                if not tokens or tokens[0].startswith("-"):
                    what = RUN_OPTIONS[name][1]
                    raise ValueError(f"{name} needs a value: {name} {what} before the script")
                value = tokens.pop(0)
            taken.append((name, value))
            continue
        rest.append(token)
        if token.endswith(".py") or token in ("-m", "--module"):
            tokens, rest = [], rest + tokens  # the script and its own arguments
    for name, value in taken:  # first: a value that is the script explains any other error
        if value.endswith(".py") and not _has_script(rest):
            raise ValueError(
                f"no script to run: {name} took {value!r} as its {RUN_OPTIONS[name][1]}; give "
                f"{name} a value before the script: conveyor run [-n N] {name} "
                f"{RUN_OPTIONS[name][1]} script.py [script args]"
            )
    exports = {RUN_OPTIONS[name][0]: RUN_OPTIONS[name][2](value) for name, value in taken}
    _check_mesh(rest, exports)
    os.environ.update(exports)  # only once every option is good
    return rest  # without a .py: torchrun --no-python, or no script (torchrun says so)


def _has_script(arguments: Sequence[str]) -> bool:
    return any(a.endswith(".py") or a in ("-m", "--module") for a in arguments)


def _launcher() -> argparse.ArgumentParser:
    """torchrun's own parser, with ``-n`` for ``--nproc-per-node`` (default 2)."""
    from torch.distributed.run import get_args_parser

    launcher = get_args_parser()
    launcher.add_argument("-n", dest="nproc_per_node", help="ranks per node")
    launcher.set_defaults(nproc_per_node="2")  # over torchrun's 1, which argparse would keep
    return launcher


def _check_mesh(arguments: Sequence[str], exports: dict[str, str]) -> None:
    """Refuse --dp x --tp that the ranks of this one machine (-n) cannot hold, before any
    rank starts."""
    mesh = int(exports.get(DP_ENV, 1)) * int(exports.get(TP_ENV, 1))
    if (
        mesh == 1
        or not _has_script(arguments)
        or any(a.split("=")[0] in _MULTI_NODE for a in arguments)
    ):
        return
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # torchrun reports its own errors
            count = str(_launcher().parse_args(list(arguments)).nproc_per_node)
    except SystemExit:
        return
    if count.isdigit() and int(count) % mesh:
        raise ValueError(
            f"-n {count} ranks do not split into --dp {exports.get(DP_ENV, 1)} x --tp "
            f"{exports.get(TP_ENV, 1)} x pipeline ranks; pass -n a multiple of {mesh}"
        )


def torchrun(arguments: list[str], resumable: bool = True) -> int:
    """Start ranks with torchrun (torch.distributed.run); this machine alone unless the
    arguments name a rendezvous. Returns the exit code. A failure of a ``resumable`` job
    (training) says how restarts resume it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    if not any(a.split("=")[0] in _MULTI_NODE for a in arguments):
        arguments = ["--standalone", *arguments]
    launch = _launcher().parse_args(arguments)
    if int(launch.nproc_per_node) < 1:
        raise ValueError(f"-n must be >= 1, got {launch.nproc_per_node}")

    if not launch.module and not Path(launch.training_script).is_file():
        raise FileNotFoundError(
            f"script {launch.training_script!r} not found; usage: conveyor "
            "run [-n N] [torchrun options] script.py [script args]"
        )
    if launch.max_restarts:
        # a restarted group must not rendezvous through the store the lost one used: its stale
        # addresses make gloo connect to dead ports (pytorch/pytorch#135712)
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    failures = os.environ[FAILURES_ENV] = tempfile.mkdtemp(prefix="conveyor-failures-")
    try:
        run(launch)  # type: ignore[no-untyped-call]  # torchrun's entry point is untyped
    except ChildFailedError as error:  # each rank's own error is printed above
        rank, failure = error.get_first_failure()
        cause = failure.signal_name() if failure.exitcode < 0 else "an exception, see above"
        restarts = (
            f"; no restarts left (--max-restarts {launch.max_restarts} used up)"
            if launch.max_restarts
            else "; no restarts: pass --max-restarts N (and save with a Checkpointer) to resume"
        )
        exited = f"rank {rank} (local rank {failure.local_rank})"
        how = f"exit code {failure.exitcode} ({cause})"
        recorded = read_failure(failures, launch.max_restarts)  # the last attempt's
        summary = failure_summary(exited, rank, how, recorded)
        logger.error("%s%s", summary, restarts if resumable else "")
        return 1
    except Exception as error:
        logger.error("%s", str(error).strip().splitlines()[0] if str(error) else error)
        return 1
    finally:
        del os.environ[FAILURES_ENV]
        shutil.rmtree(failures, ignore_errors=True)
    return 0


def failure_summary(exited: str, rank: int, how: str, recorded: Failure | None) -> str:
    """Who failed first: the rank the ranks' own first record names (See Note [first lost
    rank]), which a stopped or hung rank never is for torchrun (it does not exit), else the
    first rank to exit (``exited``, global ``rank``, exiting ``how``). A rank that timed out
    waiting records the rank whose heartbeat stopped, so a healthy rank that merely waited
    longest is not blamed, whatever the load."""
    if recorded is None:
        return f"{exited} failed first: {how}"
    if recorded.culprit == rank:
        return f"{exited} failed first: {how}: {recorded.describe()}"
    culprit = recorded.name(recorded.culprit)
    return f"{culprit} failed first: {recorded.describe()}; {exited} exited first: {how}"
