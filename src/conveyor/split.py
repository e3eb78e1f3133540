"""Cut a model into a StageGraph: by split points, by annotated submodules, or automatically.

    graph = split_model(model, ["layers.4"])                          # a chain, forward order
    graph = split_by_modules(model, [["text"], ["image"], ["head"]])  # a DAG, by hand
    graph = auto_split(model, num_stages=3, example_inputs=batch)     # conveyor.autosplit
Every stage is an ``fx.GraphModule`` that keeps the original submodules under their original
qualified names. A value used by a later stage becomes an edge to it, however far: skip
connections go straight from producer to consumer (``relay_skips=True`` instead passes them
through every stage in between, as chain-only pipelines must).
"""

from __future__ import annotations

import inspect
import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from conveyor import skip
from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph

__all__ = [
    "StageAnnotation", "balance_to_split_points", "bind_inputs", "build_stage_graph",
    "even_balance", "run_stages", "split_by_modules", "split_model", "trace",
]

logger = logging.getLogger(__name__)

StageAnnotation = Mapping[str, int] | Sequence[str | Sequence[str]]
"""Which submodules form which stage: ``{"text": 0, "image": 1, "head": 2}``, or one entry
per stage listing its submodules (``[["text"], ["image"], ["head", "norm"]]``; a string
entry may list several names separated by commas)."""

_COMPUTE_OPS = ("call_module", "call_function", "call_method")
_HOW_TO_ANNOTATE = (
    "To split by hand instead, name the submodules of each stage (split_by_modules, or "
    "Pipeline(stage_modules=('text', 'image', 'head,norm'))): only modules that contain an "
    "annotated one are traced, so untraceable code inside a stage's modules is fine")


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


# -- tracing ------------------------------------------------------------------------------


class _SkipError(ValueError):
    """Stash/pop layers that do not match; raised as is, never wrapped as a tracing failure."""


class _Tracer(fx.Tracer):
    """Traces into the modules that contain a split point and keeps every other one whole.

    A module wholly inside one stage is never traced, so its own code may do anything (data
    dependent control flow included). Stash/pop layers (conveyor.skip) are called with their
    popped values and return their stashed ones, so each skip becomes a graph edge.
    """

    def __init__(self, split_points: Sequence[str], leaf: Callable[[nn.Module, str], bool]
                 | None = None) -> None:
        super().__init__()
        self.containers = {p.rsplit(".", i)[0] for p in split_points
                           for i in range(1, p.count(".") + 1)}
        self.leaf = leaf
        self.skips: dict[str, Any] = {}
        self.skip_owner: dict[str, str] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if self.leaf is not None:
            return self.leaf(m, module_qualified_name)
        return module_qualified_name not in self.containers

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        names = skip.skip_names(m)
        if names is None:
            return super().call_module(m, forward, args, kwargs)
        label = f"{self.path_of_module(m)} ({type(m).__name__})"
        popped = {}
        for name in names.pops:
            if name not in self.skips:
                raise _SkipError(f"layer {label} pops {name!r}, which no layer before it "
                                 "stashes (or an earlier layer already popped it)")
            popped[name] = self.skips.pop(name)
            del self.skip_owner[name]
        result = super().call_module(m, forward, args, {**kwargs, skip.SKIPS_KWARG: popped})
        stashed = result[1] if names.stashes else None
        for name in names.stashes:
            if name in self.skips:
                raise _SkipError(f"layers {self.skip_owner[name]} and {label} both stash "
                                 f"{name!r} before it is popped; rename one with "
                                 "conveyor.skip.rename")
            self.skips[name] = stashed[name]  # type: ignore[index]  # a dict or a Proxy
            self.skip_owner[name] = label
        return result[0]


def trace(model: nn.Module, split_points: Sequence[str] = (),
          concrete_args: dict[str, Any] | None = None,
          leaf: Callable[[nn.Module, str], bool] | None = None, hint: str = "") -> fx.Graph:
    """Trace ``model`` with torch.fx; on failure, say where tracing stopped and what to do.

    Raises:
        TypeError: tracing failed; the message names the operation and the module being
            traced, the line of user code, and how to avoid tracing it.
        ValueError: stash/pop layers do not match (conveyor.skip).
    """
    tracer = _Tracer(split_points, leaf)
    try:
        graph = tracer.trace(model, concrete_args)
    except _SkipError:
        raise
    except Exception as error:
        stack = list(tracer.module_stack.values())
        inside = (f" inside module {stack[-1][0]!r} ({stack[-1][1].__name__})"
                  if stack and stack[-1][0] else "")
        advice = hint or (
            "Only the modules that contain a split point are traced, so move the untraceable "
            "code into a submodule that lies wholly inside one stage, choose split points "
            "around it, pass concrete_args for inputs that steer control flow, or use an "
            "nn.Sequential with balance")
        if inside:  # name the module in the advice, e.g. leaf_modules=['encoder.3']
            advice = advice.replace("<name>", stack[-1][0])
        raise TypeError(
            f"cannot trace {type(model).__name__} with torch.fx to split it: tracing stopped "
            f"at {type(error).__name__}: {error}{inside}{_where(error)}. {advice}") from error
    taken = {str(n.target) for n in graph.nodes if n.op == "placeholder"}
    for node in graph.nodes:  # fx renames specialized arguments ('scale' -> 'scale_1')
        base = str(node.target).rpartition("_")[0]
        if node.op == "placeholder" and concrete_args and base in concrete_args \
                and base not in taken:
            node.target = base
    if tracer.skips:
        owners = ", ".join(f"{name!r} (stashed by {tracer.skip_owner[name]})"
                           for name in tracer.skips)
        raise _SkipError(f"skips {owners} are never popped; pop each stashed name in a later "
                         "layer, or stop stashing it")
    return graph


def _where(error: BaseException) -> str:
    """' (at file:line in func: code)' for the last frame of user code in the traceback."""
    torch_dir = str(Path(torch.__file__).parent)
    ours = (str(Path(__file__)), str(Path(skip.__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(torch_dir) and f.filename not in ours]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno} in {frame.name}: {frame.line})"


# -- split points: a chain in forward order -------------------------------------------------


def split_model(model: nn.Module, split_points: Sequence[str],
                placement: Sequence[int] | None = None,
                concrete_args: dict[str, Any] | None = None,
                relay_skips: bool = False) -> StageGraph:
    """Cut ``model`` before each split point (a submodule's qualified name), in forward order.

    Each stage is an ``fx.GraphModule`` holding the original submodules under their original
    qualified names, so ``stage.named_parameters()`` keys match ``model.state_dict()``. Works
    on models on the meta device: nothing is computed or copied. Stash/pop layers of an
    nn.Sequential are checked with ``conveyor.skip.verify_skips`` and become direct edges.
    """
    _check_split_points(model, split_points)
    if isinstance(model, nn.Sequential) and skip.has_skips(model):
        skip.verify_skips(model)
    graph = trace(model, split_points, concrete_args)
    assignment = _assign_stages(graph, split_points)
    num_stages = len(split_points) + 1
    placement = list(range(num_stages)) if placement is None else list(placement)
    if len(placement) != num_stages:
        raise ValueError(f"placement {placement} has {len(placement)} entries for "
                         f"{num_stages} stages; give one rank per stage")
    return build_stage_graph(model, graph, assignment, placement, relay_skips=relay_skips)


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
    _place_attributes(graph, assignment, len(split_points) + 1)
    return assignment


def _place_attributes(graph: fx.Graph, assignment: dict[fx.Node, int], num_stages: int) -> None:
    """Parameters and buffers live with the stages that use them; the output ends the model."""
    for node in graph.nodes:
        if node.op == "get_attr" and node.users:
            assignment[node] = min(assignment[user] for user in node.users)
        elif node.op == "output":
            assignment[node] = num_stages - 1


# -- annotations: named submodules per stage ----------------------------------------------


def split_by_modules(model: nn.Module, stages: StageAnnotation,
                     placement: Sequence[int] | None = None,
                     concrete_args: dict[str, Any] | None = None,
                     relay_skips: bool = False) -> StageGraph:
    """Cut ``model`` into stages made of the named submodules (see ``StageAnnotation``).

    Stages are numbered in the order data flows; two stages that do not feed each other run
    concurrently. The code between annotated modules (adds, concatenations, reshapes) joins
    the stage its inputs come from when they all come from one stage, and otherwise the
    first stage that uses its result. A name's submodules go with it unless they are named
    themselves; then the code of the module around them is glue too. Only modules that
    contain an annotated one are traced.

    Raises:
        ValueError: an unknown name, a stage with no computation, or stages numbered against
            the dataflow (the message names the modules on both sides).
    """
    table = _stage_table(model, stages)
    num_stages = 1 + max(table.values())
    graph = trace(model, list(table), concrete_args,
                  hint=f"Annotate modules that contain the untraceable code whole: only the "
                       f"modules above the annotated ones {sorted(table)[:4]} are traced")
    assignment = _annotated_assignment(graph, table, num_stages)
    placement = list(range(num_stages)) if placement is None else list(placement)
    if len(placement) != num_stages:
        raise ValueError(f"placement {placement} has {len(placement)} entries for "
                         f"{num_stages} stages; give one rank per stage")
    return build_stage_graph(model, graph, assignment, placement, relay_skips=relay_skips)


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
                    raise ValueError(f"module {name!r} is annotated for stages {table[name]} "
                                     f"and {index}; name each module once")
                table[name] = index
    known = {name for name, _ in model.named_modules() if name}
    children = [name for name, _ in model.named_children()]
    for name in table:
        if name not in known:
            raise ValueError(f"annotated module {name!r} is not a submodule of "
                             f"{type(model).__name__}; expected qualified names such as "
                             f"{children[:6]}")
    used = sorted(set(table.values()))
    if not table or used != list(range(len(used))):
        raise ValueError(f"annotations use stages {used}; expected every stage 0..{len(used) - 1}"
                         " to have at least one module")
    return table


def _annotated_assignment(graph: fx.Graph, table: dict[str, int],
                          num_stages: int) -> dict[fx.Node, int]:
    """Stage of every node from the annotations; see ``split_by_modules`` for unnamed code."""
    stage: dict[fx.Node, int] = {}
    origins: dict[fx.Node, set[int]] = {}
    for node in graph.nodes:  # forward: annotated nodes, and code fed by a single stage
        if node.op not in _COMPUTE_OPS:
            origins[node] = set()
            continue
        annotated = _annotation(node, table)
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
        elif node.op in _COMPUTE_OPS and node not in stage:
            users = [stage[u] for u in node.users]
            stage[node] = min(users) if users else max(origins[node], default=0)
    _sink_duplicates(graph, stage)
    for node in graph.nodes:
        if node.op == "placeholder":
            stage[node] = 0
    _place_attributes(graph, stage, num_stages)
    _check_dataflow(graph, stage, num_stages)
    return stage


def _sink_duplicates(graph: fx.Graph, stage: dict[fx.Node, int]) -> None:
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
                p.op in ("placeholder", "get_attr") or stage[p] == target
                or any(u is not node and stage.get(u) == target for u in p.users)
                for p in node.all_input_nodes)
            if received:
                stage[node] = target
                changed = True


def _annotation(node: fx.Node, table: dict[str, int]) -> int | None:
    """Stage of the innermost annotated module around a module call, if any.

    Only calls of whole modules carry annotations: the traced modules are the ones that
    contain an annotated module, and their own code is glue between annotated parts.
    """
    if node.op != "call_module":
        return None
    path = str(node.target)
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
                "stages in the order data flows through them, or annotate both in one stage")
    empty = sorted(set(range(num_stages)) - {stage[n] for n in graph.nodes
                                              if n.op in _COMPUTE_OPS})
    if empty:
        raise ValueError(f"stages {empty} run no computation: their modules are never called "
                         "by forward; annotate modules that forward calls")


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


# -- from an assignment to a StageGraph ---------------------------------------------------


def build_stage_graph(model: nn.Module, graph: fx.Graph, assignment: dict[fx.Node, int],
                      placement: Sequence[int], relay_skips: bool = False) -> StageGraph:
    """Turn a node-to-stage assignment of a traced model into a StageGraph.

    A value computed in stage i and used in a later stage j becomes an output of i and an
    input of j (an edge i -> j, however far apart). With ``relay_skips`` it is instead passed
    through every stage between i and j, as a chain pipeline must (for comparisons).
    Parameters, buffers and model inputs are available to every stage that uses them; a
    parameter used by stages on different ranks is a tied weight.
    """
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
            raise ValueError(f"node {node.name} of stage {assignment[node]} is used by an "
                             f"earlier stage {users[0]}; split points must follow forward order")
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
        module, input_nodes = _stage_module(model, graph, assignment, index, consumed[index],
                                            crossing[index])
        inputs = tuple(_value_name(n) if n.op == "placeholder" else
                       name_at(n, max(origin[n], index - 1) if relay_skips else origin[n])
                       for n in input_nodes)
        outputs = tuple(name_at(n, index) for n in crossing[index])
        if index == num_stages - 1:
            outputs += (MODEL_OUTPUT,)
        stages.append(Stage(index, placement[index], inputs, outputs, module))
    return StageGraph(tuple(stages), model_inputs)


def _stage_module(model: nn.Module, graph: fx.Graph, assignment: dict[fx.Node, int],
                  index: int, consumed: list[fx.Node],
                  crossing: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The GraphModule of one stage and the nodes its inputs come from, in call order."""
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
        results.append(fx.node.map_arg(output.args[0], env.__getitem__))
    stage_graph.output(tuple(results))
    module = fx.GraphModule(model, stage_graph, class_name=f"Stage{index}")
    return module, inputs


def _value_name(node: fx.Node) -> str:
    """A model input is named after its forward parameter; any other value after its node."""
    return str(node.target) if node.op == "placeholder" else node.name


# -- running a split ----------------------------------------------------------------------


def run_stages(graph: StageGraph, inputs: Mapping[str, Any]) -> Any:
    """The model output, computed by running every stage in order in this process.

    ``inputs`` maps each of ``graph.model_inputs`` to its value (``bind_inputs`` makes it).
    Handy to check a split before starting processes: the result equals ``model(...)``.
    """
    missing = [name for name in graph.model_inputs if name not in inputs]
    if missing:
        raise ValueError(f"inputs lack {missing}; the stage graph takes "
                         f"{list(graph.model_inputs)}")
    values = dict(inputs)
    for stage in graph.stages:
        if stage.module is None:
            raise ValueError(f"stage {stage.index} has no module; run_stages needs a split "
                             "model, not a topology")
        out = stage.module(*[values[name] for name in stage.inputs])
        if not isinstance(out, tuple):
            out = (out,)
        values.update(zip(stage.outputs, out, strict=True))
    return values[MODEL_OUTPUT]


def bind_inputs(model: nn.Module | StageGraph, inputs: Any) -> dict[str, Any]:
    """Map a batch to the model's forward parameters: a tensor (the first argument), a tuple or
    list (positional arguments) or a dict (keyword arguments). Defaults fill the rest.

    For a StageGraph, the names are its ``model_inputs`` and every one must be given.
    """
    if isinstance(model, StageGraph):
        names = model.model_inputs
        if isinstance(inputs, dict):
            given = dict(inputs)
        elif isinstance(inputs, tuple | list):
            given = dict(zip(names, inputs, strict=False))
        else:
            given = {names[0]: inputs}
        missing = [n for n in names if n not in given]
        extra = sorted(set(given) - set(names))
        if missing or extra or (isinstance(inputs, tuple | list) and len(inputs) > len(names)):
            raise ValueError(f"the stage graph takes model inputs {list(names)}; got "
                             f"{list(given) if not extra else sorted(given)}; pass every one "
                             "(a dict by name, or a tuple in that order)")
        return given
    signature = inspect.signature(model.forward)
    if isinstance(inputs, dict):
        bound = signature.bind(**inputs)
    elif isinstance(inputs, tuple | list):
        bound = signature.bind(*inputs)
    else:
        bound = signature.bind(inputs)
    bound.apply_defaults()
    return dict(bound.arguments)
