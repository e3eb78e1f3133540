"""Automatic split: trace a model, cost its operations, cut it into a DAG of stages.

    graph = auto_split(model, num_stages=3, example_inputs=(tokens, patches))
    graph = auto_split(model, 4, costs=profiled_seconds_by_module)   # e.g. from a profiler
    pipe = Pipeline(model, auto_split=True, example_inputs=batch)    # one stage per rank
The search itself is plain data in ``conveyor.split.cut``; this module turns a traced model into
that data and the chosen cut back into stages (``conveyor.split.build_stage_graph``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from conveyor.graph import StageGraph
from conveyor.split.capture import COMPUTE_OPS, HOW_TO_ANNOTATE
from conveyor.split.cut import DataflowGraph, best_cut
from conveyor.split.frontend import NO_MODULE, Traced, Tracer, capture
from conveyor.split.stages import build_stage_graph, place_attributes, sink_duplicates
from conveyor.split.untouched import untouched
from conveyor.torch_compat import pytree

__all__ = ["DEFAULT_BYTE_COST", "auto_split", "node_costs"]

logger = logging.getLogger(__name__)

DEFAULT_BYTE_COST = 4.0
"""FLOPs one byte received is worth, by default: a rough ratio of compute speed to
point-to-point bandwidth (tens of GFLOP/s against a few GB/s on CPU and gloo)."""


def auto_split(
    model: nn.Module,
    num_stages: int,
    *,
    example_inputs: Any = None,
    costs: Mapping[str, float] | None = None,
    num_microbatches: int = 4,
    placement: Sequence[int] | None = None,
    concrete_args: dict[str, Any] | None = None,
    leaf_modules: Sequence[str | type[nn.Module]] = (),
    byte_cost: float | None = None,
    keep_shared: bool = False,
    relay_skips: bool = False,
    tracer: Tracer = "auto",
) -> StageGraph:
    """Trace ``model`` and cut it into ``num_stages`` stages for the shortest pipeline step.

    Stages are contiguous runs of a topological order that keeps each branch together, so
    independent branches (two encoder towers, a dense and an embedding path) can land on
    different stages that run concurrently; the search weighs the worst stage against the
    depth of the stage graph by simulating a 1F1B step (conveyor.split.cut). Node costs are FLOPs
    plus elements produced, measured on ``example_inputs`` (a batch as ``Pipeline.step`` takes
    it), else parameter counts; ``costs`` (by node name or module qualified name, e.g. a
    profiler's per-layer times) overrides them. Each byte a stage receives adds ``byte_cost``
    to its cost (default ``DEFAULT_BYTE_COST`` with example inputs, else 0: sizes unknown).
    Cuts fall between submodules, going inside one only when it costs more than a stage
    should. A parameter used in several places (tied embeddings, a shared encoder) may end up
    in several stages, which the Pipeline keeps identical (conveyor.runtime.tied); ``keep_shared``
    keeps all its users in one stage instead.

    ``leaf_modules`` (qualified names, class names or classes) are kept whole: never traced by
    torch.fx, never cut inside when the model is split through torch.export (which it is when
    torch.fx cannot trace it and example inputs are given; see conveyor.split.frontend).

    Raises:
        TypeError: the model cannot be traced; the message names the operation and says how
            to keep a module whole (``leaf_modules``) or to annotate stages by hand.
        ValueError: too few places to cut, or unknown names in ``costs``.
    """
    leaves = tuple(leaf_modules)
    default = fx.Tracer()

    def is_leaf(m: nn.Module, name: str) -> bool:
        if name in leaves or type(m).__name__ in leaves:
            return True
        if any(isinstance(c, type) and isinstance(m, c) for c in leaves):
            return True
        return default.is_leaf_module(m, name)

    traced = capture(
        model,
        leaf=is_leaf,
        concrete_args=concrete_args,
        example_inputs=example_inputs,
        tracer=tracer,
        hint=_untraceable_advice,
    )
    graph = traced.graph
    nodes = [n for n in graph.nodes if n.op in COMPUTE_OPS]
    if len(nodes) < num_stages:
        raise ValueError(
            f"{type(model).__name__} traces to {len(nodes)} operations, too few "
            f"for {num_stages} stages; ask for fewer stages"
        )
    weights, sizes = node_costs(traced, example_inputs, costs)
    index = {n: i for i, n in enumerate(nodes)}
    dataflow = DataflowGraph(
        costs=[weights[n] for n in nodes],
        inputs=[[index[i] for i in n.all_input_nodes if i in index] for n in nodes],
        sizes=[sizes[n] for n in nodes],
        byte_cost=(DEFAULT_BYTE_COST if example_inputs is not None else 0.0)
        if byte_cost is None
        else byte_cost,
        units=_units(nodes, weights, num_stages, _whole(model, is_leaf)),
        together=_shared_users(traced.root, index) if keep_shared else (),
    )
    plan = best_cut(dataflow, num_stages, num_microbatches)
    logger.info(
        "auto split: stage costs %s, depth %d, est. 1F1B step %.3g (cost units)",
        [f"{c:.3g}" for c in plan.stage_costs],
        plan.depth,
        plan.step_time,
    )
    assignment = {n: plan.stage_of[i] for n, i in index.items()}
    assignment[next(n for n in graph.nodes if n.op == "output")] = num_stages - 1
    sink_duplicates(graph, assignment)
    for node in graph.nodes:
        if node.op == "placeholder":
            assignment[node] = 0
    place_attributes(graph, assignment, num_stages)
    placement = list(range(num_stages)) if placement is None else list(placement)
    if len(placement) != num_stages:
        raise ValueError(
            f"placement {placement} has {len(placement)} entries for "
            f"{num_stages} stages; give one rank per stage"
        )
    return build_stage_graph(traced, assignment, placement, relay_skips=relay_skips)


def _untraceable_advice(module: str) -> str:
    """How to get past code torch.fx cannot trace in ``module`` ('' for the model's forward)."""
    keep = (
        f"Keep the module that holds it whole with auto_split(..., leaf_modules=[{module!r}]) "
        "(it is then never traced)"
        if module
        else "It is in the model's own forward, which auto_split must trace: move that code "
        "into a submodule and name the submodule in auto_split(..., leaf_modules=[...]) (it "
        "is then never traced)"
    )
    return f"{keep}, or pass concrete_args for inputs that steer control flow. {HOW_TO_ANNOTATE}"


def node_costs(
    traced: Traced,
    example_inputs: Any = None,
    costs: Mapping[str, float] | None = None,
) -> tuple[dict[fx.Node, float], dict[fx.Node, float]]:
    """Forward cost and output bytes of each computing node of a traced model.

    With ``example_inputs``: FLOPs (torch.utils.flop_counter) plus elements produced, and
    bytes produced. Without: parameters used plus one, and one per output. ``costs`` maps node
    names or module qualified names to costs; a module's cost is spread over its nodes in
    proportion to their estimates, and nodes it does not cover cost nothing.
    """
    nodes = [n for n in traced.graph.nodes if n.op in COMPUTE_OPS]
    if example_inputs is not None:
        weights, sizes = _measure(traced, example_inputs)
    else:
        weights = {n: 1.0 + _parameters_used(traced.root, n) for n in nodes}
        sizes = {n: 1.0 for n in nodes}
    if costs is not None:
        weights = _given_costs(nodes, weights, costs)
    return weights, sizes


def _measure(
    traced: Traced, example_inputs: Any
) -> tuple[dict[fx.Node, float], dict[fx.Node, float]]:
    """Run the traced graph once on ``example_inputs``, counting FLOPs and bytes per node."""
    graph = traced.graph
    module = fx.GraphModule(traced.root, graph)
    bound = traced.binder(example_inputs)
    placeholders = [str(n.target) for n in graph.nodes if n.op == "placeholder"]
    is_meta = any(p.is_meta for p in traced.root.parameters())
    args = [bound.get(name) for name in placeholders]
    if is_meta:
        args = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), args)
    weights: dict[fx.Node, float] = {}
    sizes: dict[fx.Node, float] = {}

    class _Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            if n.op not in COMPUTE_OPS:
                return super().run_node(n)
            with FlopCounterMode(display=False) as counter:
                result = super().run_node(n)
            tensors = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            # views (x[:, None], transpose) move nothing; new tensors cost what they write
            inputs = {
                _storage(t)
                for t in pytree.tree_leaves([self.env.get(a) for a in n.all_input_nodes])
                if isinstance(t, torch.Tensor)
            }
            written = sum(t.numel() for t in tensors if _storage(t) not in inputs)
            weights[n] = float(counter.get_total_flops() + written)
            sizes[n] = float(sum(t.numel() * t.element_size() for t in tensors))
            return result

    with torch.no_grad(), untouched(traced.root):
        _Counting(module).run(*args)
    return weights, sizes


def _storage(tensor: torch.Tensor) -> int:
    return 0 if tensor.is_meta else tensor.untyped_storage().data_ptr()


def _parameters_used(model: nn.Module, node: fx.Node) -> int:
    if node.op == "call_module":
        return sum(p.numel() for p in model.get_submodule(str(node.target)).parameters())
    count = 0
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _attribute(model, str(arg.target))
            if isinstance(value, torch.Tensor):
                count += value.numel()
    return count


def _given_costs(
    nodes: list[fx.Node], estimates: dict[fx.Node, float], costs: Mapping[str, float]
) -> dict[fx.Node, float]:
    """Spread user costs over nodes; the most specific name covering a node wins."""
    covered: dict[fx.Node, str] = {}
    for node in nodes:
        candidates = [node.name] + ([str(node.target)] if node.op == "call_module" else [])
        candidates += [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        names = [c for c in candidates if c in costs]
        for candidate in list(candidates):
            while "." in candidate:  # enclosing modules of a leaf call
                candidate = candidate.rpartition(".")[0]
                if candidate in costs:
                    names.append(candidate)
        if names:
            covered[node] = names[0] if node.name in costs else max(names, key=len)
    unknown = sorted(set(costs) - set(covered.values()))
    if unknown:
        raise ValueError(
            f"costs name {unknown}, which match no traced operation or module; "
            f"use node names or module qualified names such as "
            f"{sorted({str(n.target) for n in nodes if n.op == 'call_module'})[:5]}"
        )
    weights = {n: 0.0 for n in nodes}
    for name in set(covered.values()):
        members = [n for n in nodes if covered.get(n) == name]
        total = sum(estimates[n] for n in members)
        for n in members:
            share = estimates[n] / total if total > 0 else 1.0 / len(members)
            weights[n] = float(costs[name]) * share
    return weights


def _units(
    nodes: list[fx.Node],
    weights: dict[fx.Node, float],
    num_stages: int,
    whole: Callable[[str], bool],
) -> list[Hashable]:
    """Unit of each node: the outermost module call around it that is kept ``whole`` or costs
    no more than a stage should (total / stages); cuts fall between units only."""
    module_cost: dict[str, float] = {}
    for node in nodes:
        for key in _stack(node):
            module_cost[key] = module_cost.get(key, 0.0) + weights[node]
    limit = sum(weights.values()) / num_stages
    units: list[Hashable] = []
    for node in nodes:
        stack = _stack(node)
        keys = [k for k, path in stack.items() if whole(path) or module_cost[k] <= limit]
        units.append(keys[0] if keys else node.name)
    return units


def _stack(node: fx.Node) -> dict[str, str]:
    """The modules a node runs in, outermost first: their stack keys and qualified names."""
    stack = node.meta.get("nn_module_stack") or {}
    return {key: path for key, (path, _) in stack.items() if path and path != NO_MODULE}


def _whole(model: nn.Module, is_leaf: Callable[[nn.Module, str], bool]) -> Callable[[str], bool]:
    """Whether the submodule at a path is a leaf module (kept whole)."""
    known = dict(model.named_modules())

    def whole(path: str) -> bool:
        module = known.get(path)
        return module is not None and is_leaf(module, path) and not _is_torch_leaf(module)

    return whole


def _is_torch_leaf(module: nn.Module) -> bool:
    """torch.nn's own modules (Linear, LayerNorm): leaves for fx, but one op each anyway."""
    return type(module).__module__.startswith("torch.nn")


def _shared_users(model: nn.Module, index: dict[fx.Node, int]) -> list[list[int]]:
    """The nodes that use each parameter or buffer used by several nodes."""
    users: dict[int, list[int]] = {}
    for node, i in index.items():
        tensors: list[torch.Tensor] = []
        if node.op == "call_module":
            sub = model.get_submodule(str(node.target))
            tensors += [*sub.parameters(), *sub.buffers()]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = _attribute(model, str(arg.target))
                if isinstance(value, torch.Tensor):
                    tensors.append(value)
        for tensor in tensors:
            users.setdefault(id(tensor), []).append(i)
    return [sorted(set(u)) for u in users.values() if len(set(u)) > 1]


def _attribute(model: nn.Module, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part)
    return value
