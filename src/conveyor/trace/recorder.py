"""Recorder: one rank's events, step by step, as the runtime runs them.

recorder = Recorder(rank)              # the runtime and P2P call add, wait, sent
recorder.begin_step(0); ...; recorder.end_step()
part = recorder.timeline(num_ranks)    # this rank's part; conveyor.trace.merge joins them
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from conveyor.trace.timeline import RECOMPUTE, WAIT, Event, Timeline, is_compute

__all__ = ["Recorder"]


class Recorder:
    """Collects one rank's events during a run, step by step.

    Times are ``time.perf_counter()`` readings; ``clock_offset`` turns them into wall-clock
    seconds, so ranks on other hosts line up (to the hosts' clock agreement; ranks on one host
    share the monotonic clock and line up exactly). The runtime calls ``add`` after every
    action, and ``conveyor.runtime.comm.P2P`` calls ``wait`` and ``sent`` from inside transfers.
    """

    def __init__(self, rank: int, keep: int = 64) -> None:
        self.rank = rank
        self.keep = keep
        """Steps kept in memory (older ones are dropped; a sink file keeps them all)."""
        self.clock_offset = time.time() - time.perf_counter()
        self.host = socket.gethostname()
        self.events: list[Event] = []
        """The current step's events (perf_counter times)."""
        self.steps: list[tuple[int, list[Event]]] = []
        """Finished steps: (step index, events), oldest first."""
        self.sink: Any = None
        """An open text file that receives one JSON line per finished step, or None."""
        self._step_index = 0
        self._pending_bytes = 0
        self._wait_end = 0.0

    now = staticmethod(time.perf_counter)

    def begin_step(self, index: int) -> None:
        self._step_index = index
        self.events = []

    def end_step(self) -> None:
        """Close the current step: keep it, and write it to the sink if there is one."""
        self.steps.append((self._step_index, self.events))
        del self.steps[: -self.keep]
        if self.sink is not None:
            rows = [
                [
                    e.action,
                    e.start + self.clock_offset,
                    e.end + self.clock_offset,
                    e.bytes,
                    e.memory,
                ]
                for e in self.events
            ]
            self.sink.write(json.dumps({"step": self._step_index, "events": rows}) + "\n")
        self.events = []

    def add(self, action: str, start: float, end: float, bytes: int = 0, memory: int = 0) -> None:
        """Record an action; a compute action starts when the waits inside it ended."""
        if self._wait_end > start and is_compute(action):
            start = self._wait_end
        bytes, self._pending_bytes = bytes + self._pending_bytes, 0
        self.events.append(Event(self.rank, action, start, end, bytes, memory))

    def wait(self, describe: str, start: float, end: float, bytes: int = 0) -> None:
        """Record time blocked on ``describe`` (a receive's action text, or 'sends')."""
        self.events.append(Event(self.rank, f"{WAIT} {describe}", start, end, bytes))
        self._wait_end = end

    def recompute(self, forward: str, start: float, end: float) -> None:
        """Record a recomputation of ``forward`` (``1F0``) inside the backward now running."""
        self.events.append(Event(self.rank, f"{RECOMPUTE} {forward}", start, end))

    def sent(self, num_bytes: int) -> None:
        """Bytes handed to the transport by the action now running."""
        self._pending_bytes += num_bytes

    def header(self) -> dict[str, Any]:
        """The first line of this rank's trace file."""
        return {"rank": self.rank, "host": self.host, "clock_offset": self.clock_offset}

    def timeline(self, num_ranks: int, step: int = -1) -> Timeline:
        """This rank's events of one kept step, times in wall-clock seconds: ``step`` is a
        step's index (0: the first), or counts back from the last kept step (-1)."""
        moved = [
            Event(
                e.rank,
                e.action,
                e.start + self.clock_offset,
                e.end + self.clock_offset,
                e.bytes,
                e.memory,
            )
            for e in self._kept(step)
        ]
        return Timeline(num_ranks, moved)

    def _kept(self, step: int) -> list[Event]:
        if not self.steps:
            raise RuntimeError(
                f"rank {self.rank}: no step recorded yet; run a step with "
                "tracing on first (Pipeline(..., trace=True))"
            )
        found = [events for index, events in self.steps if index == step]
        if step < 0 and -step <= len(self.steps):
            found = [self.steps[step][1]]
        if not found:
            first, last = self.steps[0][0], self.steps[-1][0]
            raise ValueError(
                f"rank {self.rank}: step {step} is not kept; the recorder keeps steps {first} to "
                f"{last} (the last {self.keep}): pass one of them, or -1 to -{len(self.steps)} "
                "counting back from the last"
            )
        return found[0]
