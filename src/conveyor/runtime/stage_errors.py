"""Errors raised inside a stage's forward or the loss function, told with where they happened
and what to change.

    with stage_errors(rank, stage, k, ("h",), (h,)):
        out = module(h)

The error keeps its type (code that catches an IndexError still does); a note names the rank,
stage, micro-batch and input shapes, since a stage's traceback alone does not.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from conveyor.runtime.inplace import INPLACE_ON_LEAF
from conveyor.torch_compat import pytree

__all__ = ["check_loss", "loss_errors", "stage_errors"]


@contextmanager
def stage_errors(
    rank: int, stage: int, k: int, names: Sequence[str], inputs: Sequence[Any]
) -> Iterator[None]:
    """Add where and on what a stage's forward failed to any error it raises; turn autograd's
    in-place error into one that says what to change (See Note [in-place stage inputs])."""
    where = f"rank {rank} (stage {stage})"
    try:
        yield
    except RuntimeError as error:
        if INPLACE_ON_LEAF not in str(error):
            _note(error, where, k, names, inputs)
            raise
        raise RuntimeError(
            f"{where}: the stage writes an input in place, and autograd refuses in-place "
            "writes to a leaf that requires a gradient (the inputs a stage receives are such "
            "leaves; so is a model input that requires one, as in plain training). conveyor "
            "copies the inputs that a stage's traced code writes in place, but cannot see "
            "writes inside a module it keeps whole: write out of place there (e.g. "
            "nn.ReLU(inplace=False)) or move the cut so that the in-place layer does not "
            f"start a stage ({error})"
        ) from error
    except Exception as error:
        _note(error, where, k, names, inputs)
        raise


@contextmanager
def loss_errors(rank: int, stage: int, k: int, output: Any, target: Any) -> Iterator[None]:
    """Add where and on what ``loss_fn`` failed to any error it raises."""
    try:
        yield
    except Exception as error:
        error.add_note(
            f"conveyor: rank {rank} (stage {stage}), loss_fn of micro-batch {k} on the "
            f"output {_shapes(output)} and targets {_shapes(target)}"
        )
        raise


def check_loss(loss: Any, rank: int, k: int) -> torch.Tensor:
    """``loss`` if it is what a step can backpropagate from: a one-element tensor.

    Raises:
        TypeError: it is not a tensor, or holds more than one value.
    """
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = _shapes(loss) if isinstance(loss, torch.Tensor) else f"{type(loss).__name__}"
        raise TypeError(
            f"rank {rank}: loss_fn returned {got} for micro-batch {k}; it must return the "
            "micro-batch's loss as a tensor of one value (e.g. reduce it with .mean())"
        )
    return loss


def _note(
    error: BaseException, where: str, k: int, names: Sequence[str], inputs: Sequence[Any]
) -> None:
    shapes = ", ".join(f"{n} {_shapes(v)}" for n, v in zip(names, inputs, strict=True))
    hint = (
        "; an index beyond a table, such as a sequence longer than the model's position "
        "embeddings or a token id beyond its vocabulary, raises this"
        if isinstance(error, IndexError)
        else ""
    )
    error.add_note(f"conveyor: {where}, forward of micro-batch {k} on inputs {shapes}{hint}")


def _shapes(value: Any) -> str:
    shown = [
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        if isinstance(t, torch.Tensor)
        else repr(t)
        for t in pytree.tree_leaves(value)
    ]
    return shown[0] if len(shown) == 1 else f"[{', '.join(shown)}]"
