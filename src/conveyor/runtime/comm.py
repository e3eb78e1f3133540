"""Point-to-point transport of pytrees between ranks of a pipeline process group."""

from __future__ import annotations

import functools
import logging
import pickle
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from conveyor.runtime.peers import Peers, StepRefused, about_a_peer, read_record, remaining
from conveyor.torch_compat import close_gloo_group, pytree
from conveyor.trace import Recorder

__all__ = ["P2P", "LeafMeta", "Meta", "Receive"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeafMeta:
    """A pytree leaf as the receiver needs to know it: a tensor's shape and dtype, or a value."""

    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    requires_grad: bool = False
    constant: Any = None
    """The leaf itself when it is not a tensor (ints, strings, None travel in the header)."""

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def nbytes(self) -> int:
        if self.shape is None or self.dtype is None:
            return 0
        return _numel(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Meta:
    """Structure, shapes and dtypes of a message; sent once per input signature."""

    spec: pytree.TreeSpec
    leaves: tuple[LeafMeta, ...]

    @classmethod
    def of(cls, value: Any) -> Meta:
        leaves, spec = pytree.tree_flatten(value)
        return cls(
            spec,
            tuple(
                LeafMeta(tuple(leaf.shape), leaf.dtype, leaf.requires_grad)
                if isinstance(leaf, torch.Tensor)
                else LeafMeta(constant=leaf)
                for leaf in leaves
            ),
        )

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def grad_indices(self) -> list[int]:
        """Leaves that carry a gradient back: tensors that require one."""
        return [i for i, leaf in enumerate(self.leaves) if leaf.requires_grad]


@dataclass(eq=False)
class Receive:
    """A posted receive: its buffers fill in the background until ``P2P.wait``."""

    src: int
    describe: str
    meta: Meta | None
    same_as: Receive | None = None
    """An earlier receive on this channel whose header describes this one too."""
    works: list[dist.Work] = field(default_factory=list)
    buffers: list[torch.Tensor | None] = field(default_factory=list)
    started: bool = False


class P2P:
    """Non-blocking sends and in-order receives with a group-relative rank for each peer.

    Receives from one peer are posted in the order the peer sends (See Note [receive
    placement]); a receive whose shapes are not known yet waits for the sender's header, and
    receives behind it on the same channel wait their turn, so the order holds.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, device: torch.device, timeout: timedelta
    ) -> None:
        self.group = group
        self.device = device
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self._upward, self._downward = _directions(group, timeout)
        """Groups for messages to higher and to lower ranks (None: ``group`` both ways);
        See Note [a group per direction]."""
        channel = self._upward or group or dist.group.WORLD
        assert channel is not None
        self.peers = Peers(_scope(channel), group)
        """Names lost peers and records failures; See Note [first lost rank]."""
        self.check_open()
        groups = [self._upward, self._downward] if self._upward is not None else [group]
        closed = [g for g in groups if g is not None and dist.get_backend(g) == "gloo"]
        self.peers.close_with(
            functools.partial(_close_transport, closed, self._upward), on_abandon=True
        )
        self._queues: dict[int, deque[Receive]] = {}
        self._sends: list[tuple[dist.Work, int, str, torch.Tensor]] = []
        self.recorder: Recorder | None = None
        """Set to record waits and bytes sent (conveyor.trace); None costs nothing."""
        self.given_up: str | None = None
        """What this rank gave up after an error (a step, a generation), and why; its
        connections are closed then. See Note [abandoned step]."""

    def send(self, value: Any, dst: int, describe: str, header: Meta | None = None) -> None:
        """Start sending ``value`` to group rank ``dst``, preceded by ``header`` if given."""
        if header is not None:
            encoded = torch.frombuffer(bytearray(pickle.dumps(header)), dtype=torch.uint8)
            self._isend(torch.tensor([encoded.numel()]), dst, describe)
            self._isend(encoded, dst, describe)
        tensors = [
            _as_bytes(leaf.detach())
            for leaf in pytree.tree_leaves(value)
            if isinstance(leaf, torch.Tensor) and leaf.numel() > 0
        ]
        sent = sum(t.numel() for t in tensors)
        if len(tensors) > 1:  # one message, not one per tensor: See Note [one message]
            offsets, total = _packing([t.numel() for t in tensors])
            packed = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
            for tensor, offset in zip(tensors, offsets, strict=True):
                packed[offset : offset + tensor.numel()].copy_(tensor)
            tensors = [packed]
        for tensor in tensors:
            self._isend(tensor, dst, describe)
        if self.recorder is not None:
            self.recorder.sent(sent)

    def post(
        self, src: int, meta: Meta | None, describe: str, same_as: Receive | None = None
    ) -> Receive:
        """Post a receive from group rank ``src``.

        With ``meta=None`` a header comes first, unless ``same_as`` names an earlier receive
        whose header holds for this one too.
        """
        receive = Receive(src, describe, meta, same_as)
        queue = self._queues.setdefault(src, deque())
        if meta is not None and not queue:
            self._start(receive)
        else:
            queue.append(receive)
        return receive

    def wait(self, receive: Receive) -> Any:
        """Block until ``receive`` has arrived and return its value."""
        queue = self._queues[receive.src]
        start = 0.0 if self.recorder is None else self.recorder.now()
        while not receive.started:
            pending = queue.popleft()
            if pending.meta is None:
                pending.meta = (
                    pending.same_as.meta
                    if pending.same_as is not None
                    else self._recv_header(pending)
                )
            self._start(pending)
        for work in receive.works:
            self._wait(work, receive.src, f"receiving {receive.describe}")
        assert receive.meta is not None
        if self.recorder is not None:
            self.recorder.wait(receive.describe, start, self.recorder.now(), receive.meta.nbytes)
        leaves = []
        packed = sum(b is not None for b in receive.buffers) > 1
        for leaf, buffer in zip(receive.meta.leaves, receive.buffers, strict=True):
            if not leaf.is_tensor:
                leaves.append(leaf.constant)
                continue
            assert leaf.shape is not None and leaf.dtype is not None
            tensor = (
                torch.empty(leaf.shape, dtype=leaf.dtype, device=self.device)
                if buffer is None
                else buffer.view(leaf.dtype).view(leaf.shape)
            )
            if packed:  # its own storage: a view would keep the whole message alive
                tensor = tensor.clone()
            leaves.append(tensor.requires_grad_(leaf.requires_grad))
        return pytree.tree_unflatten(leaves, receive.meta.spec)

    def wait_sends(self) -> None:
        """Block until every started send has been delivered."""
        sends, self._sends = self._sends, []
        start = 0.0 if self.recorder is None else self.recorder.now()
        for work, dst, describe, _ in sends:
            self._wait(work, dst, f"sending {describe}")
        if self.recorder is not None and sends:
            self.recorder.wait("sends", start, self.recorder.now())

    def _start(self, receive: Receive) -> None:
        """Post the transfer of ``receive``: one buffer, cut into a view per tensor leaf."""
        assert receive.meta is not None
        sizes = [leaf.nbytes for leaf in receive.meta.leaves if leaf.is_tensor and leaf.nbytes]
        offsets, total = _packing(sizes)
        buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
        if sizes:
            receive.works.append(self._irecv(buffer, receive.src, receive.describe))
        places = iter(zip(offsets, sizes, strict=True))
        for leaf in receive.meta.leaves:
            if not leaf.is_tensor or leaf.nbytes == 0:
                receive.buffers.append(None)
                continue
            offset, size = next(places)
            receive.buffers.append(buffer[offset : offset + size])
        receive.started = True

    def _recv_header(self, receive: Receive) -> Meta:
        doing = f"receiving the header of {receive.describe}"
        size = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(self._irecv(size, receive.src, receive.describe), receive.src, doing)
        header = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._wait(self._irecv(header, receive.src, receive.describe), receive.src, doing)
        with warnings.catch_warnings():  # torch's own TreeSpec unpickling warns about itself
            warnings.simplefilter("ignore", FutureWarning)
            meta = pickle.loads(header.cpu().numpy().tobytes())
        assert isinstance(meta, Meta)
        return meta

    def _isend(self, tensor: torch.Tensor, dst: int, describe: str) -> None:
        tensor = tensor.to(self.device)
        with self._naming_lost(dst, f"sending {describe}"):
            way = self._upward if dst > self.rank else self._downward
            work = dist.isend(tensor, group=way or self.group, group_dst=dst)
        assert work is not None
        self._sends.append((work, dst, describe, tensor))  # keep the tensor alive until sent

    def _irecv(self, buffer: torch.Tensor, src: int, describe: str) -> dist.Work:
        with self._naming_lost(src, f"receiving {describe}"):
            way = self._upward if src < self.rank else self._downward
            work = dist.irecv(buffer, group=way or self.group, group_src=src)
        assert work is not None
        return work

    def _wait(self, work: dist.Work, peer: int, doing: str) -> None:
        with self._naming_lost(peer, doing):
            work.wait(remaining(self.timeout))  # See Note [one deadline]

    @contextmanager
    def _naming_lost(self, peer: int, doing: str) -> Iterator[None]:
        """Turn the backend's error for a dead or silent peer into one that names the peer."""
        try:
            yield
        except RuntimeError as error:
            raise self.peers.lost(peer, doing, error, self.timeout) from error

    def abandon(self, doing: str, error: BaseException) -> None:
        """Give up ``doing`` (a step) after ``error``: record why, then close this rank's
        connections (the step's groups: this transport's, the mesh's), so every peer waiting
        on it fails at once; See Note [abandoned step]."""
        self.peers.abandoned(doing, error)
        self.peers.close_groups(lost=False)

    @contextmanager
    def abandoning(self, doing: str) -> Iterator[None]:
        """Around work whose messages may be in flight: on any error (Ctrl-C too) but a
        refusal of every rank at once, record what was given up and why (``given_up``) and
        ``abandon``, so the peers do not wait for this rank; the error goes on, a backend's
        raw error for a lost peer (a collective inside the work: DDP's reducer, tensor
        parallelism) as the PeerLostError that names the rank lost."""
        try:
            yield
        except StepRefused:
            raise
        except BaseException as error:
            raised = error
            if about_a_peer(error, backend_only=True):
                ranks = self.peers.job.ranks
                raised = self.peers.lost_in(ranks, f"running {doing}", error, self.timeout)
            text = " ".join(str(raised).split())
            text = text if len(text) <= 200 else text[:197] + "..."
            self.given_up = f"{doing} ({type(raised).__name__}: {text})"
            try:
                self.abandon(doing, raised)
            except Exception as failure:  # keep the work's own error: it is the cause
                logger.warning(
                    "[rank %d] could not tell the other ranks: %s", self.peers.me, failure
                )
            if raised is not error:
                raise raised from error
            raise

    def check_usable(self, owner: str) -> None:
        """Raise if ``owner`` (the Pipeline or DecodePipeline that talks over this transport)
        gave up work and closed its connections, or another one closed its groups."""
        if self.given_up is not None:
            raise RuntimeError(
                f"{self.peers.name(self.peers.me)}: this {owner} abandoned {self.given_up} and "
                f"closed its connections to the other ranks; create a new {owner} on every "
                "rank to go on (over a new process group if you passed group=...)"
            )
        self.check_open()

    def check_open(self) -> None:
        """Raise if a Pipeline that abandoned a step closed the groups this one talks over."""
        groups = [self._upward, self._downward, self.group]
        world = dist.group.WORLD
        if any(g is not None and _CLOSED.get(g.group_name) is world for g in groups):
            raise RuntimeError(
                f"{self.peers.name(self.peers.me)}: the process group this Pipeline talks over "
                "was closed when a Pipeline on it abandoned a step; create a new Pipeline "
                "(over a new process group if you passed group=...) on every rank to go on"
            )


# Note [abandoned step]:
# A rank whose step raised (its stage's error, a lost peer, Ctrl-C) may stay alive: a
# notebook, a retry loop, pytest.raises. Its peers would wait for it until timeout_s and then
# call it crashed. So the rank records the error in the store (See Note [first lost rank]) and
# closes its connections: every peer waiting on it fails at once, as if it had died, and
# names it and the error it read from the store; each of them does the same in turn, so the
# news crosses the whole pipeline. Messages may be in flight, so the closed groups are never
# used again: the world's direction groups are made anew by the next Pipeline, and a
# Pipeline over a closed group of the user's refuses to run (check_open).
_CLOSED: dict[str, Any] = {}
"""Names of the groups closed by an abandoned step, in this process, with the world they were
in (a new world names its groups anew, so the same name there is another group)."""


def _close_transport(groups: list[dist.ProcessGroup], upward: dist.ProcessGroup | None) -> None:
    """Close a transport's gloo ``groups`` for good; See Note [abandoned step]."""
    for group in groups:
        close_gloo_group(group)
        _CLOSED[group.group_name] = dist.group.WORLD
    if upward is not None and _DIRECTIONS[:1] == [upward]:
        _DIRECTIONS.clear()  # the next Pipeline makes new ones


# Note [a group per direction]:
# Over one gloo group, a pair of ranks shares one connection both ways, and when both ranks
# call into it at about the same time (each sends to the other) one call or the message
# behind it stalls for a scheduler tick: measured on 2 cores, 2 ranks sending to each other
# at once 300 times, 13-19 sends took over 1 ms (up to 5 ms) and 8-16 messages arrived over
# 1 ms late; with a group per direction, 0-1 and 0-3. Pipelines whose ranks pass activations
# one way while gradients come back (interleaved schedules, V placements) hit it every step.
# So messages to higher ranks travel in one gloo group and messages to lower ranks in
# another, made once per world and shared by every Pipeline. They are made only when the
# pipeline spans the whole world: a group of some ranks must be made by those ranks alone
# (``use_local_synchronization``), and torch then names it by how many groups each member
# already has, which differs on ranks that made other groups of their own, so they would not
# meet; a pipeline on part of the world uses its group both ways. NCCL's point-to-point
# channels are already separate per direction.
_DIRECTIONS: list[dist.ProcessGroup] = []
"""The world's upward and downward group, once made."""


def _directions(
    group: dist.ProcessGroup | None, timeout: timedelta
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(upward, downward) gloo groups over the world, or (None, None) (``group`` both ways)
    if ``group`` is not gloo or not the whole world. Collective the first time in a world."""
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) != dist.get_world_size():
        return None, None
    if (
        not _DIRECTIONS  # the first Pipeline
        or not all(map(_alive, _DIRECTIONS))  # of a new world
        or read_record(_scope(_DIRECTIONS[0])) is not None  # closed by a failure
    ):
        _DIRECTIONS[:] = [dist.new_group(timeout=timeout, backend="gloo") for _ in range(2)]
    return _DIRECTIONS[0], _DIRECTIONS[1]


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` still exists (``destroy_process_group()`` ends every group)."""
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, KeyError, RuntimeError):
        return False
    return True


def _scope(channel: dist.ProcessGroup) -> str:
    """The store key of the failures of the Pipelines talking over ``channel``."""
    return f"conveyor/failure/{channel.group_name}"


# Note [one message]:
# A message with several tensors (a stage's activations and the random-generator state that
# travels with them, See Note [micro-batch randomness]) goes as one gloo transfer: the sender
# copies the tensors into one byte buffer, each at an offset rounded up to _ALIGN, and the
# receiver, which knows the sizes from the message's Meta, receives into one buffer and copies
# each tensor out of it (a view would keep the whole buffer, random state included, alive as
# long as the activation is saved for backward). Each transfer costs a round of the
# transport's threads and, on a shared CPU, a scheduler wake-up on both sides; a copy of the
# activations costs less than
# that. A message of one tensor is sent as it is, with no copy.
_ALIGN = 64
"""Bytes each packed tensor's offset is a multiple of, so every dtype can view its place."""


def _packing(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes in one buffer (single: no padding), and its size."""
    if len(sizes) == 1:
        return [0], sizes[0]
    offsets, total = [], 0
    for size in sizes:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += size
    return offsets, total


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view, so every dtype (bool, complex, float8) travels on every backend."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
