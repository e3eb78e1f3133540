"""Split backward: the input gradient now (I), the weight gradient later (W), with torch.autograd.

input_grads, weight = backward_input(roots, root_grads, inputs)   # I: send input_grads on
...                                                               # other work fills the gap
weight.run()                                                      # W: accumulate into .grad
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from conveyor.torch_compat import grad_unchecked, pytree

__all__ = ["WeightGrad", "backward_input", "grad_leaves"]


_Grads = tuple[torch.Tensor | None, ...]


# Note [split backward]:
# A stage's autograd graph runs from its roots (outputs, or the loss) to its leaves: the stage
# inputs and the weights. Call a node an *input node* if some path from it reaches a stage
# input; only input nodes run to compute the input gradient (I). Every other node reached
# from the roots lies on paths to weights only, and a path that leaves the input nodes never
# comes back to them. So each path from a root to a weight either starts outside the input
# nodes (a *weight-only root*) or leaves them exactly once, at a *frontier node*: an input
# node with an edge to a node outside.
#
#   loss ─▶ AddmmBackward(frontier) ─▶ TanhBackward ─▶ AddmmBackward(frontier) ─▶ input
#                 └─▶ TBackward ─▶ weight 2                └─▶ TBackward ─▶ weight 1
#
# I runs autograd.grad from the roots to the inputs with the graph retained, and a pre-hook
# on each frontier node keeps the gradient that arrives there. W re-enters the graph at the
# frontier nodes with those gradients and asks only for the weights, so autograd runs each
# frontier node for its weight edges only (its input edge is not needed) and then the
# weight-only nodes below it: the weight-gradient work, once, and none of I's.
#
# Frontier nodes whose weights overlap form a group, and each group is one autograd.grad
# call: one call for all of them would also walk the input path between two frontier nodes
# (it leads to the second one's weights) and redo I. Inside a group that walk can still
# happen (one weight used by two ops on the input path, e.g. tied weights on one stage); a
# pre-hook then pins each frontier node's gradient to the one kept by I, so nothing is
# counted twice.
def backward_input(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """Gradients of ``inputs`` (None where a root does not depend on one) and the deferred
    weight gradient, which holds only what it needs: the frontier nodes (with the
    activations they saved) and the gradients that reached them.

    ``root_grads[i]`` is the gradient of ``roots[i]`` (None for a scalar loss). ``inputs``
    are leaves; the graph of everything else is released once the returned WeightGrad runs
    or is dropped.
    """
    wanted = [x for x in inputs if x.requires_grad]
    if not wanted:  # a first stage: no input gradient, and W is the whole backward
        pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.requires_grad]
        return [None] * len(inputs), WeightGrad([], [r for r, _ in pairs], [g for _, g in pairs])
    edges, seeds = [], []
    for root, grad in zip(roots, root_grads, strict=True):
        if root.requires_grad:
            edges.append(get_gradient_edge(root))
            seeds.append(torch.ones_like(root) if grad is None else grad)
    graph = _Graph.of([e.node for e in edges], [get_gradient_edge(x).node for x in wanted])
    if graph.compiled:  # See Note [compiled stages]
        return _whole(roots, root_grads, inputs), WeightGrad([])
    kept: dict[Node, _Grads] = {}
    handles = [node.register_prehook(_keeper(kept, node)) for node in graph.frontier]
    try:
        from_inputs = [i for i, e in enumerate(edges) if e.node in graph.input_nodes]
        found: Sequence[torch.Tensor | None] = [None] * len(wanted)
        if from_inputs and wanted:
            found = grad_unchecked(
                [edges[i] for i in from_inputs],
                [get_gradient_edge(x) for x in wanted],
                [seeds[i] for i in from_inputs],
                keep_graph=True,
            )
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, wanted), found, strict=True))
    grads = [by_input.get(id(x)) for x in inputs]
    # every frontier node reaches an input, so I ran it and its pre-hook kept its gradients
    assert all(node in kept for node in graph.frontier), "a frontier node did not run in I"
    starts = [_Start(node, kept[node], pinned=True) for node in graph.frontier]
    starts += [
        _Start(e.node, _one_hot(e, s), pinned=False)
        for e, s in zip(edges, seeds, strict=True)
        if e.node not in graph.input_nodes
    ]
    return grads, WeightGrad(graph.group(starts))


# Note [compiled stages]:
# torch.compile (through AOTAutograd) turns a compiled region's whole backward into one
# autograd node, CompiledFunctionBackward, which computes the input and the weight gradients
# together. The split backward cannot cut inside it: I would run it with the graph retained
# and W would run it again, which doubles its work and which inductor refuses outright
# ("compiled with non-empty donated buffers": its backward may reuse the memory of what the
# forward saved, so it runs once). So a stage whose graph holds a compiled node runs its whole
# backward at I, accumulating the weight gradients there, and its W does nothing: the
# gradients are exact under every schedule, and zero-bubble schedules lose only the freedom to
# move that stage's weight-gradient work into the bubble.
_COMPILED = "CompiledFunction"
"""Start of the name of the autograd node of a torch.compile'd region."""


def _whole(
    roots: Sequence[torch.Tensor],
    root_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """One plain backward: the weight gradients accumulate now; the inputs' are returned."""
    pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True) if r.requires_grad]
    for x in inputs:
        x.grad = None
    torch.autograd.backward([r for r, _ in pairs], [g for _, g in pairs])
    return [x.grad if x.requires_grad else None for x in inputs]


def _keeper(kept: dict[Node, _Grads], node: Node) -> Callable[[_Grads], None]:
    def keep(grads: _Grads) -> None:
        kept[node] = tuple(grads)

    return keep


def _one_hot(edge: GradientEdge, grad: torch.Tensor) -> _Grads:
    """A root's gradient as the gradients of its node's outputs."""
    grads: list[torch.Tensor | None] = [None] * (edge.output_nr + 1)
    grads[edge.output_nr] = grad
    return tuple(grads)


@dataclass
class _Start:
    """Where W enters the graph: a node and the gradients of its outputs."""

    node: Node
    grads: _Grads
    pinned: bool
    """A frontier node: its gradients are final (kept by I), whatever else W sends it."""
    targets: int = 0
    """Bit mask of the weights (leaf indices) reachable from here without input nodes."""


@dataclass
class _Group:
    """Starts whose weights overlap: one autograd.grad call."""

    starts: list[_Start] = field(default_factory=list)
    targets: int = 0
    leaves: list[Node] = field(default_factory=list)
    """The weights' AccumulateGrad nodes, in bit order of ``targets``."""


@dataclass
class _Graph:
    """The part of a stage's autograd graph that backward_input needs to know."""

    input_nodes: set[Node]
    frontier: list[Node]
    leaves: list[Node]
    """Weight leaves (AccumulateGrad nodes) reachable from the roots."""
    reach: dict[Node, int]
    """For each node outside the input nodes: bit mask of the leaves it reaches."""
    outside_children: dict[Node, list[Node]]
    """For each frontier node: its children outside the input nodes."""
    compiled: bool = False
    """Whether a torch.compile'd region is among the nodes; See Note [compiled stages]."""

    @classmethod
    def of(cls, roots: Sequence[Node], input_leaves: Sequence[Node]) -> _Graph:
        order = _post_order(roots)  # children before parents
        is_input_leaf = set(input_leaves)
        input_nodes: set[Node] = set()
        reach: dict[Node, int] = {}
        leaves: list[Node] = []
        outside: dict[Node, list[Node]] = {}
        for node in order:
            children = [c for c, _ in node.next_functions if c is not None]
            if node in is_input_leaf or any(c in input_nodes for c in children):
                input_nodes.add(node)
                out = [c for c in children if c not in input_nodes and reach[c]]
                if out:
                    outside[node] = out
                continue
            mask = 0
            if not children and hasattr(node, "variable"):  # AccumulateGrad of a weight
                mask = 1 << len(leaves)
                leaves.append(node)
            for child in children:
                mask |= reach[child]
            reach[node] = mask
        compiled = any(node.name().startswith(_COMPILED) for node in order)
        return cls(input_nodes, list(outside), leaves, reach, outside, compiled)

    def group(self, starts: list[_Start]) -> list[_Group]:
        """Starts joined into groups whose weights are disjoint."""
        for start in starts:
            if start.node in self.outside_children:
                children = self.outside_children[start.node]
                start.targets = _union(self.reach[c] for c in children)
            else:
                start.targets = self.reach.get(start.node, 0)
        groups: list[_Group] = []
        for start in (s for s in starts if s.targets):
            merged = _Group([start], start.targets)
            rest = []
            for group in groups:
                if group.targets & merged.targets:
                    merged.starts += group.starts
                    merged.targets |= group.targets
                else:
                    rest.append(group)
            groups = [*rest, merged]
        for group in groups:
            group.leaves = [self.leaves[i] for i in _bits(group.targets)]
        return groups


class WeightGrad:
    """The deferred weight gradient of one stage and micro-batch; ``run`` it once."""

    def __init__(
        self,
        groups: list[_Group],
        roots: Sequence[torch.Tensor] = (),
        root_grads: Sequence[torch.Tensor | None] = (),
    ) -> None:
        self._groups = groups
        self._roots, self._root_grads = list(roots), list(root_grads)
        """A plain backward to run instead, when no input needs a gradient."""

    @property
    def is_empty(self) -> bool:
        return not self._groups and not self._roots

    def tensors(self) -> list[torch.Tensor]:
        """The gradients kept for W (for memory accounting)."""
        kept = [g for group in self._groups for s in group.starts for g in s.grads]
        return [g for g in kept + self._root_grads if g is not None]

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad``, as backward would, and free the
        graph."""
        if self._roots:
            roots, grads, self._roots, self._root_grads = self._roots, self._root_grads, [], []
            torch.autograd.backward(roots, grads)
        groups, self._groups = self._groups, []
        # A group of several starts may walk input-path nodes that other groups run too, so
        # those go first and keep the graph; a single start runs only its own nodes, and
        # frees them as it goes (less memory held, less allocator work).
        groups.sort(key=lambda group: len(group.starts) == 1)
        with _one_recomputation():
            for group in groups:
                _run_group(group, keep_graph=len(group.starts) > 1)


def _run_group(group: _Group, keep_graph: bool) -> None:
    outputs: list[GradientEdge] = []
    grads: list[torch.Tensor] = []
    for start in group.starts:
        for index, grad in enumerate(start.grads):
            if grad is not None:
                outputs.append(GradientEdge(start.node, index))
                grads.append(grad)
    pinned = [s for s in group.starts if s.pinned] if len(group.starts) > 1 else []
    handles = [s.node.register_prehook(_pin(s.grads)) for s in pinned]
    leaves = group.leaves
    try:
        found = grad_unchecked(
            outputs, [GradientEdge(leaf, 0) for leaf in leaves], grads, keep_graph
        )
    finally:
        for handle in handles:
            handle.remove()
    given = {g.untyped_storage().data_ptr() for g in grads}
    for leaf, grad in zip(leaves, found, strict=True):
        if grad is not None:
            _accumulate(leaf.variable, grad, given)  # type: ignore[attr-defined]


def _pin(grads: _Grads) -> Callable[[_Grads], _Grads]:
    def pin(_: _Grads) -> _Grads:
        return grads

    return pin


def _accumulate(weight: torch.Tensor, grad: torch.Tensor, given: set[int]) -> None:
    """``weight.grad += grad``; a ``grad`` that shares storage with a gradient W was given
    (which may be a buffer still being sent) is copied, not adopted."""
    if weight.grad is not None:
        weight.grad.add_(grad)
    elif grad.untyped_storage().data_ptr() in given:
        weight.grad = grad.detach().clone()
    else:
        weight.grad = grad.detach()


def _one_recomputation() -> AbstractContextManager[Any]:
    """Checkpointed regions recompute once for all of W's autograd calls, not once each."""
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    return nullcontext() if group is None else group()


def _post_order(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from ``roots``, each after all of its children (no recursion)."""
    order: list[Node] = []
    seen: set[Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(root.next_functions))]
        while stack:
            node, children = stack[-1]
            for child, _ in children:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append((child, iter(child.next_functions)))
                    break
            else:
                stack.pop()
                order.append(node)
    return order


def _union(masks: Any) -> int:
    total = 0
    for mask in masks:
        total |= mask
    return total


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def grad_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (any pytree) that carry a gradient back, in pytree order."""
    return [
        leaf
        for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
