"""Read a pipelined checkpoint on one process, without a process group: into a plain model,
or as a flat dictionary of everything it holds."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load

from conveyor.checkpoint.manifest import (
    METADATA,
    CheckpointError,
    Manifest,
    read_manifest,
    verify,
)

__all__ = ["load_model", "model_state_dict", "read_checkpoint"]


def read_checkpoint(path: str | os.PathLike[str], prefix: str = "") -> dict[str, Any]:
    """Every entry of the checkpoint whose key starts with ``prefix``, with ``prefix``
    removed; keys are flat (``model.0.weight``, ``optimizer.state.0.weight.exp_avg``,
    ``progress.step``). The checkpoint is verified first.

    Raises:
        CheckpointError: the checkpoint is invalid, naming the file and the cause.
    """
    checkpoint = Path(path).absolute()
    verify(checkpoint)
    metadata = FileSystemReader(checkpoint).read_metadata()
    template: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            template[key] = (
                torch.empty(entry.size, dtype=entry.properties.dtype)
                if isinstance(entry, TensorStorageMetadata)
                else None
            )
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            load(template, storage_reader=FileSystemReader(checkpoint), no_dist=True)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(checkpoint, None, f"reading failed: {error}") from None
    return {key[len(prefix) :]: value for key, value in template.items()}


def model_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers, keyed like the plain model's state_dict."""
    return read_checkpoint(path, "model.")


def load_model(path: str | os.PathLike[str], model: nn.Module, strict: bool = True) -> Manifest:
    """Load a pipelined checkpoint into the plain (unsplit) ``model``; returns its manifest.

    Raises:
        CheckpointError: the checkpoint is invalid, or (with ``strict``) its parameter names
            differ from the model's.
    """
    checkpoint = Path(path).absolute()
    state = model_state_dict(checkpoint)
    wanted = set(model.state_dict())
    missing, unused = sorted(wanted - set(state)), sorted(set(state) - wanted)
    if strict and (missing or unused):
        raise CheckpointError(
            checkpoint,
            METADATA,
            f"parameter-name mismatch with "
            f"{type(model).__name__}: missing {missing[:4]}"
            f"{' ...' if len(missing) > 4 else ''}, not in the model "
            f"{unused[:4]}{' ...' if len(unused) > 4 else ''}; pass the model "
            "the checkpoint was saved from, or strict=False",
        )
    try:
        model.load_state_dict(state, strict=strict)
    except RuntimeError as error:
        raise CheckpointError(
            checkpoint, METADATA, f"cannot load into {type(model).__name__}: {error}"
        ) from error
    return read_manifest(checkpoint)
