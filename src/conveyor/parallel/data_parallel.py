"""Data parallelism over a pipeline's replicas: each rank's stages replicated or sharded with
FSDP2, their gradients reduced once per step.

    data = DataParallel(pipe.stages, mesh.dp_mesh, fsdp=True)
    data.begin_step(); ...; data.stage_done(s)  # as each stage's last B or W runs
    data.end_step()                             # parameters shared by two local stages
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from conveyor.runtime.loss import LossReduction
from conveyor.runtime.peers import PeerLostError
from conveyor.torch_compat import fsdp_reduce_gradients, replicate

__all__ = ["DataParallel", "local"]

logger = logging.getLogger(__name__)


# Note [one reduction per step]:
# FSDP2 (fully_shard, and replicate, its unsharded form) reduces a module's gradients from
# autograd hooks at the end of each backward: once per micro-batch in a pipeline, and at the
# wrong moment under a split backward, whose weight gradients (W) come after the hooks ran
# with the input gradients (I). So, as torch.distributed.pipelining does, every micro-batch's
# backward runs with gradient sync and resharding off (gradients accumulate unsharded, the
# gathered parameters stay for the deferred W), and the reduction runs once, by hand, right
# after the last action that adds to the stage's weight gradients (its last B or W,
# Runtime.on_weights_done). The reduction of a stage that finishes early overlaps the other
# stages' remaining backward. Every replica runs the same program, so the collectives of a
# stage's replicas meet in the same order and cannot deadlock when the pipeline cannot.
# FSDP2 wants one root module per state, so each stage is wrapped alone; a parameter shared
# by two stages of one rank (a weight tied within the rank, as in a V placement) is left out
# of both (it stays whole) and its step's gradient is all-reduced over the replicas at the
# end of the step. FSDP2 averages the replicas' gradients, which is the global batch's
# gradient only if every replica's loss averages over as much; so each replica weighs its
# micro-batches by their share of the count over all replicas (loss_weights), which also
# covers token-level losses whose counted tokens differ between replicas.
class DataParallel:
    """This rank's stages over the replicas of ``mesh``: FSDP2 ``fully_shard`` with ``fsdp``,
    else FSDP2's ``replicate``; gradients are those of the global batch's mean loss (or of
    the sum with ``reduction="sum"``), reduced once per step."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        mesh: DeviceMesh,
        *,
        fsdp: bool,
        reshard_after_forward: bool = False,
        reduction: LossReduction = "mean",
    ) -> None:
        self.stages = stages
        self.group = mesh.get_group()
        self.shared = _shared_parameters(stages)
        """Parameters of several local stages: left out of FSDP, reduced at the step's end."""
        self.device = torch.device(mesh.device_type)
        self._divisor = 1 if reduction == "sum" else mesh.size()
        self._before: list[torch.Tensor | None] = []
        _broadcast_from_first_replica(stages.values(), self.group)
        ignored = set(self.shared)
        for module in stages.values():
            if fsdp:
                fully_shard(
                    module,
                    mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored,
                )
            else:
                replicate(module, mesh, ignored)
            if reduction == "sum":  # losses add over replicas: so do their gradients
                _fsdp(module).set_gradient_divide_factor(1.0)

    def begin_step(self) -> None:
        """Turn gradient sync and resharding off until each stage's last backward is done.

        See Note [one reduction per step].
        """
        for module in self.stages.values():
            fsdp = _fsdp(module)
            fsdp.set_requires_gradient_sync(False)
            fsdp.set_reshard_after_backward(False)
            fsdp.set_is_last_backward(False)
        self._before = [None if p.grad is None else p.grad.clone() for p in self.shared]

    def loss_weights(self, reduction: LossReduction, counts: Sequence[int]) -> list[float]:
        """This replica's micro-batch weights, so that the gradients reduced over the replicas
        are those of the global batch: a mean weighs each micro-batch by its share of the
        count over every replica (samples, or tokens a token-level loss counts, which differ
        between replicas), times the replicas FSDP divides by. One small all-reduce.

        See Note [one reduction per step].
        """
        if reduction == "sum":
            return [1.0] * len(counts)
        total = torch.tensor(sum(counts), dtype=torch.int64, device=self.device)
        with self._naming_lost("adding up the replicas' loss counts"):
            dist.all_reduce(total, group=self.group)
        whole = int(total)
        return [count * self._divisor / whole if whole else 0.0 for count in counts]

    def stage_done(self, stage: int) -> None:
        """The stage's gradients are complete for this step: reduce them over the replicas.

        Raises:
            PeerLostError: a replica did not join the reduction in time, naming them all.
        """
        with self._naming_lost(f"reducing stage {stage}'s gradients"):
            fsdp_reduce_gradients(self.stages[stage])

    def end_step(self) -> None:
        """Reduce what this step added to the gradients of the shared parameters."""
        for param, old in zip(self.shared, self._before, strict=True):
            if param.grad is None:
                continue
            added = param.grad if old is None else param.grad - old
            with self._naming_lost("reducing shared parameters' gradients"):
                dist.all_reduce(added, group=self.group)
            added /= self._divisor
            param.grad = added if old is None else old + added

    @contextmanager
    def _naming_lost(self, doing: str) -> Iterator[None]:
        """Turn the backend's timeout or lost connection into an error naming the replicas."""
        try:
            yield
        except RuntimeError as error:
            ranks = dist.get_process_group_ranks(self.group)
            others = [r for r in ranks if r != dist.get_rank()]
            raise PeerLostError(
                f"rank {dist.get_rank()}: lost a replica while {doing}: the replicas on "
                f"ranks {others} did not take part ({error}). One of them has likely crashed "
                "or been killed; check their logs."
            ) from error

    def reshard(self) -> None:
        """Free gathered parameters (after inference, which has no backward to do it)."""
        for module in self.stages.values():
            _fsdp(module).reshard()


def _fsdp(module: nn.Module) -> FSDPModule:
    assert isinstance(module, FSDPModule), "DataParallel wraps every stage"
    return module


def _shared_parameters(stages: dict[int, nn.Module]) -> list[nn.Parameter]:
    """Parameters that more than one of ``stages`` holds, in a fixed order."""
    seen: dict[int, nn.Parameter] = {}
    shared: dict[int, nn.Parameter] = {}
    for module in stages.values():
        for param in set(module.parameters()):
            if id(param) in seen:
                shared[id(param)] = param
            seen[id(param)] = param
    order = {id(p): i for i, p in enumerate(p for m in stages.values() for p in m.parameters())}
    return sorted(shared.values(), key=lambda p: order[id(p)])


def _broadcast_from_first_replica(modules: Iterable[nn.Module], group: dist.ProcessGroup) -> None:
    """Every replica starts from replica 0's parameters and buffers, as DDP starts (FSDP2
    does not copy them; a model initialized from different seeds would drift apart)."""
    with torch.no_grad():
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(local(tensor), group=group, group_src=0)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
