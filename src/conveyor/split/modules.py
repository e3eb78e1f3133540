"""Stage modules: cut a model into a DAG of stages made of named submodules (by hand).

    graph = split_by_modules(model, [["text"], ["image"], ["head", "norm"]])
Stages that do not feed each other run concurrently (a graph pipeline).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx, nn

from conveyor.graph import StageGraph
from conveyor.split.capture import COMPUTE_OPS, unknown_module
from conveyor.split.frontend import Tracer, capture, module_path
from conveyor.split.stages import build_stage_graph, place_attributes, sink_duplicates

__all__ = ["StageAnnotation", "split_by_modules"]

StageAnnotation = Mapping[str, int] | Sequence[str | Sequence[str]]
"""Which submodules form which stage: ``{"text": 0, "image": 1, "head": 2}``, or one entry
per stage listing its submodules (``[["text"], ["image"], ["head", "norm"]]``; a string
entry may list several names separated by commas)."""


def split_by_modules(
    model: nn.Module,
    stages: StageAnnotation,
    placement: Sequence[int] | None = None,
    concrete_args: dict[str, Any] | None = None,
    relay_skips: bool = False,
    *,
    example_inputs: Any = None,
    tracer: Tracer = "auto",
) -> StageGraph:
    """Cut ``model`` into stages made of the named submodules (see ``StageAnnotation``).

    Stages are numbered in the order data flows; two stages that do not feed each other run
    concurrently. The code between annotated modules (adds, concatenations, reshapes) joins
    the stage its inputs come from when they all come from one stage, and otherwise the
    first stage that uses its result. A name's submodules go with it unless they are named
    themselves; then the code of the module around them is glue too. Only modules that
    contain an annotated one are traced (by torch.fx; models it cannot trace are split
    through torch.export on ``example_inputs``, see conveyor.split.frontend).

    Raises:
        ValueError: an unknown name, a stage with no computation, or stages numbered against
            the dataflow (the message names the modules on both sides).
    """
    table = _stage_table(model, stages)
    num_stages = 1 + max(table.values())
    traced = capture(
        model,
        cut_at=list(table),
        concrete_args=concrete_args,
        example_inputs=example_inputs,
        tracer=tracer,
        hint=f"Annotate modules that contain the untraceable code whole: only the "
        f"modules above the annotated ones {sorted(table)[:4]} are traced",
    )
    assignment = _annotated_assignment(traced.graph, table, num_stages)
    placement = list(range(num_stages)) if placement is None else list(placement)
    if len(placement) != num_stages:
        raise ValueError(
            f"placement {placement} has {len(placement)} entries for "
            f"{num_stages} stages; give one rank per stage"
        )
    return build_stage_graph(traced, assignment, placement, relay_skips=relay_skips)


def _stage_table(model: nn.Module, stages: StageAnnotation) -> dict[str, int]:
    """Annotation -> {qualified name: stage}, checked against the model."""
    if isinstance(stages, Mapping):
        table = {str(name): int(stage) for name, stage in stages.items()}
    else:
        table = {}
        for index, entry in enumerate(stages):
            names = entry.split(",") if isinstance(entry, str) else list(entry)
            for name in (n.strip() for n in names):
                if name in table:
                    raise ValueError(
                        f"module {name!r} is annotated for stages {table[name]} "
                        f"and {index}; name each module once"
                    )
                table[name] = index
    known = {name for name, _ in model.named_modules() if name}
    for name in table:
        if name not in known:
            raise unknown_module(model, name, "annotated module")
    used = sorted(set(table.values()))
    if not table or used != list(range(len(used))):
        raise ValueError(
            f"annotations use stages {used}; expected every stage 0..{len(used) - 1}"
            " to have at least one module"
        )
    return table


def _annotated_assignment(
    graph: fx.Graph, table: dict[str, int], num_stages: int
) -> dict[fx.Node, int]:
    """Stage of every node from the annotations; see ``split_by_modules`` for unnamed code."""
    stage: dict[fx.Node, int] = {}
    origins: dict[fx.Node, set[int]] = {}
    containers = {name.rsplit(".", i)[0] for name in table for i in range(1, name.count(".") + 1)}
    for node in graph.nodes:  # forward: annotated nodes, and code fed by a single stage
        if node.op not in COMPUTE_OPS:
            origins[node] = set()
            continue
        annotated = _annotation(node, table, containers)
        if annotated is not None:
            stage[node] = annotated
            origins[node] = {annotated}
            continue
        origins[node] = set().union(*(origins[i] for i in node.all_input_nodes))
        if len(origins[node]) == 1:
            stage[node] = next(iter(origins[node]))
    for node in reversed(graph.nodes):  # backward: the rest goes to its first user's stage
        if node.op == "output":
            stage[node] = num_stages - 1
        elif node.op in COMPUTE_OPS and node not in stage:
            users = [stage[u] for u in node.users]
            stage[node] = min(users) if users else max(origins[node], default=0)
    sink_duplicates(graph, stage)
    for node in graph.nodes:
        if node.op == "placeholder":
            stage[node] = 0
    place_attributes(graph, stage, num_stages)
    _check_dataflow(graph, stage, num_stages)
    return stage


def _annotation(node: fx.Node, table: dict[str, int], containers: set[str]) -> int | None:
    """Stage of the innermost annotated module that runs ``node``, if any.

    The own code of a module that contains an annotated module (a container) is glue between
    annotated parts, even if the container is annotated itself; its other submodules go with
    it.
    """
    path = module_path(node)
    if path in containers:
        return None
    while path:
        if path in table:
            return table[path]
        path = path.rpartition(".")[0]
    return None


def _check_dataflow(graph: fx.Graph, stage: dict[fx.Node, int], num_stages: int) -> None:
    modules = [n for n in graph.nodes if n.op == "call_module"]
    for node in modules + list(graph.nodes):  # name two modules if a module is to blame
        for producer in _feeding(node, only_modules=node.op == "call_module"):
            if stage[producer] <= stage[node]:
                continue
            raise ValueError(
                f"stage annotations go against the dataflow: {_describe(node)} in stage "
                f"{stage[node]} uses {_describe(producer)} from stage {stage[producer]}; number "
                "stages in the order data flows through them, or annotate both in one stage"
            )
    empty = sorted(set(range(num_stages)) - {stage[n] for n in graph.nodes if n.op in COMPUTE_OPS})
    if empty:
        raise ValueError(
            f"stages {empty} run no computation: their modules are never called "
            "by forward; annotate modules that forward calls"
        )


def _feeding(node: fx.Node, only_modules: bool) -> list[fx.Node]:
    """Computing nodes whose values ``node`` uses; with ``only_modules``, the module calls
    found by looking through the code in between."""
    found, todo, seen = [], list(node.all_input_nodes), set()
    while todo:
        producer = todo.pop()
        if producer in seen or producer.op in ("placeholder", "get_attr"):
            continue
        seen.add(producer)
        if not only_modules or producer.op == "call_module":
            found.append(producer)
        else:
            todo += producer.all_input_nodes
    return found


def _describe(node: fx.Node) -> str:
    """'module 'text.blocks.0' (Block)', or the operation and its node name."""
    if node.op == "output":
        return "the model output"
    if node.op == "call_module":
        return f"module {node.target!r}"
    stack = list(node.meta.get("nn_module_stack", {}).values())
    where = f" in module {stack[-1][0]!r}" if stack else ""
    target = getattr(node.target, "__name__", str(node.target))
    return f"{target} ({node.name}){where}"
