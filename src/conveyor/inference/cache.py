"""Static KV caches: each block's keys and values, preallocated for the whole generation.

cache = StaticKV(rows=8, heads=4, capacity=160, head_dim=16, dtype=torch.float32)
keys, values = cache.extend(new_keys, new_values)   # every position so far
"""

from __future__ import annotations

import torch

__all__ = ["StaticKV"]


class StaticKV:
    """One block's keys and values for one group of sequences, allocated once for
    ``capacity`` positions, so a generation never reallocates and its memory is known before
    it starts (``nbytes``)."""

    def __init__(
        self,
        rows: int,
        heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (rows, heads, capacity, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0
        """Positions filled so far."""

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys`` and ``values`` (rows, heads, new positions, head dim) after the
        filled positions; return views of every filled position.

        Raises:
            RuntimeError: the new positions do not fit the capacity.
        """
        end = self.length + keys.shape[2]
        if end > self.capacity:
            raise RuntimeError(
                f"KV cache of {self.capacity} positions cannot take {keys.shape[2]} more after "
                f"{self.length}; size it for the prompt plus every new token"
            )
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]
