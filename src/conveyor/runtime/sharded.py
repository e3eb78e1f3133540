"""Tensors that may be DTensors (sharded by FSDP2 or tensor parallelism): this rank's part.

    local(param)          # a DTensor's local shard, or the tensor itself

The runtime works on this rank's parts only; what wraps a stage in DTensors lives in
conveyor.parallel, above the runtime.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["local"]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
