"""Lost peers: the error that names them, the first failure kept in the rendezvous store, and
heartbeats that tell a stopped rank from a busy one.

    peers = Peers("conveyor/failure/pp0", group)                 # one per pipeline transport
    raise peers.lost(1, "receiving 0RB0<1", error, timeout)       # a receive from rank 1 failed
    raise peers.lost_in([0, 1, 2], "saving step 4", error, timeout)  # a collective: who?
    peers.abandoned("step 3", error)                              # this rank gives up the step
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from conveyor.torch_compat import default_store

__all__ = [
    "FAILURES_ENV",
    "Failure",
    "PeerLostError",
    "Peers",
    "StepRefused",
    "read_failure",
    "silent_ranks",
    "start_heartbeat",
]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

FAILURES_ENV = "CONVEYOR_FAILURES"
"""Set by ``conveyor run``: a directory where each torchrun attempt's first failure is written
(``attempt-<N>.json``), so the launcher's summary names the rank that failed, not the first
one to exit."""

HEARTBEAT_S = 1.0
"""Seconds between a rank's heartbeats in the store."""
STORE_WAIT_S = 5.0
"""Longest wait for the store on a failure path (its host may be the stopped rank)."""


class StepRefused(Exception):  # noqa: N818  # a marker, mixed into the refusals
    """Raised on every rank at once, before any message of the step (conveyor.runtime.
    fingerprint): nothing is in flight, so the pipeline stays usable (it is not abandoned)."""


class PeerLostError(RuntimeError):
    """A peer rank stopped answering (it crashed, was killed, is stopped or hung), or abandoned
    the step after an error of its own; the message names the rank and, when known, why."""


@dataclass(frozen=True)
class Failure:
    """The first failure a rank reported: ranks are global (torchrun's)."""

    rank: int
    """The rank that reported it."""
    lost: int | None
    """The rank it lost; None when the reporting rank failed itself (abandoned the step)."""
    doing: str
    """What the reporting rank was doing: 'receiving 0RB0<1', 'step 3', ..."""
    cause: str
    """The abandoning error ('ValueError: bad value'), or the backend's error."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Failure:
        return cls(**json.loads(text))

    def describe(self, name: Callable[[int], str] = lambda r: f"rank {r}") -> str:
        """One sentence; ``name`` turns a global rank into how the reader knows it."""
        if self.lost is None:
            return (
                f"{name(self.rank)} abandoned {self.doing} after an error of its own: {self.cause}"
            )
        return f"{name(self.rank)} lost {name(self.lost)} while {self.doing}"


# Note [first lost rank]:
# When rank 2 of a chain 0-1-2 dies, rank 1 sees it at once, fails, and exits; rank 0 then
# sees rank 1 go, and would name rank 1. So each rank that loses a peer, or abandons a step,
# records it in the store the group rendezvoused through (which outlives the ranks), first
# writer wins, and a rank that was not the first adds the first record to its message: the
# rank that really failed, and why. Under `conveyor run` the first record of each attempt is
# also written to a file (FAILURES_ENV), which the launcher's summary reads.
class Peers:
    """What this rank tells and learns about the other ranks of one pipeline transport.

    ``scope`` names the store record the ranks share (See Note [first lost rank]); ranks in
    messages are ranks of ``group``, as in every other conveyor message.
    """

    def __init__(self, scope: str, group: dist.ProcessGroup | None) -> None:
        self.scope = scope
        self.group = group
        self.rank = dist.get_rank(group)
        start_heartbeat()

    def lost(
        self, peer: int, doing: str, error: BaseException, timeout: timedelta
    ) -> PeerLostError:
        """The error for a wait on ``peer`` (a rank of ``group``) that failed with ``error``."""
        mine = Failure(self._global(self.rank), self._global(peer), doing, _one_line(error))
        first = record_failure(self.scope, mine)
        head = f"rank {self.rank}: lost rank {peer} while {doing}"
        if first is not None and first.lost is None:  # a rank abandoned the step: say why
            after = "" if self._local(first.rank) == peer else f" (rank {peer} went down after it)"
            return PeerLostError(f"{head}: {first.describe(self._name)}{after}. {_REMEDY}")
        text = (
            f"{head} (waited at most {timeout.total_seconds():.0f}s): {_one_line(error)}. "
            f"Rank {peer} has likely crashed, been killed or stopped; check its log."
        )
        if first is not None and first != mine and first.lost is not None:
            reporter, lost = self._local(first.rank), self._local(first.lost)
            text += f" Rank {reporter} reported losing rank {lost} first."
        return PeerLostError(text)

    def lost_in(
        self, ranks: Sequence[int], doing: str, error: BaseException, timeout: timedelta
    ) -> PeerLostError:
        """The error for a collective over the global ``ranks`` that failed with ``error``:
        names the rank that abandoned the step or went silent (its heartbeat stopped)."""
        me = dist.get_rank()
        first = read_record(self.scope)
        if first is not None:  # a rank abandoned the step, or was lost in it, already
            lost = first.rank if first.lost is None else first.lost
            return PeerLostError(
                f"rank {self.rank}: lost {self._name(lost)} while {doing} "
                f"({first.describe(self._name)} first): {_one_line(error)}"
            )
        members = ", ".join(self._name(r) for r in sorted(ranks))
        head = f"rank {self.rank}: a collective over {members} failed while {doing}"
        silent = silent_ranks([r for r in ranks if r != me])
        waited = f"waited at most {timeout.total_seconds():.0f}s"
        if silent is None:
            return PeerLostError(
                f"{head} ({waited}): {_one_line(error)}. The store does not answer either, "
                "so the rank that hosts it (usually rank 0) may be the one lost"
            )
        if not silent:
            return PeerLostError(
                f"{head} ({waited}): {_one_line(error)}. Every other rank is still running: "
                "one may be slower than the timeout (raise timeout_s) or waiting elsewhere"
            )
        for rank in silent:
            record_failure(self.scope, Failure(me, rank, doing, _one_line(error)))
        names = " and ".join(self._name(r) for r in silent)
        return PeerLostError(
            f"rank {self.rank}: lost {names} while {doing} ({waited}): its heartbeat stopped, "
            f"so it is stopped, hung or gone: {_one_line(error)}"
        )

    def abandoned(self, doing: str, error: BaseException) -> None:
        """Record that this rank gives up ``doing`` because of ``error`` (unless a failure is
        recorded already), for its peers' messages."""
        cause = f"{type(error).__name__}: {_one_line(error)}"
        record_failure(self.scope, Failure(self._global(self.rank), None, doing, cause))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _local(self, rank: int) -> int:
        return rank if self.group is None else dist.get_group_rank(self.group, rank)

    def _name(self, global_rank: int) -> str:
        try:
            return f"rank {self._local(global_rank)}"
        except (ValueError, RuntimeError):  # not in this group
            return f"global rank {global_rank}"


_REMEDY = (
    "Fix that error; the pipeline's connections are closed, so create a new Pipeline on "
    "every rank to go on"
)


def record_failure(scope: str, failure: Failure) -> Failure | None:
    """Record ``failure`` as the first of ``scope`` unless one is already; returns the first
    (None if the store does not answer). Also writes the attempt's first failure to
    ``$CONVEYOR_FAILURES`` when ``conveyor run`` set it."""
    _write_first(failure)
    store = default_store()
    if store is None:
        return None
    text = _bounded(lambda: store.compare_set(scope, "", failure.to_json()).decode())
    return None if text is None else Failure.from_json(text)


def read_record(scope: str) -> Failure | None:
    """The first failure recorded in ``scope``, or None."""
    store = default_store()
    if store is None:
        return None
    text = _bounded(lambda: store.get(scope).decode() if store.check([scope]) else "")
    return Failure.from_json(text) if text else None


def read_failure(directory: str | os.PathLike[str], attempt: int) -> Failure | None:
    """The first failure written under ``directory`` by torchrun attempt ``attempt`` (0 first,
    then one per restart), or None: an earlier attempt's record would name another failure."""
    path = Path(directory, f"attempt-{attempt}.json")
    return Failure.from_json(path.read_text()) if path.is_file() else None


def _write_first(failure: Failure) -> None:
    directory = os.environ.get(FAILURES_ENV)
    if not directory:
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    final = Path(directory, f"attempt-{attempt}.json")
    temporary = final.with_name(f".{final.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:  # whole or not at all, first writer wins: a link fails if the name exists
        temporary.write_text(failure.to_json())
        os.link(temporary, final)
    except OSError:
        pass
    finally:
        temporary.unlink(missing_ok=True)


# -- heartbeats --------------------------------------------------------------------------------

_heartbeat: threading.Thread | None = None


def start_heartbeat() -> None:
    """Beat in the store every HEARTBEAT_S from a daemon thread (once per process), so
    ``silent_ranks`` can tell a stopped or hung rank from a busy one."""
    global _heartbeat
    if _heartbeat is None or not _heartbeat.is_alive():
        _heartbeat = threading.Thread(target=_beat, name="conveyor-heartbeat", daemon=True)
        _heartbeat.start()


def _beat() -> None:
    while True:
        store = default_store()
        if store is not None:
            # the world may be gone or changing: beat again in the next one
            with contextlib.suppress(Exception):
                store.add(_heartbeat_key(dist.get_rank()), 1)
        del store
        time.sleep(HEARTBEAT_S)


def silent_ranks(ranks: Sequence[int], wait_s: float = 2.5 * HEARTBEAT_S) -> list[int] | None:
    """The global ``ranks`` whose heartbeat did not move in ``wait_s`` seconds (stopped, hung
    or dead); None if the store does not answer. Takes ``wait_s``."""
    store = default_store()
    if store is None:
        return None

    def counts() -> list[int]:
        return [store.add(_heartbeat_key(r), 0) for r in ranks]

    before = _bounded(counts)
    time.sleep(wait_s)
    after = _bounded(counts)
    if before is None or after is None:
        return None
    return [r for r, a, b in zip(ranks, before, after, strict=True) if a == b]


def _heartbeat_key(rank: int) -> str:
    return f"conveyor/heartbeat/{rank}"


def _bounded(call: Callable[[], _T], wait_s: float = STORE_WAIT_S) -> _T | None:
    """``call()``, or None if it raises or takes longer than ``wait_s`` (it then finishes, or
    not, in a daemon thread that does not keep the process alive)."""
    box: list[_T] = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as error:
            logger.debug("store call failed: %s", error)

    thread = threading.Thread(target=run, name="conveyor-store", daemon=True)
    thread.start()
    thread.join(wait_s)
    return box[0] if box else None


def _one_line(error: BaseException) -> str:
    """An error's message on one line, at most 1000 characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 1000 else text[:997] + "..."
