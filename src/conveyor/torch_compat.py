"""Every private PyTorch API conveyor uses, in one place: why, and what would replace it.

Internal. A torch upgrade that moves one of these breaks this module alone; each use falls
back to a public API where one exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Pytrees (flatten a nested batch or message to tensors and back). torch's own pytree is what
# torch.export, DTensor and torch.distributed.pipelining use and what knows torch's containers
# (and transformers' ModelOutput, which registers itself), so a third-party pytree (optree)
# would disagree with it. Replace with ``torch.utils.pytree`` once torch makes it public.
import torch.utils._pytree as pytree

__all__ = [
    "close_gloo_group",
    "default_store",
    "flatten_state_dict",
    "grad_unchecked",
    "pytree",
    "tensor_version",
]
"""Internal to conveyor: listed so that its modules may import them."""


_CLOSING_TAG = 0x0C0FFEE
"""A point-to-point tag conveyor never sends on (it sends on tag 0)."""


def close_gloo_group(group: dist.ProcessGroup) -> None:
    """Close this rank's connections in the gloo ``group``, so that every peer blocked on one
    of them fails at once ("Connection closed by peer"), as if this process had died.

    gloo has no call for it: ``ProcessGroup.abort()``, ``shutdown()`` and
    ``destroy_process_group`` leave the connections open (measured on torch 2.13: a peer's
    pending receive still waits its whole timeout). A wait that times out does close them:
    gloo then signals the timeout to every connection of the group's context
    (gloo/transport/tcp/unbound_buffer.cc, ``Context::signalException``). So this posts a
    receive on a tag no one sends to and lets its wait time out after 1 ms, from each peer in
    turn, as the receive from a peer already gone fails at once, without the timeout that
    closes the others. Replace it with
    ``ProcessGroup.abort()`` once gloo implements it. The group is unusable afterwards.
    """
    rank = dist.get_rank(group)
    for peer in range(dist.get_world_size(group)):  # a closed connection fails at once: next
        if peer == rank:
            continue
        try:
            work = dist.irecv(torch.empty(1), group=group, group_src=peer, tag=_CLOSING_TAG)
            assert work is not None
            work.wait(timedelta(milliseconds=1))
        except RuntimeError:  # the timeout, which closed the connections, or a closed one
            continue


def default_store() -> torch._C._distributed_c10d.Store | None:
    """The store the default process group rendezvoused through (outlives every rank), or
    None. No public API returns it; ``torch.distributed.distributed_c10d._get_default_store``
    is what torch's own elastic and checkpoint code use."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        store: torch._C._distributed_c10d.Store = get()
    except (RuntimeError, ValueError):  # no default group (anymore)
        return None
    return store


def flatten_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A nested state dict flattened to the keys torch.distributed.checkpoint stores
    (``model.layer.weight``, ``optim.state.0.exp_avg``); to match a checkpoint's metadata
    before loading it. DCP has no public flattening helper; this is its own
    (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``)."""
    from torch.distributed.checkpoint._nested_dict import (
        flatten_state_dict as flatten,  # private: see above
    )

    flat, _ = flatten(state)
    return dict(flat)


def grad_unchecked(
    outputs: Sequence[torch.autograd.graph.GradientEdge],
    inputs: Sequence[torch.autograd.graph.GradientEdge],
    grads: Sequence[torch.Tensor],
    keep_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=keep_graph,
    allow_unused=True)`` without its Python shape checks, when torch has its engine entry.

    Those checks rebuild a node's input metadata for every GradientEdge (about 0.1 ms a call,
    where the engine itself takes 0.02); the split backward's W makes one call per weight
    group with gradients autograd itself produced, so the checks cannot fail. The public
    ``torch.autograd.grad`` (used when the entry is missing) computes the same.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        return torch.autograd.grad(
            outputs, inputs, grads, retain_graph=keep_graph, allow_unused=True
        )
    found: tuple[torch.Tensor | None, ...] = run(
        tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate_grad=False
    )
    return found


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor`` has seen (autograd's version counter, which it uses
    to catch saved tensors modified in place). No public API exposes it; conveyor uses it to
    tell whether anything has written a tensor since it was allocated."""
    version: int = tensor._version
    return version
