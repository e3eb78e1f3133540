"""Cut a model into a StageGraph: nn.Sequential by balance, any module by split points (torch.fx)."""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph

__all__ = ["balance_to_split_points", "even_balance", "split_model", "trace"]

logger = logging.getLogger(__name__)


def even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage that differ by at most one, larger stages first."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages; "
                         f"use between 1 and {num_layers} stages")
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def balance_to_split_points(model: nn.Sequential, balance: Sequence[int]) -> list[str]:
    """Names of the layers that start stages 1, 2, ... of an nn.Sequential."""
    names = [name for name, _ in model.named_children()]
    if any(b < 1 for b in balance) or sum(balance) != len(names):
        raise ValueError(
            f"balance {list(balance)} covers {sum(balance)} layers but the model has "
            f"{len(names)}; pass {len(balance)} positive counts that sum to {len(names)}, or "
            "omit balance to split evenly")
    starts = [sum(balance[:i]) for i in range(1, len(balance))]
    return [names[i] for i in starts]


class _Tracer(fx.Tracer):
    """Traces into the modules that contain a split point and keeps every other one whole.

    A module wholly inside one stage is never traced, so its own code may do anything (data
    dependent control flow included).
    """

    def __init__(self, split_points: Sequence[str], leaf: Callable[[nn.Module, str], bool]
                 | None = None) -> None:
        super().__init__()
        self.containers = {p.rsplit(".", i)[0] for p in split_points
                           for i in range(1, p.count(".") + 1)}
        self.leaf = leaf

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf is not None:
            return self.leaf(m, module_qualified_name)
        return module_qualified_name not in self.containers


def trace(model: nn.Module, split_points: Sequence[str] = (),
          concrete_args: dict[str, Any] | None = None,
          leaf: Callable[[nn.Module, str], bool] | None = None) -> fx.Graph:
    """Trace ``model`` with torch.fx; on failure, say where tracing stopped and what to do."""
    tracer = _Tracer(split_points, leaf)
    try:
        return tracer.trace(model, concrete_args)
    except Exception as error:
        raise TypeError(
            f"cannot trace {type(model).__name__} with torch.fx to split it: {error}{_where(error)}. "
            "Only the modules that contain a split point are traced, so move the untraceable "
            "code into a submodule that lies wholly inside one stage, choose split points "
            "around it, pass concrete_args for inputs that steer control flow, or use an "
            "nn.Sequential with balance") from error


def _where(error: BaseException) -> str:
    """' (at file:line in func: code)' for the last frame of user code in the traceback."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(torch_dir) and f.filename != __file__]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line})"


def split_model(model: nn.Module, split_points: Sequence[str],
                placement: Sequence[int] | None = None,
                concrete_args: dict[str, Any] | None = None) -> StageGraph:
    """Cut ``model`` before each split point (a submodule's qualified name), in forward order.

    Each stage is an ``fx.GraphModule`` holding the original submodules under their original
    qualified names, so ``stage.named_parameters()`` keys match ``model.state_dict()``. Works
    on models on the meta device: nothing is computed or copied.
    """
    _check_split_points(model, split_points)
    graph = trace(model, split_points, concrete_args)
    assignment = _assign_stages(graph, split_points)
    num_stages = len(split_points) + 1
    placement = list(range(num_stages)) if placement is None else list(placement)
    if len(placement) != num_stages:
        raise ValueError(f"placement {placement} has {len(placement)} entries for "
                         f"{num_stages} stages; give one rank per stage")
    return build_stage_graph(model, graph, assignment, placement)


def _check_split_points(model: nn.Module, split_points: Sequence[str]) -> None:
    names = {name for name, _ in model.named_modules() if name}
    for point in split_points:
        if point not in names:
            children = [name for name, _ in model.named_children()]
            raise ValueError(f"split point {point!r} is not a submodule of "
                             f"{type(model).__name__}; expected qualified names such as "
                             f"{children[:6]}")
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"split points {list(split_points)} repeat a name; give each once")


def _assign_stages(graph: fx.Graph, split_points: Sequence[str]) -> dict[fx.Node, int]:
    """Stage of every node: nodes before the first call into split point i belong to stage i."""
    assignment: dict[fx.Node, int] = {}
    stage = 0
    for node in graph.nodes:
        if node.op == "call_module":
            for later, point in enumerate(split_points[stage:], start=stage + 1):
                if node.target == point or str(node.target).startswith(point + "."):
                    if later != stage + 1:
                        raise ValueError(
                            f"split point {point!r} runs before {split_points[stage]!r} in "
                            "forward; list split points in the order forward calls them")
                    stage = later
                    break
        assignment[node] = stage
    if stage != len(split_points):
        raise ValueError(f"split point {split_points[stage]!r} is never called by forward "
                         "(or only inside a traced-through call); choose modules that forward "
                         "calls directly")
    for node in graph.nodes:  # parameters and buffers live with the stages that use them
        if node.op == "get_attr" and node.users:
            assignment[node] = min(assignment[user] for user in node.users)
        elif node.op == "output":
            assignment[node] = len(split_points)
    return assignment


def build_stage_graph(model: nn.Module, graph: fx.Graph, assignment: dict[fx.Node, int],
                      placement: Sequence[int]) -> StageGraph:
    """Turn a node-to-stage assignment of a traced model into a StageGraph.

    A value computed in stage i and used in a later stage j becomes an output of i and an
    input of j (an edge i -> j, however far apart). Parameters, buffers and model inputs are
    available to every stage that uses them; a parameter used by stages on different ranks is
    a tied weight.
    """
    model_inputs = tuple(_value_name(n) for n in graph.nodes if n.op == "placeholder")
    num_stages = len(placement)
    crossing: list[list[fx.Node]] = [[] for _ in range(num_stages)]  # outputs per stage
    consumed: list[list[fx.Node]] = [[] for _ in range(num_stages)]  # edge inputs per stage
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        users = sorted({assignment[u] for u in node.users} - {assignment[node]})
        if users and users[0] < assignment[node]:
            raise ValueError(f"node {node.name} of stage {assignment[node]} is used by an "
                             f"earlier stage {users[0]}; split points must follow forward order")
        if users:
            crossing[assignment[node]].append(node)
        for user_stage in users:
            consumed[user_stage].append(node)
    stages = []
    for index in range(num_stages):
        module, inputs = _stage_module(model, graph, assignment, index, consumed[index],
                                       crossing[index])
        outputs = tuple(n.name for n in crossing[index])
        if index == num_stages - 1:
            outputs += (MODEL_OUTPUT,)
        stages.append(Stage(index, placement[index], inputs, outputs, module))
    return StageGraph(tuple(stages), model_inputs)


def _stage_module(model: nn.Module, graph: fx.Graph, assignment: dict[fx.Node, int],
                  index: int, consumed: list[fx.Node],
                  crossing: list[fx.Node]) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """The GraphModule of one stage and the names of its inputs, in call order."""
    stage_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    used = {arg for n in graph.nodes if assignment[n] == index for arg in n.all_input_nodes}
    inputs = [n for n in graph.nodes if n.op == "placeholder" and n in used]
    inputs += [n for n in consumed if n not in inputs]
    for node in inputs:
        env[node] = stage_graph.placeholder(node.name)
    for node in graph.nodes:
        if node.op == "get_attr" and any(assignment[u] == index for u in node.users):
            env[node] = stage_graph.node_copy(node, env.__getitem__)
        elif assignment[node] == index and node.op not in ("placeholder", "get_attr", "output"):
            env[node] = stage_graph.node_copy(node, env.__getitem__)
    results: list[Any] = [env[n] for n in crossing]
    output = next(n for n in graph.nodes if n.op == "output")
    if assignment[output] == index:
        results.append(fx.node.map_arg(output.args[0], env.__getitem__))
    stage_graph.output(tuple(results))
    module = fx.GraphModule(model, stage_graph, class_name=f"Stage{index}")
    return module, tuple(_value_name(n) for n in inputs)


def _value_name(node: fx.Node) -> str:
    """A model input is named after its forward parameter; any other value after its node."""
    return str(node.target) if node.op == "placeholder" else node.name


def bind_inputs(model: nn.Module, inputs: Any) -> dict[str, Any]:
    """Map a batch to the model's forward parameters: a tensor (the first argument), a tuple or
    list (positional arguments) or a dict (keyword arguments). Defaults fill the rest."""
    signature = inspect.signature(model.forward)
    if isinstance(inputs, dict):
        bound = signature.bind(**inputs)
    elif isinstance(inputs, tuple | list):
        bound = signature.bind(*inputs)
    else:
        bound = signature.bind(inputs)
    bound.apply_defaults()
    return dict(bound.arguments)
