"""The loop every Program runs through, training's and decode's alike: one handler per
action kind, each action timed into a Recorder when tracing.

    class Decode(Interpreter):
        def __init__(...): self.handlers = {Kind.F: self._forward, ...}
    runtime.execute(program[rank])          # in order; a kind without a handler is refused

A new action kind is a handler method and one entry in its runtime's table; the schedule, not
the runtime, decides when it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from conveyor.program import Action, Kind
from conveyor.trace import Recorder

__all__ = ["Interpreter"]

logger = logging.getLogger(__name__)


class Interpreter:
    """Runs one rank's actions by their handlers, in order."""

    rank: int
    handlers: dict[Kind, Callable[[Action], None]]
    """The action kinds this runtime runs, each by one method."""
    recorder: Recorder | None = None
    """Set to record every action's start and end (conveyor.trace); None costs nothing."""

    def execute(
        self,
        actions: Sequence[Action],
        after: Callable[[int, Action], None] | None = None,
    ) -> None:
        """Run ``actions`` in order, each by its kind's handler; ``after(index, action)``
        runs after each one.

        Raises:
            RuntimeError: an action of a kind this runtime has no handler for.
        """
        recorder = self.recorder
        for index, action in enumerate(actions):
            logger.debug("[rank %d] %s", self.rank, action)
            handler = self.handlers.get(action.kind)
            if handler is None:
                raise RuntimeError(
                    f"rank {self.rank}: {action} is a {action.kind.name} action, which "
                    f"{type(self).__name__} does not run (it runs "
                    f"{', '.join(k.name for k in self.handlers)})"
                )
            if recorder is None:
                handler(action)
            else:
                start = recorder.now()
                handler(action)
                recorder.add(str(action), start, recorder.now(), memory=self.held_bytes())
            if after is not None:
                after(index, action)

    def held_bytes(self) -> int:
        """Bytes this rank holds for the run (activations, caches) as a recorded action
        ends; 0 where nothing is measured."""
        return 0
