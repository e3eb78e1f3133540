"""Split-invariant randomness: each micro-batch's random stream flows with its activations."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["RngState", "microbatch_seed", "rng_stream"]


# Note [micro-batch randomness]:
# Plain training of micro-batch k draws its dropout masks layer after layer from one stream.
# conveyor reproduces that stream across ranks: the first stage starts micro-batch k of step t
# from microbatch_seed(seed, t, k), and each stage hands its generator state, after its
# forward, to the next stage with the activations. The masks then depend on the seed, the step
# and the micro-batch only, never on the split or the schedule, and a plain model that seeds
# each micro-batch the same way draws the same masks. Recomputation (activation checkpointing)
# restores the state it started from, so it redraws the same masks too.
def microbatch_seed(seed: int, step: int, microbatch: int) -> int:
    """The seed micro-batch ``microbatch`` of step ``step`` starts from."""
    digest = hashlib.blake2b(f"{seed}:{step}:{microbatch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class RngState:
    """Generator states of the CPU and (if not CPU) the compute device."""

    cpu: torch.Tensor
    device: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        if device.type == "cpu":
            return cls(torch.get_rng_state())
        return cls(torch.get_rng_state(), torch.get_device_module(device).get_rng_state(device))

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(_own_storage(self.cpu))
        if self.device is not None:
            torch.get_device_module(device).set_rng_state(_own_storage(self.device), device)


def _own_storage(state: torch.Tensor) -> torch.Tensor:
    """``state``, copied if it is a view at an offset into a larger buffer (a received message,
    See Note [one message]): torch's generators read a state from the start of its storage,
    ignoring the offset (torch 2.13 rejects the state, or reads past the buffer's end)."""
    return state if state.storage_offset() == 0 else state.clone()


@contextmanager
def rng_stream(start: RngState | int, device: torch.device, end: list[RngState]) -> Iterator[None]:
    """Run the body on the stream ``start`` (a state or a seed); append the final state to
    ``end``. The caller's own generator state is left untouched."""
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        if isinstance(start, int):
            _seed(start, device)
        else:
            start.restore(device)
        yield
        end.append(RngState.capture(device))


def _seed(seed: int, device: torch.device) -> None:
    """Seed the CPU's generator and those of ``device``'s type, as ``torch.manual_seed`` does
    for them, and no others: it also queues a seed for every other device type, capturing a
    Python stack for each (about a millisecond a call on a CPU-only machine)."""
    torch.default_generator.manual_seed(seed)
    if device.type != "cpu":
        module = torch.get_device_module(device)
        getattr(module, "manual_seed_all", module.manual_seed)(seed)
