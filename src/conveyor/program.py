"""Actions and Programs: what each rank does in one step, as plain data."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from conveyor.graph import StageGraph

__all__ = [
    "Action",
    "Feedback",
    "Kind",
    "Program",
    "Schedule",
    "ScheduleMismatch",
    "add_communication",
    "last_weight_actions",
    "matching_recv",
    "matching_send",
    "receives_needed",
    "sends_after",
]


class Kind(enum.Enum):
    """What an action does. Compute kinds are one letter; communication kinds two."""

    F = "F"  # forward
    B = "B"  # full backward: input and weight gradients
    I = "I"  # noqa: E741  backward for the input gradient only (weight gradient deferred)
    W = "W"  # weight gradient of an earlier I
    SEND_F = "SF"  # send forward outputs to a consumer stage
    RECV_F = "RF"  # receive forward inputs from a producer stage
    SEND_B = "SB"  # send input gradients back to a producer stage
    RECV_B = "RB"  # receive output gradients from a consumer stage

    @property
    def is_compute(self) -> bool:
        return len(self.value) == 1

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_F, Kind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_F, Kind.RECV_B)


_ACTION_RE = re.compile(r"^(\d+)(F|B|I|W|SF|RF|SB|RB)(\d+)(?:([<>])(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's program, written compactly: ``1F0`` is stage 1, forward, micro-batch 0.

    Communication names the peer stage: ``0SF0>1`` (stage 0 sends micro-batch 0's activations
    to stage 1), ``1RF0<0`` (stage 1 receives them), ``1SB0>0`` and ``0RB0<1`` for gradients.
    ``str`` and ``Action.parse`` are inverses.
    """

    stage: int
    kind: Kind
    microbatch: int
    peer: int | None = None
    """The other stage of a send or receive; None for compute."""

    def __post_init__(self) -> None:
        if self.kind.is_compute != (self.peer is None):
            raise ValueError(
                f"{self.kind.name} action needs "
                f"{'no peer' if self.kind.is_compute else 'a peer stage'}"
            )

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.peer is None:
            return text
        return f"{text}{'>' if self.kind.is_send else '<'}{self.peer}"

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the compact form (``1F0``, ``0SF0>1``); raises ValueError naming the text."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected <stage><kind><microbatch>, kind one of "
                "F B I W (compute) or SF RF SB RB followed by >peer or <peer, e.g. '1F0', '0SF0>1'"
            )
        stage, kind, microbatch, arrow, peer = match.groups()
        action_kind = Kind(kind)
        if arrow is not None and (arrow == ">") != action_kind.is_send:
            raise ValueError(f"action {text!r}: sends use '>' and receives use '<'")
        return cls(int(stage), action_kind, int(microbatch), None if peer is None else int(peer))

    @classmethod
    def read(cls, text: str) -> Action | None:
        """The action ``text`` names, or None for text that names none (a timeline's waits,
        reductions and recomputations)."""
        try:
            return cls.parse(text)
        except ValueError:
            return None


Schedule = Callable[[StageGraph, int], "Program"]
"""A schedule: (stage graph, number of micro-batches) -> Program."""


class ScheduleMismatch(ValueError):  # noqa: N818  # read as "a schedule mismatch"
    """A schedule cannot run a graph as it is placed (a branch where it runs chains, several
    stages on a rank where it runs one); conveyor.schedule.registry adds which schedules can."""


# Note [decode programs]:
# Generation is a Program too. Its micro-batches are *items*: one pass of a group of sequences
# through every stage, for a chunk of their prompts or for one new token. Two things set a
# decode program apart from a forward-only one, and ``Feedback`` says both:
# - the token the last stage samples from item k is the input of a later item of the same
#   group at the first stage: a message against the pipeline's direction, written as an
#   ordinary send and receive of item k (``1SF4>0``, ``0RF4<1``) and waited for by that later
#   item's forward like any other input;
# - every stage keeps one KV cache per group, which each of the group's items extends, so a
#   stage must run a group's items in index order.
# ``validate`` checks both, ``simulate`` and the runtimes wait for the feedback as for any
# message, and a Timeline records it like any other action.
@dataclass(frozen=True)
class Feedback:
    """How the items of a decode program depend on each other; See Note [decode programs]."""

    sources: tuple[int | None, ...]
    """Per micro-batch (item): the earlier item whose sampled token is its input at stage 0,
    or None for an item that takes the model inputs (a chunk of the prompts)."""
    groups: tuple[int, ...]
    """Per micro-batch: its group of sequences; a stage runs a group's items in index order."""

    @cached_property
    def fed(self) -> frozenset[int]:
        """Items whose sampled token some later item takes."""
        return frozenset(s for s in self.sources if s is not None)


@dataclass(frozen=True)
class Program:
    """Each rank's ordered actions for one step. Indexing gives one rank's actions."""

    ranks: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    feedback: Feedback | None = None
    """Decode programs only: tokens fed back from the last stage to the first."""

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]

    @cached_property
    def has_split_backward(self) -> bool:
        """Whether backward is split into I and W (zero-bubble schedules) on some rank."""
        return any(a.kind is Kind.W for actions in self.ranks for a in actions)

    def __len__(self) -> int:
        return len(self.ranks)

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.ranks)

    def __str__(self) -> str:
        return "\n".join(" ".join(str(a) for a in actions) for actions in self.ranks)

    def compute_only(self) -> Program:
        """The same program without its sends and receives."""
        ranks = tuple(tuple(a for a in actions if a.is_compute) for actions in self.ranks)
        return Program(ranks, self.num_microbatches, self.feedback)

    @classmethod
    def parse(cls, text: str, num_microbatches: int | None = None) -> Program:
        """Parse one line of space-separated actions per rank (``rank 0:`` prefixes allowed).

        Blank lines and ``#`` comments are ignored. The micro-batch count defaults to one more
        than the largest micro-batch index.
        """
        ranks: list[tuple[Action, ...]] = []
        for raw in text.splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if ":" in line:
                line = line.split(":", 1)[1]
            ranks.append(tuple(Action.parse(word) for word in line.split()))
        if not ranks:
            raise ValueError("schedule text has no actions; expected one line of actions per rank")
        if num_microbatches is None:
            num_microbatches = 1 + max(a.microbatch for actions in ranks for a in actions)
        return cls(tuple(ranks), num_microbatches)


def last_weight_actions(actions: Sequence[Action]) -> dict[int, int]:
    """{index of the last action adding to each stage's weight gradients (its last B or W)
    in one rank's ``actions``: that stage}. Data parallelism reduces the stage's gradients
    right after it, in the runtime and in the simulator alike."""
    last = {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.B, Kind.W)}
    return {i: s for s, i in last.items()}


def receives_needed(
    graph: StageGraph, action: Action, feedback: Feedback | None = None
) -> list[Action]:
    """Receives a compute action waits for: inputs for F (with ``feedback``, stage 0's fed-back
    token too), output gradients for B and I."""
    rank = graph.rank_of(action.stage)
    if action.kind is Kind.F:
        peers, kind = graph.producers(action.stage), Kind.RECV_F
    elif action.kind in (Kind.B, Kind.I):
        peers, kind = graph.consumers(action.stage), Kind.RECV_B
    else:
        return []
    needed = [
        Action(action.stage, kind, action.microbatch, p) for p in peers if graph.rank_of(p) != rank
    ]
    if feedback is not None and action.kind is Kind.F and action.stage == 0:
        source = feedback.sources[action.microbatch]
        if source is not None and graph.rank_of(graph.sink) != rank:
            needed.append(Action(0, Kind.RECV_F, source, graph.sink))
    return needed


def sends_after(
    graph: StageGraph, action: Action, feedback: Feedback | None = None
) -> list[Action]:
    """Sends that follow a compute action: outputs after F (with ``feedback``, the last
    stage's sampled token to stage 0 too), input gradients after B and I."""
    rank = graph.rank_of(action.stage)
    if action.kind is Kind.F:
        peers, kind = graph.consumers(action.stage), Kind.SEND_F
    elif action.kind in (Kind.B, Kind.I):
        peers, kind = graph.producers(action.stage), Kind.SEND_B
    else:
        return []
    sends = [
        Action(action.stage, kind, action.microbatch, p) for p in peers if graph.rank_of(p) != rank
    ]
    if (
        feedback is not None
        and action.kind is Kind.F
        and action.stage == graph.sink
        and action.microbatch in feedback.fed
        and graph.rank_of(0) != rank
    ):
        sends.append(Action(action.stage, Kind.SEND_F, action.microbatch, 0))
    return sends


def matching_recv(send: Action) -> Action:
    """The receive that gets ``send``'s message: ``0SF0>1`` -> ``1RF0<0``."""
    kind = Kind.RECV_F if send.kind is Kind.SEND_F else Kind.RECV_B
    assert send.peer is not None
    return Action(send.peer, kind, send.microbatch, send.stage)


def matching_send(recv: Action) -> Action:
    """The send whose message ``recv`` gets: ``1RF0<0`` -> ``0SF0>1``."""
    kind = Kind.SEND_F if recv.kind is Kind.RECV_F else Kind.SEND_B
    assert recv.peer is not None
    return Action(recv.peer, kind, recv.microbatch, recv.stage)


# Note [receive placement]:
# A receive is posted (non-blocking) before the compute that needs it; the compute waits.
# Per pair of ranks, messages are matched in the order they were sent (as NCCL does), so a
# rank posts each channel's receives in its sender's order. A receive is posted ``prefetch``
# computes ahead of the earliest compute that needs it or any later message of its channel;
# a gradient's receive not before the forward it answers, whose outputs give its shapes.
# Early matters: on gloo, a message whose receive is posted after it was sent moves only
# when the sender next blocks, which measured 3-10 ms late while the sender computes; with
# three computes ahead the receive is usually there first (measured side by side:
# interleaved-1f1b steps 6-12% faster than with one). The price is up to three received
# inputs held early. With prefetch=1:
#   rank 1:  1RF0<0 1RF1<0 | 1F0 1SF0>2 | 1RB0<2 | 1F1 ...
def add_communication(
    graph: StageGraph,
    compute: Sequence[Sequence[Action]],
    num_microbatches: int,
    prefetch: int = 3,
    feedback: Feedback | None = None,
) -> Program:
    """Insert the sends and receives that a compute-only program needs.

    Sends follow the compute that produces them; receives are placed per Note
    [receive placement]. The result still needs ``validate``.
    """
    sends_by_channel: dict[tuple[int, int], list[Action]] = {}
    for rank_actions in compute:
        for action in rank_actions:
            for send in sends_after(graph, action, feedback):
                assert send.peer is not None
                channel = (graph.rank_of(send.stage), graph.rank_of(send.peer))
                sends_by_channel.setdefault(channel, []).append(send)
    ranks = []
    for rank, rank_actions in enumerate(compute):
        position = {
            need: i
            for i, a in enumerate(rank_actions)
            for need in receives_needed(graph, a, feedback)
        }
        forward_at = {
            (a.stage, a.microbatch): i for i, a in enumerate(rank_actions) if a.kind is Kind.F
        }
        post_at: dict[int, list[Action]] = {}
        for (_, dst), sends in sorted(sends_by_channel.items()):
            if dst != rank:
                continue
            recvs = [matching_recv(send) for send in sends]
            deadlines: list[int] = []
            deadline = len(rank_actions)
            for recv in reversed(recvs):  # a receive must precede every later one's consumer
                deadline = min(deadline, position.get(recv, len(rank_actions)))
                deadlines.insert(0, deadline)
            at = 0
            for recv, deadline in zip(recvs, deadlines, strict=True):
                # a gradient's buffer is shaped by the forward it answers: post after that
                earliest = (
                    forward_at.get((recv.stage, recv.microbatch), -1) + 1
                    if recv.kind is Kind.RECV_B
                    else 0
                )
                at = max(at, deadline - prefetch, earliest)
                post_at.setdefault(at, []).append(recv)
        actions: list[Action] = []
        for i, action in enumerate(rank_actions):
            actions += post_at.pop(i, [])
            actions.append(action)
            actions += sends_after(graph, action, feedback)
        for rest in post_at.values():  # receives nobody consumes; validate reports them
            actions += rest
        ranks.append(tuple(actions))
    return Program(tuple(ranks), num_microbatches, feedback)
