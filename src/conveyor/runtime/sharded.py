"""Tensors that may be DTensors (sharded by FSDP2 or tensor parallelism): this rank's part.

    local(param)          # a DTensor's local shard, or the tensor itself
    is_dtensor(tensor)    # without importing DTensor

The runtime works on this rank's parts only; what wraps a stage in DTensors lives in
conveyor.parallel, above the runtime.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "local"]


# Note [DTensor unimported]:
# Importing torch.distributed.tensor (and FSDP2, tensor parallelism and torch.distributed.
# checkpoint, which build on it) costs about as much again as importing torch itself: half a
# second or more of every rank's start and of every `conveyor` command. A pipeline without
# data or tensor parallelism and without checkpoints never needs it, so conveyor imports it
# only where it makes or reads DTensors, and asks whether a tensor is one without importing
# it: until something has imported the module, no tensor can be a DTensor.
def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor; See Note [DTensor unimported]."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
