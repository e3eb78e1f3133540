"""Split a batch into micro-batches and merge per-micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Sequence
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


def merge(
    chunks: list[Any],
    weights: Sequence[float] | None = None,
    sizes: Sequence[int | None] | None = None,
) -> Any:
    """Concatenate per-micro-batch outputs along the first dimension (inverse of ``split``).

    Tensors whose first dimension is their micro-batch's size (``sizes``; without them, any
    tensor with a dimension) are concatenated. A leaf that is the same in every micro-batch
    is kept. A floating-point scalar that differs (a loss) is the sum of the micro-batches'
    weighted by ``weights``, their shares of the step's loss (conveyor.runtime.loss; default:
    the mean).

    Raises:
        ValueError: another kind of leaf differs between micro-batches.
    """
    columns = [pytree.tree_flatten(chunk)[0] for chunk in chunks]
    spec = pytree.tree_flatten(chunks[0])[1]
    shares = list(weights) if weights is not None else [1 / len(chunks)] * len(chunks)
    return pytree.tree_unflatten(
        [
            _merged(list(column), shares, sizes, i)
            for i, column in enumerate(zip(*columns, strict=True))
        ],
        spec,
    )


def _merged(
    column: list[Any], weights: list[float], sizes: Sequence[int | None] | None, index: int
) -> Any:
    first = column[0]
    if _batched(column, sizes):
        return torch.cat(column)
    if all(_same(first, other) for other in column[1:]):
        return first
    if isinstance(first, torch.Tensor) and first.dim() == 0 and first.is_floating_point():
        parts = [w * value for w, value in zip(weights, column, strict=True) if w]
        return sum(parts, torch.zeros_like(first))
    shown = (
        f"shape {tuple(first.shape)}, not led by the micro-batch's size"
        if isinstance(first, torch.Tensor)
        else f"{first!r}, {column[1]!r}, ..."
    )
    raise ValueError(
        f"output leaf {index} ({type(first).__name__}) differs between micro-batches "
        f"({shown}) and is neither a batch to concatenate nor a loss to weigh; return it with "
        "a batch dimension first, so that it can be concatenated"
    )


def _batched(column: list[Any], sizes: Sequence[int | None] | None) -> bool:
    """Whether ``column`` holds one micro-batch's part of a batch each: tensors whose first
    dimension is their micro-batch's size."""
    if not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in column):
        return False
    return sizes is None or all(t.shape[0] == n for t, n in zip(column, sizes, strict=True))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a is b or a == b)
