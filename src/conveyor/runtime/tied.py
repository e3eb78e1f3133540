"""Tied weights: one parameter used by stages on several ranks, kept identical everywhere.

ties = find_ties(graph, declared=["0.tokens.weight,5.out.weight"])   # or found alone
tied = TiedWeights(ties, graph, rank, stages, group)   # shares, then equalizes values
before = tied.gradients(); ...backward...; tied.sum_gradients(before)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from conveyor.graph import StageGraph
from conveyor.parallel.data_parallel import local

__all__ = ["Tie", "TiedWeights", "find_ties"]

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
# must stay one parameter: equal values at the start (the first stage's rank broadcasts its
# value), and after each step the same gradient everywhere, the sum of all users'
# contributions, so identical optimizers keep the copies equal. Only the gradient a step adds
# is summed (gradient accumulation over several steps stays right). Users on one rank share
# one Parameter object, so autograd adds their contributions itself. The ranks of a tie talk
# in a process group of their own, created by those ranks alone.
class TiedWeights:
    """This rank's part of the ties: its shared Parameters and the groups to sum over."""

    def __init__(
        self,
        ties: Sequence[Tie],
        graph: StageGraph,
        rank: int,
        stages: dict[int, nn.Module],
        group: dist.ProcessGroup | None,
    ) -> None:
        self.rank = rank
        self.params: list[tuple[Tie, nn.Parameter, dist.ProcessGroup | None, int]] = []
        """(tie, this rank's Parameter, the tie's group, its source rank) for cross-rank ties."""
        for tie in ties:
            local = [(s, name) for s, name in tie.users if s in stages]
            if not local:
                continue
            param = _get(stages[local[0][0]], local[0][1])
            for s, name in local[1:]:
                _set(stages[s], name, param)
            ranks = tie.ranks(graph)
            if len(ranks) == 1:
                continue
            members = tuple(sorted(_global(group, r) for r in ranks))
            self.params.append((tie, param, _tie_group(members), _global(group, ranks[0])))
        if self.params:
            logger.info(
                "[rank %d] tied across ranks: %s",
                rank,
                ", ".join(f"{t.name} (stages {[s for s, _ in t.users]})" for t, *_ in self.params),
            )

    def rebind(self, stages: dict[int, nn.Module]) -> None:
        """Take each tie's Parameter from ``stages`` again, after data or tensor parallelism
        replaced the stages' parameters (by DTensors)."""
        for index, (tie, _, tie_group, source) in enumerate(self.params):
            stage, name = next((s, n) for s, n in tie.users if s in stages)
            self.params[index] = (tie, _get(stages[stage], name), tie_group, source)

    def equalize(self) -> None:
        """Give every copy the value of the tie's first stage (collective over each tie)."""
        for _, param, tie_group, source in self.params:
            with torch.no_grad():
                dist.broadcast(param.data, src=source, group=tie_group)

    def gradients(self) -> list[torch.Tensor | None]:
        """The tied gradients now, to pass to ``sum_gradients`` after the step."""
        return [None if p.grad is None else p.grad.clone() for _, p, _, _ in self.params]

    def sum_gradients(self, before: Sequence[torch.Tensor | None]) -> None:
        """Add up what this step added to each tied gradient on all its ranks."""
        for (_, param, tie_group, _), old in zip(self.params, before, strict=True):
            if not param.requires_grad:  # frozen: the same on every rank, nothing to add
                continue
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            added = grad if old is None else grad - old
            dist.all_reduce(local(added), group=tie_group)
            param.grad = added if old is None else old + added

    def max_difference(self) -> float:
        """Largest difference between this rank's copy of a tied value and the first
        stage's (collective); 0.0 while the ties hold."""
        worst = 0.0
        for _, param, tie_group, source in self.params:
            reference = local(param.detach()).clone()
            dist.broadcast(reference, src=source, group=tie_group)
            worst = max(worst, float((local(param.detach()) - reference).abs().max()))
        return worst


_GROUPS: dict[tuple[int, tuple[int, ...]], dist.ProcessGroup | None] = {}


def _tie_group(members: tuple[int, ...]) -> dist.ProcessGroup | None:
    """The process group of these global ranks, created by them alone (once per world)."""
    key = (id(dist.group.WORLD), members)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(members), use_local_synchronization=True)
    return _GROUPS[key]


def _get(module: nn.Module, name: str) -> nn.Parameter:
    return module.get_parameter(name)


def _set(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)
