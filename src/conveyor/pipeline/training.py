"""Training-loop pieces that span the whole mesh: the global gradient norm and clipping, the
step's loss on every rank, and a throughput meter.

    norm = pipe.clip_grad_norm_(1.0)            # over stages, replicas and shards
    meter = Throughput(num_replicas=pipe.num_replicas, tokens_per_sample=seq_len)
    rates = meter.update(batch_size); logger.info("step %d | %s", step, rates)
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from conveyor.runtime.sharded import is_dtensor, local

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

    from conveyor.parallel import PipelineMesh

__all__ = ["Rates", "Throughput", "clip_grad_norm_", "share_loss"]


# Note [global gradient norm]:
# The norm of the whole model's gradient, as plain training computes it, from parts spread
# over stages (pipeline ranks), replicas (dp) and shards (FSDP, tensor parallelism). Each
# element is counted exactly once: a sharded gradient (a DTensor placed Shard on some mesh
# dimension) by every rank for its own shard; a gradient replicated over a dimension (a
# Replicate placement, or a plain tensor, which every replica and tensor-parallel rank holds
# whole) only by the rank at coordinate 0 of that dimension; a weight tied across stages only
# by its first stage's rank. The per-rank sums of |g|^p are then added over every rank of the
# job (the maximum, for the infinity norm), and every rank scales its gradients by the same
# factor, as torch.nn.utils.clip_grad_norm_ does.
def clip_grad_norm_(
    parameters: list[torch.nn.Parameter],
    tied_elsewhere: set[int],
    mesh: PipelineMesh | None,
    group: dist.ProcessGroup | None,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale every gradient of the pipelined model so that their global norm is at most
    ``max_norm``; returns the norm before clipping, on every rank (collective over the job).

    ``parameters`` are this rank's, ``tied_elsewhere`` the ids of those a tie counts on
    another rank, ``group`` the pipeline's. See Note [global gradient norm].

    Raises:
        RuntimeError: with ``error_if_nonfinite``, the norm is NaN or infinite.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    counted = [
        local(p.grad) for p in _counted(parameters, tied_elsewhere, mesh) if p.grad is not None
    ]
    total = _global_norm(None if mesh is not None else group, counted, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the global gradient norm of order {norm_type} is {total.item()}; "
            "pass error_if_nonfinite=False to clip anyway, or lower the learning rate"
        )
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            local(grad).mul_(scale.to(grad.dtype))
    return total


def _counted(
    parameters: list[torch.nn.Parameter], skipped: set[int], mesh: PipelineMesh | None
) -> list[torch.nn.Parameter]:
    """This rank's parameters with a gradient whose elements it counts in the global norm."""
    coordinates = {} if mesh is None else {"dp": mesh.replica, "tp": mesh.tp_index}
    chosen: list[torch.nn.Parameter] = []
    for param in parameters:
        if id(param) in skipped or param.grad is None:
            continue
        names: tuple[str, ...] = ()
        if is_dtensor(param):
            if not _first_of_replicas(param):
                continue
            names = tuple(param.device_mesh.mesh_dim_names or ())
        # a dimension the tensor does not know about holds it whole on every rank
        if all(c == 0 for name, c in coordinates.items() if name not in names):
            chosen.append(param)
    return chosen


def _first_of_replicas(tensor: DTensor) -> bool:
    """Whether this rank is at coordinate 0 of every mesh dimension ``tensor`` is replicated
    over (so it holds the copy that counts)."""
    from torch.distributed.tensor import Replicate  # loaded: tensor is a DTensor

    coordinate = tensor.device_mesh.get_coordinate() or ()
    placements = tensor.placements
    return all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p == Replicate())


def _global_norm(
    group: dist.ProcessGroup | None, grads: list[torch.Tensor], norm_type: float
) -> torch.Tensor:
    """The norm of order ``norm_type`` of ``grads`` over every rank of ``group`` (the job's:
    None on a mesh, which spans the world)."""
    if math.isinf(norm_type):
        part = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
        total = torch.tensor(part, dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return total
    part = sum(
        (float(torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)) ** norm_type)
        for g in grads
    )
    total = torch.tensor(part, dtype=torch.float64)
    dist.all_reduce(total, group=group)
    return total ** (1.0 / norm_type)


def share_loss(
    loss: torch.Tensor | None,
    device: torch.device,
    mesh: PipelineMesh | None,
    group: dist.ProcessGroup | None,
    source: int,
    summed: bool,
) -> torch.Tensor:
    """The step's loss on every rank (a float64 scalar): the mean over replicas (the sum with
    ``loss_reduction="sum"``), sent from each replica's last stage to its other ranks.

    Collective over the job; the ranks that do not hold the last stage wait at most until it
    has finished its step, which in most schedules is before they finish theirs.
    """
    value = torch.zeros((), dtype=torch.float64, device=device)
    if loss is not None:
        value += loss.to(torch.float64)
        if mesh is not None and mesh.dp_mesh is not None and mesh.num_replicas > 1:
            dist.all_reduce(value, group=mesh.dp_mesh.get_group())
            if not summed:
                value /= mesh.num_replicas
    dist.broadcast(value, group=group, group_src=source)
    return value


@dataclass(frozen=True)
class Rates:
    """Throughput over the meter's window of steps."""

    step_s: float
    """Seconds per step."""
    samples_per_s: float
    """Samples per second of the whole job (every replica)."""
    samples_per_s_per_replica: float
    tokens_per_s: float | None
    mfu: float | None
    """Model FLOPs utilization: achieved model FLOP/s over the peak of every rank."""

    def __str__(self) -> str:
        text = (
            f"{self.step_s * 1e3:.1f} ms/step | {_si(self.samples_per_s)} samples/s "
            f"({_si(self.samples_per_s_per_replica)} per replica)"
        )
        if self.tokens_per_s is not None:
            text += f" | {_si(self.tokens_per_s)} tokens/s"
        if self.mfu is not None:
            text += f" | MFU {self.mfu:.1%}"
        return text


class Throughput:
    """Samples and tokens per second of the job and per replica, from step times.

    Call ``update(samples)`` once per step with the samples of the global batch; it returns
    the rates over the last ``window`` steps. With ``flops_per_sample`` (the model's forward
    and backward FLOPs per sample, e.g. 6 x parameters x tokens for a transformer) and
    ``peak_flops`` (one rank's peak FLOP/s), it gives MFU.
    """

    def __init__(
        self,
        *,
        num_replicas: int = 1,
        world_size: int | None = None,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak_flops: float | None = None,
        window: int = 20,
    ) -> None:
        if num_replicas < 1 or window < 1:
            raise ValueError(f"num_replicas and window must be >= 1, got {num_replicas}, {window}")
        self.num_replicas = num_replicas
        self.world_size = world_size or (dist.get_world_size() if dist.is_initialized() else 1)
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self._marks: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._marks.append((time.perf_counter(), 0))

    def update(self, samples: int) -> Rates:
        """Count one finished step of ``samples`` samples (over every replica)."""
        self._marks.append((time.perf_counter(), samples))
        (start, _), *rest = self._marks
        seconds = max(self._marks[-1][0] - start, 1e-9)
        done = sum(n for _, n in rest)
        per_s = done / seconds
        mfu = None
        if self.flops_per_sample is not None and self.peak_flops is not None:
            mfu = per_s * self.flops_per_sample / (self.peak_flops * self.world_size)
        return Rates(
            seconds / len(rest),
            per_s,
            per_s / self.num_replicas,
            None if self.tokens_per_sample is None else per_s * self.tokens_per_sample,
            mfu,
        )


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"
