"""Split a batch into micro-batches and merge per-micro-batch outputs back."""

from __future__ import annotations

from typing import Any

import torch

from conveyor.torch_compat import pytree

__all__ = ["batch_size", "merge", "split"]


def batch_size(value: Any) -> int | None:
    """First dimension of the first tensor with at least one dimension, or None if none."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def split(value: Any, num_microbatches: int, size: int | None = None) -> list[Any]:
    """Split every tensor whose first dimension is the batch size into ``num_microbatches``.

    Chunks differ by at most one sample (the first ``size % num_microbatches`` are larger), so
    any batch of at least ``num_microbatches`` samples works. Other leaves (scalars, tensors
    of another first dimension, non-tensors) are given whole to every micro-batch.
    """
    size = batch_size(value) if size is None else size
    if size is None:
        return [value] * num_microbatches
    if size < num_microbatches:
        raise ValueError(
            f"batch of {size} samples cannot be split into {num_microbatches} "
            f"micro-batches; use a batch of at least {num_microbatches} samples or "
            "fewer micro-batches"
        )
    leaves, spec = pytree.tree_flatten(value)
    columns = [
        torch.tensor_split(leaf, num_microbatches)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == size
        else [leaf] * num_microbatches
        for leaf in leaves
    ]
    return [pytree.tree_unflatten([c[k] for c in columns], spec) for k in range(num_microbatches)]


def merge(chunks: list[Any]) -> Any:
    """Concatenate per-micro-batch outputs along the first dimension (inverse of ``split``).

    Tensors with at least one dimension are concatenated; other leaves come from chunk 0.
    """
    columns = [pytree.tree_flatten(chunk)[0] for chunk in chunks]
    spec = pytree.tree_flatten(chunks[0])[1]
    merged = [
        torch.cat(list(column))
        if isinstance(column[0], torch.Tensor) and column[0].dim() > 0
        else column[0]
        for column in zip(*columns, strict=True)
    ]
    return pytree.tree_unflatten(merged, spec)
