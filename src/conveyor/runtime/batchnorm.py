"""Deferred batch norm (torchgpipe): running statistics over the mini-batch, not the micro-batch.

model = DeferredBatchNorm.convert(model, num_microbatches=4)   # or deferred_batch_norm=True
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar, Token
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["DeferredBatchNorm", "recompute_context", "running_stats"]


_recomputing: ContextVar[bool] = ContextVar("conveyor_recomputing", default=False)


_RUNNING = ("running_mean", "running_var", "num_batches_tracked")
"""Names of the buffers a batch norm updates in a training forward."""


def running_stats(module: nn.Module) -> list[torch.Tensor]:
    """The running statistics of every batch norm in ``module`` (of its modules, or of an
    exported graph's batch norm operations: the buffers keep their names)."""
    return [b for name, b in module.named_buffers() if name.rsplit(".", 1)[-1] in _RUNNING]


class _Recomputing:
    """Marks the body as a recomputation, and puts ``stats`` back as they were before it: a
    forward run again must not move batch norms' running statistics a second time. Reusable,
    as a checkpoint may recompute twice (for a split backward's I and W)."""

    def __init__(self, stats: list[torch.Tensor]) -> None:
        self._stats = stats
        self._tokens: list[Token[bool]] = []
        self._saved: list[list[torch.Tensor]] = []

    def __enter__(self) -> None:
        self._tokens.append(_recomputing.set(True))
        self._saved.append([t.clone() for t in self._stats])

    def __exit__(self, *exc: object) -> None:
        _recomputing.reset(self._tokens.pop())
        for tensor, before in zip(self._stats, self._saved.pop(), strict=True):
            # through .data, as batch norm's own update: autograd saved these buffers for
            # backward, and a tracked in-place write would fail that backward
            tensor.data.copy_(before)


def recompute_context(
    stats: list[torch.Tensor] | None = None,
) -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``context_fn`` for ``torch.utils.checkpoint``: the recomputation in backward runs
    marked, so DeferredBatchNorm does not count a micro-batch twice, and leaves the running
    statistics ``stats`` (``running_stats`` of the stage) as the first forward left them."""
    return nullcontext(), _Recomputing(stats or [])


# Note [deferred batch norm]:
# A pipeline runs BatchNorm once per micro-batch. Normalizing each micro-batch with its own
# statistics is what the pipeline can do (a micro-batch's forward cannot wait for the others),
# but letting each micro-batch also update the running statistics would move them m times per
# step, with micro-batch variances. DeferredBatchNorm normalizes with the micro-batch's
# statistics, as torchgpipe does, and merges the micro-batches' means and variances (Chan's
# parallel formula: exact and stable) until it has seen m of them; then it updates the running
# statistics once, with the mini-batch's mean and unbiased variance, as nn.BatchNorm on the
# whole mini-batch would. Recomputation (activation checkpointing) is not counted again.
class DeferredBatchNorm(nn.Module):
    """BatchNorm whose running statistics move once per mini-batch of ``num_microbatches``.

    Shares nothing with nn.BatchNorm's private base; ``convert`` replaces a model's BatchNorm
    layers by this one, keeping their parameters and running buffers (same tensors, names and
    state_dict keys).
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        num_microbatches: int = 1,
    ) -> None:
        super().__init__()
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.num_microbatches = num_microbatches
        self.weight = nn.Parameter(torch.ones(num_features)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_features)) if affine else None
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        self._count = 0
        self._seen = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None

    @classmethod
    def convert(cls, module: nn.Module, num_microbatches: int) -> nn.Module:
        """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` (in place; ``module`` itself is
        returned, or its replacement if it is a BatchNorm)."""
        if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d):
            if not module.track_running_stats or module.running_mean is None:
                return module  # nothing to defer: it always uses the batch's statistics
            deferred = cls(
                module.num_features, module.eps, module.momentum, module.affine, num_microbatches
            )
            deferred.weight, deferred.bias = module.weight, module.bias
            deferred.running_mean = module.running_mean
            deferred.running_var = module.running_var  # type: ignore[assignment]  # tracked
            deferred.num_batches_tracked = module.num_batches_tracked  # type: ignore[assignment]
            deferred.train(module.training)
            return deferred
        for name, child in module.named_children():
            converted = cls.convert(child, num_microbatches)
            if converted is not child:
                setattr(module, name, converted)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_features:
            raise ValueError(
                f"DeferredBatchNorm expects (N, {self.num_features}, ...) input, "
                f"got shape {tuple(x.shape)}"
            )
        if not self.training:
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        if not _recomputing.get():
            self._track(x.detach())
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _track(self, x: torch.Tensor) -> None:
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        mean = x.mean(dims)
        m2 = ((x - mean.view(1, -1, *[1] * (x.dim() - 2))) ** 2).sum(dims)
        if self._mean is None or self._m2 is None:
            self._mean, self._m2 = mean, m2
        else:  # merge two groups' means and sums of squared deviations
            total = self._count + count
            delta = mean - self._mean
            self._mean = self._mean + delta * (count / total)
            self._m2 = self._m2 + m2 + delta**2 * (self._count * count / total)
        self._count += count
        self._seen += 1
        if self._seen == self.num_microbatches:
            self._commit()

    @torch.no_grad()
    def _commit(self) -> None:
        assert self._mean is not None and self._m2 is not None
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = self._m2 / max(self._count - 1, 1)
        mean, var = self._mean.to(self.running_mean.dtype), unbiased.to(self.running_var.dtype)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        self._count = self._seen = 0
        self._mean = self._m2 = None

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.weight is not None}, num_microbatches={self.num_microbatches}"
        )
