"""Lost peers: the error that names them, the first failure kept in the rendezvous store,
heartbeats that tell a stopped rank from a busy one, and the one deadline of a failure.

    peers = Peers("conveyor/failure/pp0", group)                 # one per pipeline transport
    raise peers.lost(1, "receiving 0RB0<1", error, timeout)       # a receive from rank 1 failed
    raise peers.lost_in([0, 1, 2], "saving step 4", error, timeout)  # a collective: who?
    peers.abandoned("step 3", error)                              # this rank gives up the step
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from conveyor.torch_compat import close_gloo_group, default_store

__all__ = [
    "FAILURES_ENV",
    "FAILURE_S",
    "Failure",
    "PeerLostError",
    "Peers",
    "StepRefused",
    "about_a_peer",
    "close_group",
    "leave",
    "name_job",
    "read_failure",
    "remaining",
    "silent_ranks",
    "start_heartbeat",
    "stop_heartbeat",
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
FAILURE_S = 3.5
"""Longest time a rank takes to find and record which rank was lost, once a wait for a peer
failed (reading heartbeats takes 2.5 s of it); See Note [one deadline]."""


class StepRefused(Exception):  # noqa: N818  # a marker, mixed into the refusals
    """Raised on every rank at once, before any message of the step (conveyor.runtime.
    fingerprint): nothing is in flight, so the pipeline stays usable (it is not abandoned)."""


class PeerLostError(RuntimeError):
    """A peer rank stopped answering (it crashed, was killed, is stopped or hung), or abandoned
    the step after an error of its own; the message names the rank and, when known, why."""

    def __init__(self, message: str, *, lost: int | None = None) -> None:
        super().__init__(message)
        self.lost = lost
        """The global rank that failed first (lost, or abandoning the step), when known."""


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
    places: tuple[tuple[int, str], ...] = ()
    """Where the two ranks sit on a mesh: (global rank, 'replica 1, stage 0') pairs."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Failure:
        fields = json.loads(text)
        fields["places"] = tuple((int(r), str(p)) for r, p in fields.get("places", ()))
        return cls(**fields)

    @property
    def culprit(self) -> int:
        """The rank that failed first: the one lost, or the one that abandoned the step."""
        return self.rank if self.lost is None else self.lost

    def name(self, rank: int) -> str:
        """Global ``rank`` as the messages name it, with its place on a mesh if recorded."""
        return _rank_name(rank, dict(self.places).get(rank, ""))

    def describe(self, name: Callable[[int], str] | None = None) -> str:
        """One sentence; ``name`` turns a global rank into how the reader knows it."""
        name = name or self.name
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
# also written to a file (FAILURES_ENV), which the launcher's summary reads. A failed wait
# names no one by itself: a timeout says only that the peer sent nothing, and the peer may be
# waiting in turn (for a stopped rank of its own pipeline, or of another replica); a broken
# connection does not say the peer died either, as a gloo wait that times out closes every
# connection of its group. So with no record yet, a rank reads every rank's heartbeat before
# it records anything, and records the rank that went silent.
#
# Note [rank names]:
# Messages name ranks by their global rank (torchrun's, the one in each rank's log), never by
# their rank in a pipeline's group: on a dp x pp mesh every replica has a pipeline rank 0.
# On a mesh a rank is also placed: 'rank 2 (replica 1, stage 0)'. Every rank of a mesh is one
# job (name_job): one failure record for all of them, one set of heartbeats, and closing one
# rank's groups ends the waits of every peer blocked on it, whichever group they wait in.
class Peers:
    """What this rank tells and learns about the other ranks of one pipeline transport (of its
    whole mesh, on a mesh).

    ``scope`` names the store record the ranks share (See Note [first lost rank]) unless the
    group is a mesh's, whose job has its own; messages name ranks by their global rank (See
    Note [rank names]).
    """

    def __init__(self, scope: str, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        """This rank in ``group``."""
        self.me = dist.get_rank()
        """This rank in the world, as messages name it."""
        self.job = _job_of(group) or _Job(scope, tuple(dist.get_process_group_ranks(group)))
        start_heartbeat()

    @property
    def scope(self) -> str:
        return self.job.scope

    def name(self, rank: int) -> str:
        """Global ``rank`` as messages name it: 'rank 2', on a mesh 'rank 2 (replica 1, stage
        0)'; See Note [rank names]."""
        return _rank_name(rank, self.job.where(rank))

    def lost(
        self, peer: int, doing: str, error: BaseException, timeout: timedelta
    ) -> PeerLostError:
        """The error for a wait on ``peer`` (a rank of ``group``) that failed with ``error``:
        names the rank lost first, the one whose heartbeat stopped, which may be another rank
        that ``peer`` waits for in turn; See Note [first lost rank]."""
        other = self._global(peer)
        first, silent = self._first(doing, error, [other], other)
        me, them = self.name(self.me), self.name(other)
        cause = _one_line(error)
        waited = f"waited at most {timeout.total_seconds():.0f}s"
        if first is None:  # its connection broke, yet every heartbeat goes on
            return PeerLostError(
                f"{me}: lost {them} while {doing} ({waited}): {cause}. {_capital(them)} closed "
                "its connections but is still running (its heartbeat goes on): it gave up after "
                "an error or a timeout of its own; check its log"
            )
        if first.lost is None:  # a rank abandoned the step: say why
            after = "" if first.rank == other else f" ({them} went down after it)"
            text = f"{me}: lost {them} while {doing}: {first.describe(self.name)}{after}. {_REMEDY}"
            return PeerLostError(text, lost=first.rank)
        lost = self.name(first.lost)
        if first.lost != other:  # a third rank, which ``peer`` waited for in turn
            if _timed_out(error):
                after = f"{them} sent nothing either ({waited}: {cause})"
            else:
                after = f"{them} went down after it ({cause})"
            if first.rank == self.me:  # this rank's reading of the heartbeats named it
                found = "its heartbeat stopped, so it is stopped, hung or gone"
            else:
                found = f"{first.describe(self.name)} first"
            return PeerLostError(
                f"{me}: lost {lost} while {doing}: {found}, and {after}; check its log",
                lost=first.lost,
            )
        text = f"{me}: lost {them} while {doing} ({waited}): {cause}."
        if silent == []:  # every heartbeat goes on
            text += (
                f" {_capital(them)} is still running (its heartbeat goes on) but sent nothing "
                "in time: it may be slower than timeout_s (raise it) or waiting elsewhere."
            )
        else:
            text += f" {_capital(them)} has likely crashed, been killed or stopped; check its log."
        if first.rank != self.me:
            text += f" {_capital(self.name(first.rank))} reported losing it first."
        return PeerLostError(text, lost=first.lost)

    def lost_in(
        self, ranks: Sequence[int], doing: str, error: BaseException, timeout: timedelta
    ) -> PeerLostError:
        """The error for a collective over the global ``ranks`` that failed with ``error``:
        names the rank that abandoned the step or went silent (its heartbeat stopped)."""
        first, silent = self._first(doing, error, ranks, None)
        me, cause = self.name(self.me), _one_line(error)
        waited = f"waited at most {timeout.total_seconds():.0f}s"
        if first is not None and silent is None:  # recorded already: a rank abandoned or lost
            lost = self.name(first.culprit)
            return PeerLostError(
                f"{me}: lost {lost} while {doing} ({first.describe(self.name)} first): {cause}",
                lost=first.culprit,
            )
        if first is not None:  # this call named it
            return PeerLostError(
                f"{me}: lost {self.name(first.culprit)} while {doing} ({waited}): its heartbeat "
                f"stopped, so it is stopped, hung or gone: {cause}",
                lost=first.culprit,
            )
        members = ", ".join(self.name(r) for r in sorted(ranks))
        head = f"{me}: a collective over {members} failed while {doing} ({waited}): {cause}"
        if silent is None:
            return PeerLostError(
                f"{head}. The store does not answer either, so the rank that hosts it "
                "(usually rank 0) may be the one lost"
            )
        return PeerLostError(
            f"{head}. Every other rank is still running: one may be slower than the timeout "
            "(raise timeout_s) or waiting elsewhere"
        )

    def abandoned(self, doing: str, error: BaseException) -> None:
        """Record that this rank gives up ``doing`` because of ``error`` (unless a failure is
        recorded already), for its peers' messages; a lost peer is recorded where it was
        found (``lost``, ``lost_in``), so this rank is then not the one that failed."""
        if isinstance(error, PeerLostError):
            return
        cause = f"{type(error).__name__}: {_one_line(error)}"
        record_failure(self.scope, Failure(self.me, None, doing, cause, self._places(self.me)))

    def watching(
        self,
        done: Callable[[float], bool],
        ranks: Sequence[int],
        doing: str,
        timeout: timedelta,
    ) -> None:
        """Wait until ``done(seconds)`` (which waits at most that long) is true, watching the
        heartbeats of the global ``ranks`` meanwhile: for work whose own waits restart their
        clock (a save in flight, whose write comes before its collectives). A rank silent for
        ``timeout``, or a loss another rank recorded, closes this rank's groups, which ends
        that work's waits, and raises.

        Raises:
            PeerLostError: naming the rank lost. See Note [one deadline].
        """
        store = default_store()
        others = [r for r in ranks if r != self.me]
        moved: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last moved)
        while not done(HEARTBEAT_S):
            first = read_record(self.scope)
            if first is not None and first.lost is not None:
                start_deadline()
                self.close_groups(lost=True)
                lost = self.name(first.lost)
                raise PeerLostError(
                    f"{self.name(self.me)}: lost {lost} while {doing} "
                    f"({first.describe(self.name)} first)",
                    lost=first.lost,
                )
            counts = None if store is None else _bounded(lambda: _beats(store, others))
            now = time.monotonic()
            for rank, count in zip(others, counts or [], strict=False):
                if moved.get(rank, (None, 0.0))[0] != count:
                    moved[rank] = (count, now)
            silent = [r for r, (_, at) in moved.items() if now - at >= timeout.total_seconds()]
            if silent:
                places = self._places(self.me, silent[0])
                mine = Failure(self.me, silent[0], doing, "its heartbeat stopped", places)
                first = record_failure(self.scope, mine) or mine
                start_deadline()
                self.close_groups(lost=True)
                waited = f"silent for {timeout.total_seconds():.0f}s"
                raise PeerLostError(
                    f"{self.name(self.me)}: lost {self.name(first.culprit)} while {doing} "
                    f"({waited}): its heartbeat stopped, so it is stopped, hung or gone",
                    lost=first.culprit,
                )

    def close_with(self, close: Callable[[], None], *, on_abandon: bool) -> None:
        """Call ``close`` (it closes a group this rank waits in) once, when this rank finds a
        peer lost, or, with ``on_abandon``, gives up a step too; See Note [one deadline]."""
        with self.job.lock:
            self.job.closers.append((close, on_abandon))

    def forget(self, close: Callable[[], None]) -> None:
        """Stop holding ``close`` (registered with ``close_with``): its owner destroyed the
        group, which torch frees only once nothing refers to it."""
        with self.job.lock:
            self.job.closers = [c for c in self.job.closers if c[0] is not close]

    def close_groups(self, lost: bool) -> None:
        """Close the groups registered with ``close_with``: every one when a peer is ``lost``,
        else those of the step (the others may still finish: a save in flight)."""
        with self.job.lock:
            closing = [close for close, on_abandon in self.job.closers if lost or on_abandon]
            self.job.closers = [c for c in self.job.closers if c[0] not in closing]
        for close in closing:
            try:
                close()
            except Exception as error:  # a group destroyed already
                logger.debug("[rank %d] could not close a group: %s", self.me, error)

    def _first(
        self, doing: str, error: BaseException, ranks: Sequence[int], peer: int | None
    ) -> tuple[Failure | None, list[int] | None]:
        """The job's first failure on record, else this rank's, recorded now (None if the
        heartbeats name no one), and the silent ranks (None if no heartbeat was read).

        A rank that learns of a lost peer closes its groups, so every peer waiting on it fails
        at once (See Note [one deadline]). ``peer``: the one rank waited on, whose broken
        connection names it; after a timeout, or in a collective, the heartbeats decide.
        """
        silent: list[int] | None = None
        with _budget(FAILURE_S):  # every store call of it, however slow the store
            first = read_record(self.scope)
            if first is None:
                until = start_deadline()
                with _held(self.job.naming, until):  # one thread names it, others read it
                    first = read_record(self.scope)
                    if first is None:
                        first, silent = self._record(doing, error, ranks, peer)
        if first is not None and first.lost is not None:
            start_deadline()
            self.close_groups(lost=True)
        return first, silent

    def _record(
        self, doing: str, error: BaseException, ranks: Sequence[int], peer: int | None
    ) -> tuple[Failure | None, list[int] | None]:
        # a broken connection does not name the rank lost either: a gloo wait that times out
        # closes every connection of its group, so the rank waiting on a stopped peer breaks
        # its other peers' connections before it has recorded anything
        others = sorted((set(self.job.ranks) | set(ranks)) - {self.me})
        silent = silent_ranks(others)
        if silent is None:  # no heartbeats: the rank waited on, if any
            lost = peer
        elif silent:
            lost = peer if peer in silent else silent[0]
        else:  # every heartbeat goes on: a peer that sent nothing in time is hung
            lost = peer if _timed_out(error) else None
        if lost is None:
            return None, silent
        mine = Failure(self.me, lost, doing, _one_line(error), self._places(self.me, lost))
        return record_failure(self.scope, mine) or mine, silent

    def _places(self, *ranks: int) -> tuple[tuple[int, str], ...]:
        return tuple((r, self.job.where(r)) for r in ranks if self.job.where(r))

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


_REMEDY = (
    "Fix that error; the pipeline's connections are closed, so create a new Pipeline on "
    "every rank to go on"
)


def _rank_name(rank: int, place: str) -> str:
    return f"rank {rank} ({place})" if place else f"rank {rank}"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _timed_out(error: BaseException) -> bool:
    """Whether a backend's ``error`` is a timeout (the peer may be alive), not a connection
    that broke (the peer's process died, or it closed its connections)."""
    text = str(error).lower()
    if "pair closure" in text:  # gloo's word for a connection its peer closed
        return False
    return "timed out" in text or "timeout" in text


_PEER_WORDS = ("connection", "closed", "timed out", "timeout", "reset", "broken pipe", "peer")
"""Words of gloo's and NCCL's errors for a peer that left or went silent."""


def about_a_peer(error: BaseException, *, backend_only: bool = False) -> bool:
    """Whether ``error`` says a peer left or went silent (a backend's timeout or broken
    connection), not that this rank's own call was wrong; ``backend_only``: and it comes from
    the backend itself (gloo, NCCL), not from code that only words an error so."""
    if not isinstance(error, RuntimeError) or isinstance(error, PeerLostError):
        return False
    text = str(error).lower()
    if backend_only and not (
        isinstance(error, dist.DistError) or any(mark in text for mark in _BACKEND_MARKS)
    ):
        return False
    return any(word in text for word in _PEER_WORDS)


_BACKEND_MARKS = ("gloo", "nccl", "caused pair closure")
"""Text of the backends' own errors: gloo's name their source file, and a wait that a closed
group ended says 'Application timeout caused pair closure'."""


# Note [one deadline]:
# One stopped peer makes a rank wait in several places, one after the other or at once: the
# step's messages (each wait bounded by timeout_s), the mesh's collectives (their group's
# timeout, from their own start), the checkpoint's background save (its write, then DCP's
# collectives, then its own gather and broadcast). Each restarting its clock, the ranks exited
# up to 1.5 x timeout_s after the stop (27.6-31 s at timeout_s = 20). So a failure has one
# deadline:
# - the first wait that fails in a process, in any thread, starts it, FAILURE_S ahead: the
#   time to read the heartbeats and record who was lost. Another thread that fails meanwhile
#   waits for that record instead of reading the heartbeats again, and a wait or a store call
#   that starts meanwhile gets what is left, never a new timeout_s (``remaining``);
# - once the loss is known (found, or read from the record), the rank closes every group it
#   may be blocked in: the pipeline's, the mesh's, the checkpoint's (``close_with``). That
#   ends its own waits in flight, in every thread, and the waits of every peer blocked on it,
#   which learn the loss from the record and close theirs in turn: the news crosses the mesh
#   at once;
# - a wait whose work comes before its peers' (the training thread waiting for a save in
#   flight, whose write may take longer than timeout_s before its collectives start) watches
#   the heartbeats instead (``watching``): a rank silent for timeout_s is lost, however long
#   the write took.
# Every other rank then exits within timeout_s + FAILURE_S of the stop, plus what exiting
# takes. A rank that gives up a step after an error of its own closes only the step's groups:
# a save in flight may still finish.
_deadline: tuple[Any, float] | None = None
"""The failure deadline (time.monotonic()) of this process, with the world it is in."""
_deadline_lock = threading.Lock()


def start_deadline() -> float:
    """This process's failure deadline: started FAILURE_S ahead by the first failure (a new
    one once it has passed, or in a new world); See Note [one deadline]."""
    global _deadline
    with _deadline_lock:
        now, world = time.monotonic(), dist.group.WORLD
        if _deadline is None or _deadline[0] is not world or _deadline[1] <= now:
            _deadline = (world, now + FAILURE_S)
        return _deadline[1]


def remaining(timeout: timedelta) -> timedelta:
    """How long a wait for peers that starts now may take: ``timeout``, or while a failure is
    being told (See Note [one deadline]), what is left of its deadline."""
    deadline = _deadline
    if deadline is None or deadline[0] is not dist.group.WORLD:
        return timeout
    left = deadline[1] - time.monotonic()
    if left <= 0:
        return timeout
    return min(timeout, timedelta(seconds=left))


@contextlib.contextmanager
def _held(lock: threading.Lock, until: float) -> Iterator[None]:
    """``lock`` for the body, waiting for it at most until ``until`` (then without it)."""
    taken = lock.acquire(timeout=max(0.0, until - time.monotonic()))
    try:
        yield
    finally:
        if taken:
            lock.release()


@dataclass(eq=False)
class _Job:
    """The ranks whose waits fail together: one pipeline, or every rank of a mesh."""

    scope: str
    """The store key of their first failure; See Note [first lost rank]."""
    ranks: tuple[int, ...]
    """Their global ranks, whose heartbeats tell which one went silent."""
    place: Callable[[int], str] = lambda rank: ""
    """Where a global rank sits, for messages ('replica 1, stage 0'; '' off a mesh)."""
    closers: list[tuple[Callable[[], None], bool]] = field(default_factory=list)
    """What closes this rank's groups, and whether to close them on an abandoned step too."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while the closers change."""
    naming: threading.Lock = field(default_factory=threading.Lock)
    """Held by the thread that names a failure from the heartbeats."""

    def where(self, rank: int) -> str:
        try:
            return self.place(rank)
        except Exception:  # a message must not fail for want of a place
            return ""


_JOBS: dict[str, tuple[Any, _Job]] = {}
"""The job of each mesh group, by group name, with the world it is in (a new world names its
groups anew)."""


def name_job(
    groups: Iterable[dist.ProcessGroup],
    scope: str,
    ranks: Sequence[int],
    place: Callable[[int], str],
) -> None:
    """Make the Peers of every group of ``groups`` (a mesh's) one job: the failure record
    ``scope``, the heartbeats of the global ``ranks``, and messages that ``place`` each rank;
    closing this rank's ``groups`` ends the waits of every peer blocked on it. See Note [rank
    names]."""
    groups = list(groups)
    job = _Job(scope, tuple(ranks), place)
    job.closers = [(_closing(group), True) for group in groups]
    for group in groups:
        _JOBS[group.group_name] = (dist.group.WORLD, job)


def _closing(group: dist.ProcessGroup) -> Callable[[], None]:
    return lambda: close_group(group)


def _job_of(group: dist.ProcessGroup | None) -> _Job | None:
    if group is None:
        return None
    world, job = _JOBS.get(group.group_name, (None, None))
    return job if world is dist.group.WORLD else None


def close_group(group: dist.ProcessGroup) -> None:
    """Close this rank's connections in ``group`` if it is gloo's (conveyor.torch_compat), so
    every wait on them, here and on the peers, fails at once."""
    if dist.get_backend(group) == "gloo":
        close_gloo_group(group)


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
_stopping = threading.Event()
"""Set at interpreter exit to stop the heartbeat; See Note [threads at exit]."""


# Note [threads at exit]:
# A daemon thread inside a call into torch's C++ that released the GIL (a store call) when the
# interpreter finalizes is ended as it takes the GIL back: Python 3.11 calls pthread_exit,
# whose unwinding through pybind11's GIL guard (a noexcept destructor) calls std::terminate,
# so a run that succeeded dies with "terminate called without an active exception" (SIGABRT).
# The heartbeat's first beat waits for the GIL while the main thread builds the Pipeline, so
# a script that ended soon after building one, without destroy_process_group, aborted in 13
# of 50 runs under torchrun (auto_split or balance alike). So the heartbeat beats until an
# atexit handler, which runs before finalization, stops it and waits for its store call.
# torch's gloo worker threads do the same: a worker frees a collective's tensors after its wait
# returned, taking the GIL for those whose Python objects are gone, and jobs that exited as a
# Checkpointer's save finished still aborted in 4 of 39 runs. torch joins a group's threads when
# the group is destroyed and nothing refers to it, so a Checkpointer destroys its group when it
# is closed, and is closed at exit. The pipeline's direction groups carry only point-to-point
# messages, which those threads never run. A collective on another group (the user's world,
# data parallelism's) leaves the same short window after it, as it does without conveyor: a
# `conveyor generate` rank aborted so after printing its tokens (once, in a whole suite run).
# conveyor's own rank entry points (the demo's, generate's) therefore end with ``leave``: the
# exit handlers run and the output is flushed, then the process ends without finalizing the
# interpreter, the one moment a thread taking the GIL is killed.
def start_heartbeat() -> None:
    """Beat in the store every HEARTBEAT_S from a daemon thread (once per process, stopped at
    exit), so ``silent_ranks`` can tell a stopped or hung rank from a busy one."""
    global _heartbeat
    if _heartbeat is None or not _heartbeat.is_alive():
        if _heartbeat is None:
            atexit.register(stop_heartbeat)
        _stopping.clear()
        _heartbeat = threading.Thread(target=_beat, name="conveyor-heartbeat", daemon=True)
        _heartbeat.start()


def leave(code: int) -> NoReturn:
    """End this rank's process with ``code`` once its work is done: exit handlers run and
    output is flushed, the interpreter is not finalized (See Note [threads at exit]). For
    entry points conveyor owns, never for a user's script."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def stop_heartbeat() -> None:
    """Stop the heartbeat and wait (at most STORE_WAIT_S) for its store call to return; runs
    at exit, before the interpreter finalizes. See Note [threads at exit]."""
    _stopping.set()
    if _heartbeat is not None and _heartbeat is not threading.current_thread():
        _heartbeat.join(STORE_WAIT_S)


def _beat() -> None:
    while not _stopping.is_set():
        store = default_store()
        if store is not None:
            # the world may be gone or changing: beat again in the next one
            with contextlib.suppress(Exception):
                store.add(_heartbeat_key(dist.get_rank()), 1)
        del store
        _stopping.wait(HEARTBEAT_S)


def silent_ranks(ranks: Sequence[int], wait_s: float = 2.5 * HEARTBEAT_S) -> list[int] | None:
    """The global ``ranks`` whose heartbeat did not move in ``wait_s`` seconds (stopped, hung
    or dead); None if the store does not answer. Takes ``wait_s``."""
    store = default_store()
    if store is None:
        return None

    def counts() -> list[int]:
        return [store.add(_heartbeat_key(r), 0) for r in ranks]

    before = _bounded(counts)
    if before is None:  # no answer: do not wait for another
        return None
    time.sleep(wait_s)
    after = _bounded(counts)
    if before is None or after is None:
        return None
    return [r for r, a, b in zip(ranks, before, after, strict=True) if a == b]


def _heartbeat_key(rank: int) -> str:
    return f"conveyor/heartbeat/{rank}"


def _beats(store: Any, ranks: Sequence[int]) -> list[int]:
    """The heartbeat counts of ``ranks`` (0 for a rank that never beat)."""
    return [int(store.add(_heartbeat_key(r), 0)) for r in ranks]


_budgets = threading.local()
"""Per thread, when its store calls must be done by (``until``), while it names a failure."""


@contextlib.contextmanager
def _budget(seconds: float) -> Iterator[None]:
    """Store calls in the body (``_bounded``) end within ``seconds`` in all: the store's host
    may be the rank lost, and naming a failure must not outlast its deadline."""
    _budgets.until = time.monotonic() + seconds
    try:
        yield
    finally:
        _budgets.until = None


def _bounded(call: Callable[[], _T], wait_s: float | None = None) -> _T | None:
    """``call()``, or None if it raises or takes longer than ``wait_s`` (default STORE_WAIT_S,
    or what is left of this thread's budget: See Note [one deadline]); it then finishes, or
    not, in a daemon thread that does not keep the process alive."""
    if wait_s is None:
        until = getattr(_budgets, "until", None)
        left = STORE_WAIT_S if until is None else until - time.monotonic()
        wait_s = min(STORE_WAIT_S, max(0.05, left))
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
