"""From a node-to-stage assignment of a traced model to a StageGraph of fx.GraphModules.

Internal to conveyor.split: every split method (points, modules, auto) assigns each node of
the traced graph to a stage and calls ``build_stage_graph``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph
from conveyor.split.frontend import Traced
from conveyor.torch_compat import pytree

__all__ = ["EXPORTED", "build_stage_graph"]


def place_attributes(graph: fx.Graph, assignment: dict[fx.Node, int], num_stages: int) -> None:
    """Parameters and buffers live with the stages that use them; the output ends the model."""
    for node in graph.nodes:
        if node.op == "get_attr" and node.users:
            assignment[node] = min(assignment[user] for user in node.users)
        elif node.op == "output":
            assignment[node] = num_stages - 1


def sink_duplicates(graph: fx.Graph, stage: dict[fx.Node, int]) -> None:
    """Move functions (``x[:, None]``, ``x.view(...)``) that use no parameter into the stage
    that uses them when that stage receives all their inputs anyway:
    sending the result as well would only duplicate bytes."""
    changed = True
    while changed:
        changed = False
        for node in graph.nodes:
            if node.op not in ("call_function", "call_method") or not node.users:
                continue
            if any(p.op == "get_attr" for p in node.all_input_nodes):
                continue
            target = min(stage[u] for u in node.users)
            if target <= stage[node]:
                continue
            received = all(
                p.op in ("placeholder", "get_attr")
                or stage[p] == target
                or any(u is not node and stage.get(u) == target for u in p.users)
                for p in node.all_input_nodes
            )
            if received:
                stage[node] = target
                changed = True


def build_stage_graph(
    traced: Traced,
    assignment: dict[fx.Node, int],
    placement: Sequence[int],
    relay_skips: bool = False,
) -> StageGraph:
    """Turn a node-to-stage assignment of a traced model into a StageGraph.

    A value computed in stage i and used in a later stage j becomes an output of i and an
    input of j (an edge i -> j, however far apart). With ``relay_skips`` it is instead passed
    through every stage between i and j, as a chain pipeline must (for comparisons).
    Parameters, buffers and model inputs are available to every stage that uses them; a
    parameter used by stages on different ranks is a tied weight. The last stage returns the
    model's output in the model's own structure (a ModelOutput stays one).
    """
    graph = traced.graph
    for node in graph.nodes:  # an attribute read for nothing (export keeps some): stage 0
        if node.op == "get_attr" and not node.users:
            assignment.setdefault(node, 0)
    model_inputs = tuple(_value_name(n) for n in graph.nodes if n.op == "placeholder")
    num_stages = len(placement)
    crossing: list[list[fx.Node]] = [[] for _ in range(num_stages)]  # outputs per stage
    consumed: list[list[fx.Node]] = [[] for _ in range(num_stages)]  # edge inputs per stage
    origin: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        users = sorted({assignment[u] for u in node.users} - {assignment[node]})
        if users and users[0] < assignment[node]:
            raise ValueError(
                f"node {node.name} of stage {assignment[node]} is used by an "
                f"earlier stage {users[0]}; split points must follow forward order"
            )
        if not users:
            continue
        origin[node] = assignment[node]
        crossing[assignment[node]].append(node)
        if relay_skips:
            users = list(range(assignment[node] + 1, users[-1] + 1))
            for between in users[:-1]:
                crossing[between].append(node)
        for user_stage in users:
            consumed[user_stage].append(node)

    def name_at(node: fx.Node, stage: int) -> str:
        """Name of ``node``'s value as ``stage`` outputs it (relayed copies get their own)."""
        return node.name if stage == origin[node] else f"{node.name}.via{stage}"

    stages = []
    for index in range(num_stages):
        module, input_nodes = _stage_module(
            traced, assignment, index, consumed[index], crossing[index]
        )
        inputs = tuple(
            _value_name(n)
            if n.op == "placeholder"
            else name_at(n, max(origin[n], index - 1) if relay_skips else origin[n])
            for n in input_nodes
        )
        outputs = tuple(name_at(n, index) for n in crossing[index])
        if index == num_stages - 1:
            outputs += (MODEL_OUTPUT,)
        stages.append(Stage(index, placement[index], inputs, outputs, module))
    _keep_unused(traced.root, [s.module for s in stages if s.module is not None])
    return StageGraph(tuple(stages), model_inputs, traced.binder, traced.training)


def _stage_module(
    traced: Traced,
    assignment: dict[fx.Node, int],
    index: int,
    consumed: list[fx.Node],
    crossing: list[fx.Node],
) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The GraphModule of one stage and the nodes its inputs come from, in call order."""
    graph = traced.graph
    stage_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    used = {arg for n in graph.nodes if assignment[n] == index for arg in n.all_input_nodes}
    inputs = [n for n in graph.nodes if n.op == "placeholder" and n in used]
    inputs += [n for n in consumed if n not in inputs]
    for node in inputs:
        env[node] = stage_graph.placeholder(node.name)
    for node in graph.nodes:
        if node.op == "get_attr":
            wanted = any(assignment[u] == index for u in node.users)
        else:
            wanted = assignment[node] == index and node.op not in ("placeholder", "output")
        if wanted:
            env[node] = stage_graph.node_copy(node, env.__getitem__)
    results: list[Any] = [env[n] for n in crossing]
    output = next(n for n in graph.nodes if n.op == "output")
    if assignment[output] == index:
        value = fx.node.map_arg(output.args[0], env.__getitem__)
        if traced.output_spec is not None:  # export returns the output's leaves: rebuild it
            spec = stage_graph.get_attr(_OUTPUT_SPEC)
            value = stage_graph.call_function(_structured, (spec, *value))
        results.append(value)
    stage_graph.output(tuple(results))
    root = traced.root
    if traced.output_spec is not None:
        setattr(root, _OUTPUT_SPEC, traced.output_spec)
    module = fx.GraphModule(root, stage_graph, class_name=f"Stage{index}")
    module.meta[EXPORTED] = traced.method == "export"
    _keep_buffers_unsaved(module, root)
    return module, inputs


def _keep_unused(root: nn.Module, stages: list[nn.Module]) -> None:
    """Give the first stage, under their own names, the parameters and buffers that no stage
    reads (an auxiliary head, a buffer the forward ignores): a stage holds only what its code
    reads, and the pipeline's state_dict, checkpoints and saved weights must hold the whole
    model's, as plain training keeps them."""
    held = {id(t) for stage in stages for t in (*stage.parameters(), *stage.buffers())}
    saved = set(root.state_dict(keep_vars=True))
    for name, tensor in (
        *root.named_parameters(remove_duplicate=False),
        *root.named_buffers(remove_duplicate=False),
    ):
        if id(tensor) in held:
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = stages[0]
        for part in owner_name.split(".") if owner_name else []:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor, persistent=name in saved)


def _keep_buffers_unsaved(module: fx.GraphModule, root: nn.Module) -> None:
    """Buffers the model does not save (a rotary table, position ids) stay unsaved in the
    stage: fx.GraphModule registers every buffer it copies as saved, so the stage's
    state_dict would hold keys the model's does not."""
    saved = set(root.state_dict(keep_vars=True))
    for name, buffer in list(module.named_buffers()):
        if name not in saved:
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)


EXPORTED = "conveyor_exported"
"""Key of a stage module's ``meta``: True if it was cut from a torch.export graph."""

_OUTPUT_SPEC = "_conveyor_output_spec"
"""Attribute of an exported stage that holds the model output's pytree structure."""


def _structured(spec: pytree.TreeSpec, *leaves: Any) -> Any:
    """The model's output from its flattened leaves (an exported graph returns those)."""
    return pytree.tree_unflatten(list(leaves), spec)


def _value_name(node: fx.Node) -> str:
    """A model input is named after its forward parameter; any other value after its node."""
    return str(node.target) if node.op == "placeholder" else node.name
