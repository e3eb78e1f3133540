"""The ``conveyor`` command: ``main`` (run, demo, simulate, plan, trace).

Modules: ``main`` (the parser and the run, demo and simulate commands), ``tools`` (plan,
trace, simulate --profile), ``launch`` (conveyor's run options, then torchrun) and ``flags``
(flags made from config dataclasses).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """The ``conveyor`` command. Imported on call, so that ``python -m conveyor.cli.generate``
    (each rank of ``conveyor generate``) does not find its own module imported already."""
    from conveyor.cli.main import main as run

    return run(argv)
