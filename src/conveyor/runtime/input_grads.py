"""Gradients of model inputs that stages on several ranks read, gathered where the input enters.

    gather = InputGradients(graph, rank, p2p)
    gather.begin()                    # at the start of a training step
    x = gather.leaf(k, "x", x_k)     # a stage on another rank than x's home reads x
    ...                               # the step's backward fills the leaves' .grad
    gather.finish(microbatches)       # every rank: home ranks backpropagate what others send

See Note [input gradients].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conveyor.graph import StageGraph
from conveyor.runtime.backward import grad_leaves
from conveyor.runtime.comm import P2P, Meta
from conveyor.torch_compat import pytree

__all__ = ["InputGradients"]


# Note [input gradients]:
# Every rank holds the whole batch, and a stage reads a model input from its own rank's copy.
# When stages on several ranks read one input (a residual around a cut, a mask every stage
# uses), each rank's backward would leave its share of that input's gradient in its own copy,
# and ``x.grad`` on the rank where x enters the model would lack the others' terms. So a rank
# other than the input's *home* (the rank of the first stage that reads it) gives its stages
# a detached leaf instead, and at the end of the step sends the leaf's gradient (one message
# per input, every micro-batch's gradients in it) to the home rank, which backpropagates it
# into its own micro-batch of the input: ``x.grad`` on the home rank is then the full
# gradient, as in plain training, and other ranks' ``x.grad`` is left untouched. Only inputs
# that require a gradient are gathered; the others cost nothing.
class InputGradients:
    """One rank's part in gathering the gradients of model inputs read on several ranks."""

    def __init__(self, graph: StageGraph, rank: int, p2p: P2P) -> None:
        self.rank = rank
        self.p2p = p2p
        readers: dict[str, list[int]] = {}
        for stage in graph.stages:  # in stage order: the first reader is the home
            for name in stage.inputs:
                if graph.producer(name) is None and stage.rank not in readers.get(name, []):
                    readers.setdefault(name, []).append(stage.rank)
        self._home = {name: ranks[0] for name, ranks in readers.items()}
        self._senders = {
            name: ranks[1:] for name, ranks in readers.items() if ranks[0] == rank and ranks[1:]
        }
        """Inputs whose home is this rank, and the other ranks that read them."""
        self._leaves: dict[tuple[str, int], Any] = {}

    def begin(self) -> None:
        """Forget what an earlier step (perhaps one that failed) left."""
        self._leaves.clear()

    def leaf(self, k: int, name: str, value: Any) -> Any:
        """What a stage on this rank reads for model input ``name`` of micro-batch ``k``."""
        if self._home.get(name, self.rank) == self.rank or not grad_leaves(value):
            return value
        key = (name, k)
        if key not in self._leaves:
            self._leaves[key] = pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), value
            )
        return self._leaves[key]

    def has_work(self, microbatches: Sequence[dict[str, Any]]) -> bool:
        """Whether ``finish`` sends or receives anything this step."""
        return bool(self._leaves) or any(
            grad_leaves(batch[name]) for name in self._senders for batch in microbatches
        )

    def finish(self, microbatches: Sequence[dict[str, Any]]) -> None:
        """Send this rank's input gradients home, then backpropagate those sent here.

        Collective over the ranks that read a shared input; call after every backward.
        """
        for name in sorted({name for name, _ in self._leaves}):
            grads = [
                _or_zeros(leaf)
                for k in range(len(microbatches))
                for leaf in grad_leaves(self._leaves.get((name, k), []))
            ]
            self.p2p.send(grads, self._home[name], f"the gradient of model input {name!r}")
        self._leaves.clear()
        for name, senders in sorted(self._senders.items()):
            mine = [leaf for batch in microbatches for leaf in grad_leaves(batch[name])]
            if not mine:
                continue
            meta = Meta.of([torch.empty_like(t, device="meta") for t in mine])
            for sender in senders:
                describe = f"the gradient of model input {name!r} from rank {sender}"
                grads = self.p2p.wait(self.p2p.post(sender, meta, describe))
                torch.autograd.backward(*_merged(mine, grads))


def _or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


def _merged(
    tensors: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One root per distinct tensor (an input every micro-batch shares appears once per
    micro-batch), its gradients summed."""
    total: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for tensor, grad in zip(tensors, grads, strict=True):
        known = total.get(id(tensor))
        total[id(tensor)] = (tensor, grad if known is None else known[1] + grad)
    return [t for t, _ in total.values()], [g for _, g in total.values()]
