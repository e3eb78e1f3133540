"""A batch as one step's inputs: bound to the model's inputs, cut into micro-batches, each
weighed by what its loss averages over, and fingerprinted for the ranks' check.

    batching = Batching(graph, config, loss_fn, model, device, rank, stages, ...)
    step = batching.inputs(inputs, targets, is_training=True, step_index=3)   # StepInputs
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from conveyor.config import PipelineConfig
from conveyor.graph import StageGraph
from conveyor.hf.loss import LABELS, label_counts, takes_labels
from conveyor.parallel import DataParallel
from conveyor.pipeline.uninitialized import Unset
from conveyor.runtime import microbatch
from conveyor.runtime.comm import Meta
from conveyor.runtime.fingerprint import autocast_state, fingerprint
from conveyor.runtime.interpreter import LossFn, StepInputs
from conveyor.runtime.loss import LossReduction, counted_tokens, loss_weights
from conveyor.split import bind_inputs
from conveyor.torch_compat import pytree

__all__ = ["Batching", "check_loss", "check_targets", "signature"]


@dataclass
class Batching:
    """How this rank turns a batch into a step's inputs (See Note [batch fingerprint] for
    what every rank compares before the first message)."""

    graph: StageGraph
    config: PipelineConfig
    loss_fn: LossFn | None
    model: nn.Module | StageGraph
    device: torch.device
    rank: int
    stages: Mapping[int, nn.Module]
    data_parallel: DataParallel | None
    runs: int
    """Digest of what every rank must run alike (Program, split, recomputation, seed)."""
    replica: int
    unset: Unset
    frozen: Callable[[], list[int]]
    """Indices of this rank's parameters that do not require gradients, now."""

    def inputs(self, inputs: Any, targets: Any, is_training: bool, step_index: int) -> StepInputs:
        """The step's micro-batches, their signatures, targets and loss weights."""
        m = self.config.num_microbatches
        bound = bind_inputs(self.graph, inputs)
        size = microbatch.batch_size(bound)
        if not is_training and size:  # inference: a batch smaller than m runs as it is
            m = min(m, size)
        chunks = microbatch.split(bound, m, size)
        check_targets(targets, size)
        split_targets = None if targets is None else microbatch.split(targets, m, size)
        if is_training and self.loss_fn is None and bound.get(LABELS) is None:
            raise ValueError(
                f"the batch has no {LABELS!r}: without loss_fn, the model computes its own loss "
                f"and needs its labels; pass them in the batch, e.g. {{'input_ids': ids, "
                f"'{LABELS}': ids}}"
            )
        weights = self._weights(chunks, split_targets, is_training, m, size)
        where = f"rank {self.rank} (stages {list(self.stages)})"
        mine = fingerprint(
            bound,
            targets,
            is_training,
            self.device,
            size,
            self.unset.problem(where),
            self.frozen(),
            self.runs,
        )
        return StepInputs(
            chunks,
            [signature(c, self.device) for c in chunks],
            split_targets,
            weights,
            step_index,
            is_training,
            fingerprint=mine,
            first_microbatch=self.replica * m,
        )

    def _weights(
        self,
        chunks: list[dict[str, Any]],
        targets: list[Any] | None,
        is_training: bool,
        m: int,
        size: int | None,
    ) -> Sequence[float]:
        """Each micro-batch's share of the step's loss (over the replicas when training on
        the last stage's rank: conveyor.runtime.loss)."""
        if not size:
            return [1.0] * m
        kind, counts = self._loss_counts(chunks, targets)
        data = self.data_parallel
        if data is None or not is_training or self.graph.sink not in self.stages:
            return loss_weights(kind, counts)
        return data.loss_weights(kind, counts)

    def _loss_counts(
        self, chunks: list[dict[str, Any]], targets: list[Any] | None
    ) -> tuple[LossReduction, list[int]]:
        """How micro-batch losses add up and what each averages over: the model's own loss
        counts as its code does (conveyor.hf.loss), a loss_fn its samples or, with
        'token_mean', its targets that are not -100."""
        reduction = self.config.loss_reduction
        own_loss = self.loss_fn is None and chunks and chunks[0].get(LABELS) is not None
        if own_loss and isinstance(self.model, nn.Module):
            counts = label_counts(self.model, [chunk[LABELS] for chunk in chunks], chunks[0])
            return ("sum" if reduction == "sum" else "mean"), counts
        if reduction == "token_mean" and targets is not None:
            return reduction, [counted_tokens(t) for t in targets]
        return reduction, [microbatch.batch_size(c) or 0 for c in chunks]


def check_loss(loss_fn: LossFn | None, targets: Any, model: nn.Module | StageGraph) -> None:
    """A loss_fn with targets, or no loss_fn and labels for the model's own loss."""
    own = loss_fn is None and targets is None and isinstance(model, nn.Module)
    if (loss_fn is None or targets is None) and not own:
        raise ValueError(
            f"step() trains, which needs a loss: pass loss_fn=... to Pipeline "
            f"and targets to step() (loss_fn is "
            f"{'set' if loss_fn else 'None'}, targets is "
            f"{'set' if targets is not None else 'None'}), or, without loss_fn, labels in "
            "the batch of a model that computes its own loss (a Hugging Face model); use "
            "forward() for inference"
        )
    if own and isinstance(model, nn.Module) and not takes_labels(model):
        raise ValueError(
            f"step() trains, which needs a loss: {type(model).__name__} takes no labels, "
            "so it computes no loss of its own; pass loss_fn=... to Pipeline and targets "
            "to step()"
        )


def check_targets(targets: Any, size: int | None) -> None:
    """Refuse targets none of whose tensors has the batch's samples: each micro-batch would
    get them whole, and train on the wrong targets without an error."""
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    batched = [shape for shape in shapes if shape]
    if size is not None and batched and not any(shape[0] == size for shape in batched):
        raise ValueError(
            f"the targets hold no tensor of the batch's {size} samples (shapes {batched}); "
            f"give targets with the batch as their first dimension, {size} like the inputs'"
        )


def signature(chunk: dict[str, Any], device: torch.device) -> str:
    """Shapes, dtypes and constants of a micro-batch, and the autocast state (it changes the
    dtypes stages send): the key for exchanged shapes."""
    meta = Meta.of(chunk)
    leaves = [(leaf.shape, leaf.dtype, leaf.constant) for leaf in meta.leaves]
    return repr((meta.spec, leaves, autocast_state(device)))
