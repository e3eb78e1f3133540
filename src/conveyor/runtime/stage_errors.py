"""Errors raised inside a stage's forward, told with where they happened and what to change.

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

__all__ = ["stage_errors"]


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
