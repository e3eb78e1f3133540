"""Tied weights: one parameter used by stages on several ranks, kept identical everywhere.

ties = find_ties(graph, declared=["0.tokens.weight,5.out.weight"])   # or found alone
tied = TiedWeights(ties, graph, rank, stages, p2p); tied.equalize()  # share, then equal values
with tied.summing_gradients(): ...forward and backward of a step...
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from conveyor.graph import StageGraph
from conveyor.runtime.comm import P2P, Meta, Receive
from conveyor.runtime.fingerprint import exchange
from conveyor.runtime.peers import StepRefused
from conveyor.runtime.sharded import local

__all__ = ["SharedParameter", "Tie", "TiedFrozenError", "TiedWeights", "find_ties"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tie:
    """One parameter and everywhere it is used: (stage, qualified name) pairs, first stage
    first. The first stage's value is the parameter's value."""

    users: tuple[tuple[int, str], ...]

    @property
    def name(self) -> str:
        return self.users[0][1]

    def ranks(self, graph: StageGraph) -> list[int]:
        """Ranks holding a user, the first stage's rank first."""
        ranks = [graph.rank_of(self.users[0][0])]
        ranks += sorted({graph.rank_of(s) for s, _ in self.users} - set(ranks))
        return ranks


def find_ties(graph: StageGraph, declared: Sequence[str] = ()) -> list[Tie]:
    """Parameters used by more than one stage: the same Parameter object reached from several
    stages, and the ``declared`` groups (comma-separated qualified names) merged with them.

    Raises:
        ValueError: a declared name is no stage's parameter, or tied parameters differ in
            shape or dtype.
    """
    parent: dict[str, str] = {}  # union-find over qualified names

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    def join(a: str, b: str) -> None:
        parent[root(b)] = root(a)

    users: list[tuple[int, str]] = []
    kinds: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    first_name: dict[int, str] = {}  # Parameter object -> a name it goes by
    for stage in graph.stages:
        if stage.module is None:
            continue
        for name, param in stage.module.named_parameters(remove_duplicate=False):
            parent.setdefault(name, name)
            kinds[name] = (tuple(param.shape), param.dtype)
            join(first_name.setdefault(id(param), name), name)
            users.append((stage.index, name))
    for group in declared:
        names = [n.strip() for n in group.split(",") if n.strip()]
        missing = [n for n in names if n not in parent]
        if missing:
            raise ValueError(
                f"tie_weights names {missing}, which no stage holds; expected "
                f"qualified parameter names such as {sorted(parent)[:4]}"
            )
        if len({kinds[n] for n in names}) > 1:
            raise ValueError(
                f"tie_weights group {names} mixes shapes or dtypes "
                f"{[kinds[n] for n in names]}; tied parameters must match"
            )
        for name in names[1:]:
            join(names[0], name)
    found: dict[str, list[tuple[int, str]]] = {}
    for user in users:
        group_users = found.setdefault(root(user[1]), [])
        if user not in group_users:
            group_users.append(user)
    ties = [Tie(tuple(sorted(u))) for u in found.values() if len({s for s, _ in u}) > 1]
    return sorted(ties, key=lambda t: t.users)


# Note [tied weights]:
# Every rank that holds a user of a tie keeps its own copy of the parameter, and the copies
# must stay one parameter: equal values at the start (the first stage's rank sends its value
# to the others), and after each step the same gradient everywhere, the sum of all users'
# contributions, so identical optimizers keep the copies equal. Only the gradient a step adds
# is summed: the tied ``.grad`` is set aside before the step and added back after it, so
# gradient accumulation over several steps stays right and nothing is subtracted (which
# would round). Users on one rank share one Parameter object, so autograd adds their
# contributions itself. Every rank adds the contributions in rank order, so the copies agree
# bit for bit.
#
# The contributions travel over the pipeline's own point-to-point transport, not as a
# collective. See Note [no collective per step].


# Note [no collective per step]:
# torch records every collective a process group runs (all_reduce, broadcast, ...) in its
# flight recorder, a ring of the last 2,000 (TORCH_FR_BUFFER_SIZE) with the Python stack of
# the call, about 1.3 KB of host memory each that lives until the ring wraps. Point-to-point
# sends and receives on gloo are not recorded. Summing a tied gradient with one all_reduce
# per step therefore added a long-lived allocation to every step, made in the middle of the
# step's freed activation buffers: glibc carves it out of a freed buffer, which is then too
# small for the next step's tensor of that size, so the heap grew by about one buffer (64 KB
# for the demo's GPT) per step for the first 2,000 steps, about 130 MB per rank (measured
# with heaptrack and mallinfo2; docs/benchmarks.md, section soak). Sent as messages between
# the tie's ranks, the sum allocates nothing that outlives the step, and the heap stays flat.
class TiedWeights:
    """This rank's part of the ties: its shared Parameters and the peers to sum them with.

    See Note [tied weights].
    """

    def __init__(
        self,
        ties: Sequence[Tie],
        graph: StageGraph,
        rank: int,
        stages: dict[int, nn.Module],
        p2p: P2P,
    ) -> None:
        self.rank = rank
        self.p2p = p2p
        self.params: list[SharedParameter] = []
        """This rank's tied Parameters that other ranks hold copies of."""
        self.across = [tie for tie in ties if len(tie.ranks(graph)) > 1]
        """Every tie held on more than one rank, this rank's or not: the same on every rank."""
        self._checked: tuple[int, ...] | None = None
        """Every rank's trainable digest when the copies were last found frozen alike."""
        for tie in ties:
            local = [(s, name) for s, name in tie.users if s in stages]
            if not local:
                continue
            param = _get(stages[local[0][0]], local[0][1])
            for s, name in local[1:]:
                _set(stages[s], name, param)
            ranks = tie.ranks(graph)
            if len(ranks) > 1:
                self.params.append(SharedParameter(tie, param, tuple(ranks)))
        if self.params:
            logger.info(
                "[rank %d] tied across ranks: %s",
                rank,
                ", ".join(
                    f"{p.tie.name} (stages {[s for s, _ in p.tie.users]})" for p in self.params
                ),
            )

    def rebind(self, stages: dict[int, nn.Module]) -> None:
        """Take each tie's Parameter from ``stages`` again, after data or tensor parallelism
        replaced the stages' parameters (by DTensors)."""
        for index, shared in enumerate(self.params):
            stage, name = next((s, n) for s, n in shared.tie.users if s in stages)
            self.params[index] = dataclasses.replace(shared, param=_get(stages[stage], name))

    def equalize(self) -> None:
        """Give every copy the value of the tie's first stage (collective over each tie)."""
        for shared in self.params:
            mine = local(shared.param.detach())
            value = self._from_source(shared, mine)
            if value is not None:
                mine.copy_(value)

    @contextmanager
    def summing_gradients(self) -> Iterator[None]:
        """Around one step: afterwards each tied ``.grad`` holds what it held before plus
        the sum of what the step added on all the tie's ranks (collective over each tie).
        If the step raises, the gradients are put back as they were."""
        before = [p.param.grad for p in self.params]
        for shared in self.params:
            shared.param.grad = None
        try:
            yield
        except BaseException:
            for shared, old in zip(self.params, before, strict=True):
                shared.param.grad = old
            raise
        self._sum_gradients(before)

    def check_frozen(self, trainable: tuple[int, ...]) -> None:
        """Refuse a step in which a tie is frozen on one rank and trained on another: its
        copies would drift apart. Collective over the pipeline's ranks, and run only when
        ``trainable`` (every rank's digest of what requires gradients) changed.

        Raises:
            TiedFrozenError: on every rank, naming the tie and the ranks that disagree.
        """
        if trainable == self._checked:
            return
        held = {shared.tie: shared.param.requires_grad for shared in self.params}
        mine = torch.tensor([held.get(tie, -1) for tie in self.across], dtype=torch.int64)
        flags = exchange(self.p2p, mine, "which tied weights are frozen")
        flags[self.rank] = mine
        for index, tie in enumerate(self.across):
            trained = {r: int(f[index]) for r, f in sorted(flags.items()) if f[index] >= 0}
            if len(set(trained.values())) > 1:
                frozen = [r for r, on in trained.items() if not on]
                training = [r for r, on in trained.items() if on]
                raise TiedFrozenError(
                    f"rank {self.rank}: the weight {tie.name!r} is tied across stages "
                    f"{[s for s, _ in tie.users]}, but is frozen on rank(s) {frozen} and "
                    f"requires gradients on rank(s) {training}; its copies are one parameter, "
                    "so set requires_grad alike on every rank that holds it (each rank's "
                    "pipe.named_parameters() lists its copy)"
                )
        self._checked = trainable

    def max_difference(self) -> float:
        """Largest difference between this rank's copy of a tied value and the first
        stage's (collective); 0.0 while the ties hold."""
        worst = 0.0
        for shared in self.params:
            mine = local(shared.param.detach())
            reference = self._from_source(shared, mine)
            if reference is not None:
                worst = max(worst, float((mine - reference).abs().max()))
        return worst

    def _sum_gradients(self, before: Sequence[torch.Tensor | None]) -> None:
        start = self._now()
        sums = []
        for shared, old in zip(self.params, before, strict=True):
            param = shared.param
            if not param.requires_grad:  # frozen: the same on every rank, nothing to add
                param.grad = old
                continue
            added = param.grad if param.grad is not None else torch.zeros_like(param)
            # a replica's shard or copy, summed shard by shard
            sums.append((shared, old, added, self._sum(shared, local(added.detach()))))
        self.p2p.wait_sends()  # the parts sent must stay as they are until then
        for shared, old, added, total in sums:
            local(added).copy_(total)
            shared.param.grad = added if old is None else old.add_(added)
        self._record("ties", start)

    def _sum(self, shared: SharedParameter, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` added up over the tie's ranks, in rank order (the same bits on each).

        Each pair of ranks exchanges in one global order, the lower rank sending first, so
        a transport whose sends block until received (NCCL) cannot deadlock.
        """
        describe = f"tie {shared.tie.name}"
        receives: dict[int, Receive] = {}
        for peer in shared.peers(self.rank):
            if self.rank < peer:
                self.p2p.send(tensor, peer, describe)
            receives[peer] = self.p2p.post(peer, Meta.of(tensor), describe)
            if self.rank > peer:
                self.p2p.send(tensor, peer, describe)
        parts: dict[int, torch.Tensor] = {p: self.p2p.wait(r) for p, r in receives.items()}
        parts[self.rank] = tensor
        first, second, *rest = (parts[r] for r in sorted(parts))
        total = first + second
        for part in rest:
            total += part
        return total

    def _from_source(self, shared: SharedParameter, value: torch.Tensor) -> torch.Tensor | None:
        """The first stage's ``value`` on the tie's other ranks (None on the source rank)."""
        describe = f"tie {shared.tie.name}"
        if self.rank == shared.source:
            for peer in shared.peers(self.rank):
                self.p2p.send(value, peer, describe)
            self.p2p.wait_sends()
            return None
        received: torch.Tensor = self.p2p.wait(
            self.p2p.post(shared.source, Meta.of(value), describe)
        )
        return received

    def _now(self) -> float:
        return 0.0 if self.p2p.recorder is None else self.p2p.recorder.now()

    def _record(self, action: str, start: float) -> None:
        """An event for the tie exchange, carrying the bytes it sent (conveyor.trace)."""
        if self.p2p.recorder is not None and self.params:
            self.p2p.recorder.add(action, start, self.p2p.recorder.now())


class TiedFrozenError(ValueError, StepRefused):
    """A tied weight is frozen on some of its ranks and trained on others."""


@dataclass(frozen=True)
class SharedParameter:
    """A tied Parameter as one rank holds it, and the ranks holding copies."""

    tie: Tie
    param: nn.Parameter
    ranks: tuple[int, ...]
    """Ranks (in the pipeline's group) holding a user, the first stage's rank first."""

    @property
    def source(self) -> int:
        """The rank whose value the copies take: the first stage's."""
        return self.ranks[0]

    def peers(self, rank: int) -> list[int]:
        """The other ranks of the tie, in rank order."""
        return sorted(r for r in self.ranks if r != rank)


def _get(module: nn.Module, name: str) -> nn.Parameter:
    return module.get_parameter(name)


def _set(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)
