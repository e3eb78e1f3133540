"""The ``conveyor`` command: ``main`` (run, demo, simulate, plan, trace).

Modules: ``main`` (the parser and the run, demo and simulate commands), ``tools`` (plan,
trace, simulate --profile), ``launch`` (conveyor's run options, then torchrun) and ``flags``
(flags made from config dataclasses).
"""

from conveyor.cli.main import main

__all__ = ["main"]
