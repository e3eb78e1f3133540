"""Run a model to measure it, and leave it exactly as it was.

    with untouched(model):
        model.train()
        model(batch).sum().backward()   # costs measured; running stats, .grad, modes restored

Measuring a model (auto_split costs its operations, the planner's profiler times its layers)
runs it in train mode, which moves BatchNorm running statistics, accumulates ``.grad`` and
draws from the random generators; a user who measures and then trains must find the model,
and the random streams, as they left them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn

__all__ = ["untouched"]


@contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    """Restore, on exit, every submodule's train/eval mode, every buffer (object and value),
    every parameter's ``.grad`` (cleared while inside) and the random generators' states."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [
        (owner, name, buffer, buffer.detach().clone())
        for owner in model.modules()
        for name, buffer in owner.named_buffers(recurse=False)
    ]
    grads = [(p, p.grad) for p in model.parameters()]
    for p, _ in grads:
        p.grad = None
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
            for kind, indices in _accelerators(model).items():
                stack.enter_context(torch.random.fork_rng(devices=indices, device_type=kind))
            yield
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for owner, name, buffer, value in buffers:
                setattr(owner, name, buffer)
                buffer.copy_(value)
        for p, grad in grads:
            p.grad = grad


def _accelerators(model: nn.Module) -> dict[str, list[int]]:
    """The accelerator devices the model lives on, by device type."""
    found: dict[str, list[int]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        kind = tensor.device.type
        if kind not in ("cpu", "meta"):
            index = tensor.device.index or 0
            if index not in found.setdefault(kind, []):
                found[kind].append(index)
    return found
