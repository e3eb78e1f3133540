"""Data parallelism over a pipeline's replicas: each rank's stages replicated or sharded with
FSDP2, their gradients reduced once per step.

    data = DataParallel(pipe.stages, mesh.dp_mesh, fsdp=True, split_backward=False)
    data.begin_step()
    data.arm(s, roots)   # just before each stage's last full backward (B)
    data.stage_done(s)   # right after each stage's last B or W
    data.wait(s)         # at the step's end, for each stage reduced in flight
    data.end_step()      # parameters shared by two local stages (or tied to another rank)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from conveyor.runtime.loss import LossReduction
from conveyor.runtime.peers import PeerLostError, Peers, about_a_peer, close_group
from conveyor.runtime.sharded import local
from conveyor.torch_compat import GradBucket, fsdp_reduce_gradients, replicate

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["DataParallel", "reduces_in_flight"]

logger = logging.getLogger(__name__)


# Note [one reduction per step]:
# FSDP2 (fully_shard, and replicate, its unsharded form) reduces a module's gradients from
# autograd hooks at the end of each backward: once per micro-batch in a pipeline, and at the
# wrong moment under a split backward, whose weight gradients (W) come after the hooks ran
# with the input gradients (I). So, as torch.distributed.pipelining does, every micro-batch's
# backward runs with gradient sync and resharding off (gradients accumulate unsharded, the
# gathered parameters stay for the deferred W), and the reduction runs once, by hand, right
# after the last action that adds to the stage's weight gradients (its last B or W,
# RuntimeHooks.on_weights_done). Every replica runs the same program, so the collectives of a
# stage's replicas meet in the same order and cannot deadlock when the pipeline cannot.
# FSDP2 wants one root module per state, so each stage is wrapped alone; a parameter shared
# by two stages of one rank (a weight tied within the rank, as in a V placement) is left out
# of both (it stays whole) and its step's gradient is all-reduced over the replicas at the
# end of the step. FSDP2 averages the replicas' gradients, which is the global batch's
# gradient only if every replica's loss averages over as much; so each replica weighs its
# micro-batches by their share of the count over all replicas (loss_weights), which also
# covers token-level losses whose counted tokens differ between replicas.
#
# Note [reductions in flight]:
# A replicated stage (no FSDP) whose schedule has no split backward is reduced by DDP's own
# reducer instead, which FSDP2's replicate cannot match on a CPU: there FSDP2 runs its
# collective in line and copies the gradients three times around it (into a flat buffer,
# through a reduce-scatter over a shard group of one, back out), while DDP's reducer
# all-reduces 25 MiB buckets as the backward fills them, in place when the gradients are
# views of its buckets. It is armed (prepare_for_backward) just before the stage's last B,
# as torch.distributed.pipelining arms it before its last backward; the earlier micro-batches
# accumulate without it. Each bucket's all-reduce starts from a communication hook that
# hands DDP the bucket as already reduced, so the backward never waits for one: the
# reduction runs behind the rest of the step (the input gradients sent on, the other
# stages' actions) and end_step waits for it, before any optimizer can read a gradient. The
# buckets go over a group of their own: at the end of the backward the reducer waits for a
# small all-reduce of its own (which parameters were used), and on one group that would queue
# behind the buckets' all-reduces and hold the backward until they were done. The
# reducer looks for parameters the last micro-batch did not use (find_unused_parameters):
# they are reduced with the rest (a gradient DDP has made a view of its bucket is reduced
# in place whether or not it was used), and a parameter no replica ever used keeps no
# gradient, as under FSDP2. The buckets are averaged, even for a summed loss: a gradient
# carried over from an earlier step (no zero_grad), the same on every replica, is then left
# as it was, where a sum would count it once per replica. So a summed loss weighs its
# micro-batches by the number of replicas, and the loss a step returns has that factor taken
# out again (replica_loss).
class DataParallel:
    """This rank's stages over the replicas of ``mesh``: FSDP2 ``fully_shard`` with ``fsdp``,
    else DDP's reducer (without a split backward or tensor parallelism) or FSDP2's
    ``replicate``; gradients are those of the global batch's mean loss (or of the sum with
    ``reduction="sum"``), reduced once per step."""

    def __init__(
        self,
        stages: dict[int, nn.Module],
        mesh: DeviceMesh,
        *,
        fsdp: bool,
        split_backward: bool,
        tensor_parallel: bool = False,
        tied: Sequence[nn.Parameter] = (),
        reshard_after_forward: bool = False,
        reduction: LossReduction = "mean",
        timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        self.stages = stages
        self.group = mesh.get_group()
        self.timeout = timeout
        self.peers = Peers(f"conveyor/failure/{self.group.group_name}", self.group)
        """Names a lost replica: on a mesh, the mesh's job (See Note [rank names])."""
        self.reduces_in_flight = reduces_in_flight(fsdp, split_backward, tensor_parallel)
        """Whether DDP's reducer reduces the stages; See Note [reductions in flight]."""
        self.shared = _shared_parameters(stages, tied if self.reduces_in_flight else ())
        """Parameters reduced at the step's end: those of several local stages, and, in
        flight, those tied to another rank's stage (whose gradients TiedWeights sets)."""
        self.device = torch.device(mesh.device_type)
        self._divisor = 1 if reduction == "sum" and not self.reduces_in_flight else mesh.size()
        self._before: list[torch.Tensor | None] = []
        with self._naming_lost("taking replica 0's parameters"):
            _broadcast_from_first_replica(stages.values(), self.group)
        ignored = set(self.shared)
        self._trainable = {
            stage: _trainable(module, ignored)
            for stage, module in stages.items()
            if self.reduces_in_flight
        }
        """Per stage DDP's reducer reduces, the parameters it was made for."""
        self._ignored = ignored
        self.in_flight: dict[int, _Buckets] = {}
        """Stages DDP's reducer reduces, by index; See Note [reductions in flight]."""
        self._fsdp: dict[int, FSDPModule] = {}
        buckets_group = None
        for stage, module in stages.items():
            if self.reduces_in_flight:
                params = [p for p in module.parameters() if p.requires_grad and p not in ignored]
                if params:
                    if buckets_group is None:
                        buckets_group = _same_ranks(self.group, timeout)
                        self.peers.close_with(_closing(buckets_group), on_abandon=True)
                    self.in_flight[stage] = _Buckets(
                        stage, params, self.group, buckets_group, self._divisor
                    )
                continue
            if fsdp:
                from torch.distributed.fsdp import fully_shard  # See Note [DTensor unimported]

                fully_shard(
                    module,
                    mesh=mesh,
                    reshard_after_forward=reshard_after_forward,
                    ignored_params=ignored,
                )
            else:
                replicate(module, mesh, ignored)
            self._fsdp[stage] = _fsdp(module)
            if self._divisor == 1:  # losses add over replicas: so do their gradients
                self._fsdp[stage].set_gradient_divide_factor(1.0)
                # else FSDP2 reduces float32 with PREMUL_SUM(1.0), which gloo does not have
                self._fsdp[stage].set_force_sum_reduction_for_comms(True)

    def check_shares(self, share: tuple[int, int]) -> None:
        """Warn if every replica was given the same batch (``share``: digests of this
        replica's inputs and targets): the global batch then holds each sample once per
        replica, a mistake of code ported from one pipeline, where every rank passes the same
        batch. Collective over the replicas; called once, at the first step."""
        shares: list[tuple[int, int] | None] = [None] * dist.get_world_size(self.group)
        with self._naming_lost("comparing the replicas' first batches"):
            dist.all_gather_object(shares, share, group=self.group)
        if len(set(shares)) == 1 and dist.get_rank() == 0:
            logger.warning(
                "all %d data-parallel replicas were given the same batch at their first step, "
                "so each sample counts %d times in the global batch: give each replica its own "
                "share (conveyor.data.ResumableLoader(..., num_replicas=pipe.num_replicas, "
                "replica=pipe.replica)), the same on every rank of the replica",
                len(shares),
                len(shares),
            )

    def begin_step(self) -> None:
        """Turn FSDP2's gradient sync and resharding off until each stage's last backward is
        done.

        See Note [one reduction per step].

        Raises:
            RuntimeError: parameters were frozen or unfrozen since a stage's reducer was made.
        """
        for stage, made_for in self._trainable.items():
            now = _trainable(self.stages[stage], self._ignored)
            if now != made_for:
                changed = sorted(now ^ made_for)
                raise RuntimeError(
                    f"stage {stage}: parameters {changed[:4]}{' ...' if len(changed) > 4 else ''}"
                    " were frozen or unfrozen since the Pipeline was made, and data parallelism "
                    "without FSDP reduces the parameters it was made with (DDP's reducer); "
                    "pass fsdp=True (or a split-backward schedule such as zb-h1), which follow "
                    "requires_grad at every step, or make the Pipeline after freezing"
                )
        for fsdp in self._fsdp.values():
            fsdp.set_requires_gradient_sync(False)
            fsdp.set_reshard_after_backward(False)
            fsdp.set_is_last_backward(False)
        self._before = [None if p.grad is None else p.grad.clone() for p in self.shared]

    def loss_weights(self, reduction: LossReduction, counts: Sequence[int]) -> Sequence[float]:
        """This replica's micro-batch weights, so that the gradients reduced over the replicas
        are those of the global batch: a mean weighs each micro-batch by its share of the
        count over every replica (samples, or tokens a token-level loss counts, which differ
        between replicas), times the replicas the reduction divides by (a sum, by that
        alone). For a mean, the counts' total is all-reduced while the step runs: the first
        weight read (the first loss) waits for it. Collective over the replicas of the rank
        that holds the last stage, the only one that reads them.

        See Note [one reduction per step].
        """
        if reduction == "sum":  # the replicas' sum, divided by what the reduction divides by
            return [float(self._divisor)] * len(counts)
        total = torch.tensor(sum(counts), dtype=torch.int64, device=self.device)
        with self._naming_lost("adding up the replicas' loss counts"):
            work = dist.all_reduce(total, group=self.group, async_op=True)
        assert work is not None

        def weights() -> list[float]:
            with self._naming_lost("adding up the replicas' loss counts"):
                work.wait()
            whole = int(total)
            return [count * self._divisor / whole if whole else 0.0 for count in counts]

        return _Pending(weights, len(counts))

    def replica_loss(self, reduction: LossReduction, weighted: torch.Tensor) -> torch.Tensor:
        """The step's loss from this replica's weighted micro-batch losses: a sum's weights
        carry the factor its gradients are divided by in the reduction, which its loss must
        not (See Note [reductions in flight])."""
        return weighted / self._divisor if reduction == "sum" else weighted

    def arm(self, stage: int, roots: Sequence[torch.Tensor]) -> None:
        """The stage's last full backward (B) starts from ``roots``: let DDP's reducer reduce
        its buckets as it fills them.

        See Note [reductions in flight].
        """
        buckets = self.in_flight.get(stage)
        if buckets is not None:
            buckets.arm(roots)

    def stage_done(self, stage: int) -> None:
        """The stage's gradients are complete for this step: reduce those of an FSDP2 stage
        over the replicas (a stage in flight is reduced already).

        Raises:
            PeerLostError: a replica did not join the reduction in time, naming them all.
        """
        if stage in self._fsdp:
            with self._naming_lost(f"reducing stage {stage}'s gradients"):
                fsdp_reduce_gradients(self.stages[stage])

    def wait(self, stage: int) -> None:
        """Wait for the reduction in flight of ``stage``'s gradients.

        Raises:
            PeerLostError: a replica did not join the reduction in time, naming them all.
        """
        buckets = self.in_flight[stage]
        with self._naming_lost(f"reducing stage {stage}'s gradients"):
            buckets.wait()
        buckets.check_finished()

    def end_step(self) -> None:
        """Reduce what this step added to the gradients of the shared parameters (after
        ``wait`` for every stage in flight)."""
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
        """Turn the backend's timeout or lost connection into a PeerLostError naming the rank
        lost (which may be another replica's: See Note [first lost rank])."""
        try:
            yield
        except PeerLostError:
            raise
        except RuntimeError as error:
            if not about_a_peer(error):  # this rank's own (an unsupported reduction...)
                me = self.peers.name(self.peers.me)
                raise RuntimeError(f"{me}: {doing} failed: {error}") from error
            ranks = dist.get_process_group_ranks(self.group)
            raise self.peers.lost_in(ranks, doing, error, self.timeout) from error

    def reshard(self) -> None:
        """Free gathered parameters (after inference, which has no backward to do it)."""
        for fsdp in self._fsdp.values():
            fsdp.reshard()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every stage's parameters whole for the body, then sharded again: for code that uses
        the modules' parameters outside their forward (decoding with a KV cache), where
        FSDP's hooks do not gather them."""
        for fsdp in self._fsdp.values():
            fsdp.unshard()
        try:
            yield
        finally:
            self.reshard()


def _closing(group: dist.ProcessGroup) -> Callable[[], None]:
    return lambda: close_group(group)


class _Pending(Sequence[float]):
    """A sequence of floats computed on first read (by ``compute``, which may wait)."""

    def __init__(self, compute: Callable[[], list[float]], length: int) -> None:
        self._compute: Callable[[], list[float]] | None = compute
        self._values: list[float] = []
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[float]: ...
    def __getitem__(self, index: int | slice) -> float | Sequence[float]:
        if self._compute is not None:
            self._values, self._compute = self._compute(), None
        return self._values[index]


def reduces_in_flight(fsdp: bool, split_backward: bool, tensor_parallel: bool = False) -> bool:
    """Whether a replicated stage's gradients are reduced by DDP's reducer during its last
    backward, behind the rest of the step (else by FSDP2 right after it, in line): when the
    stage is not sharded, its weight gradients come from its backward's own autograd hooks
    (no split backward) and its parameters are plain tensors (no tensor parallelism).

    See Note [reductions in flight].
    """
    return not fsdp and not split_backward and not tensor_parallel


def _trainable(module: nn.Module, ignored: set[nn.Parameter]) -> frozenset[str]:
    """Names of ``module``'s parameters that require gradients, but ``ignored``."""
    return frozenset(
        name for name, p in module.named_parameters() if p.requires_grad and p not in ignored
    )


class _Buckets:
    """DDP's reducer over one stage's parameters, driven by hand: armed before the stage's
    last backward, its buckets' all-reduces started by a hook and waited for at the step's
    end; See Note [reductions in flight]."""

    def __init__(
        self,
        stage: int,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        buckets_group: dist.ProcessGroup,
        divisor: int,
    ) -> None:
        self.stage = stage
        self._group = buckets_group
        self._divisor = divisor
        # never in any graph: the reducer's search for unused parameters always finds one,
        # and so does not warn on every rank that it found none
        self._unused = nn.Parameter(torch.zeros(1, device=params[0].device))
        self._ddp = DistributedDataParallel(
            nn.ParameterList([*params, self._unused]),
            process_group=group,
            init_sync=False,  # every replica starts from replica 0's state already
            gradient_as_bucket_view=True,
            find_unused_parameters=True,
        )
        # a lambda: DDP checks a hook's annotations against classes, which postponed
        # annotations (this module's) would fail
        self._ddp.register_comm_hook(self, lambda buckets, bucket: buckets.start(bucket))
        self._works: list[dist.Work] = []
        self._armed = self._finished = False

    def arm(self, roots: Sequence[torch.Tensor]) -> None:
        self._ddp.reducer.prepare_for_backward(list(roots))
        self._armed, self._finished = True, False

    def start(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start the bucket's all-reduce, in place, and tell DDP it is done already."""
        buffer = bucket.buffer()
        if self._divisor != 1:
            buffer.div_(self._divisor)
        work = dist.all_reduce(buffer, group=self._group, async_op=True)
        assert work is not None
        self._works.append(work)
        self._finished = bucket.is_last()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def wait(self) -> None:
        """Wait for every bucket's all-reduce of this step."""
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def check_finished(self) -> None:
        """Raise if the reducer was armed and did not reduce every bucket."""
        armed, self._armed = self._armed, False
        if armed and not self._finished:
            raise RuntimeError(
                f"stage {self.stage}: none of its trainable parameters got a gradient in the "
                "last micro-batch's backward, so DDP's reducer, which reduces as the backward "
                "produces gradients, never ran; freeze the parameters that never get one "
                "(requires_grad_(False)) or pass fsdp=True"
            )


def _same_ranks(group: dist.ProcessGroup, timeout: timedelta) -> dist.ProcessGroup:
    """A second group of ``group``'s ranks (made by them alone), for the buckets' all-reduces:
    DDP's reducer waits at the end of the backward for a small all-reduce of its own, which
    would queue behind the buckets' on one group; See Note [reductions in flight]."""
    made: dist.ProcessGroup = dist.new_group(
        dist.get_process_group_ranks(group),
        backend=dist.get_backend(group),
        timeout=timeout,
        use_local_synchronization=True,
    )
    return made


def _fsdp(module: nn.Module) -> FSDPModule:
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(module, FSDPModule), "DataParallel wraps every stage"
    return module


def _shared_parameters(
    stages: dict[int, nn.Module], also: Sequence[nn.Parameter]
) -> list[nn.Parameter]:
    """Parameters that more than one of ``stages`` holds, and those of ``also`` the stages
    hold, in a fixed order."""
    seen: dict[int, nn.Parameter] = {}
    shared: dict[int, nn.Parameter] = {id(p): p for p in also}
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
