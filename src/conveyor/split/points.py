"""Split points: cut a model into a chain before named submodules, in forward order.

graph = split_model(model, ["layers.4"])      # stage 1 starts at layers.4
split_model(seq, balance_to_split_points(seq, [3, 5]))   # an nn.Sequential by layer counts
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx, nn

from conveyor.graph import StageGraph
from conveyor.split.capture import COMPUTE_OPS, unknown_module
from conveyor.split.frontend import Tracer, capture, module_path, within
from conveyor.split.skip import has_skips, verify_skips
from conveyor.split.stages import build_stage_graph, place_attributes, sink_duplicates

__all__ = ["balance_to_split_points", "even_balance", "split_model"]


def even_balance(num_layers: int, num_stages: int) -> list[int]:
    """Layer counts per stage that differ by at most one, larger stages first."""
    if num_layers < 1:
        raise ValueError(
            f"the model has no layers to split into {num_stages} stages (an empty "
            "nn.Sequential); pass a model with at least one layer per stage"
        )
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages: every stage needs "
            f"at least one layer; use at most {num_layers} stages (fewer ranks, or a schedule "
            "with one stage per rank such as 1f1b) or a model with more layers"
        )
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if i < extra else 0) for i in range(num_stages)]


def balance_to_split_points(model: nn.Sequential, balance: Sequence[int]) -> list[str]:
    """Names of the layers that start stages 1, 2, ... of an nn.Sequential."""
    names = [name for name, _ in model.named_children()]
    if len(names) != len(model) and len(balance) > 1:
        raise ValueError(_repeated_layers(model))
    if len(balance) == 1 and balance[0] == len(model):
        return []
    if any(b < 1 for b in balance) or sum(balance) != len(names):
        raise ValueError(
            f"balance {list(balance)} covers {sum(balance)} layers but the model has "
            f"{len(names)}; pass {len(balance)} positive counts that sum to {len(names)}, or "
            "omit balance to split evenly"
        )
    starts = [sum(balance[:i]) for i in range(1, len(balance))]
    return [names[i] for i in starts]


def _repeated_layers(model: nn.Sequential) -> str:
    """The message for an nn.Sequential that holds one module object at several positions."""
    positions: dict[int, list[int]] = {}
    for i, layer in enumerate(model):
        positions.setdefault(id(layer), []).append(i)
    repeats = [p for p in positions.values() if len(p) > 1]
    first = repeats[0]
    return (
        f"the nn.Sequential holds the same module object at positions "
        f"{', '.join(str(p) for p in repeats)} (one layer applied several times), so its "
        "layers cannot be told apart to split it; build each position from its own module "
        "(copy.deepcopy(layer)), and to keep their weights equal across stages pass "
        f"tie_weights=('{first[0]}.weight,{first[1]}.weight', ...)"
    )


def split_model(
    model: nn.Module,
    split_points: Sequence[str],
    placement: Sequence[int] | None = None,
    concrete_args: dict[str, Any] | None = None,
    relay_skips: bool = False,
    *,
    example_inputs: Any = None,
    tracer: Tracer = "auto",
) -> StageGraph:
    """Cut ``model`` before each split point (a submodule's qualified name), in forward order.

    Each stage is an ``fx.GraphModule`` holding the model's own parameters under their original
    qualified names, so ``stage.named_parameters()`` keys match ``model.state_dict()``. Works
    on models on the meta device: nothing is computed or copied. Stash/pop layers of an
    nn.Sequential are checked with ``conveyor.verify_skips`` and become direct edges.
    Models torch.fx cannot trace are split through torch.export on ``example_inputs``
    (``tracer``: see conveyor.split.frontend).
    """
    _check_split_points(model, split_points)
    if isinstance(model, nn.Sequential) and has_skips(model):
        verify_skips(model)
    traced = capture(
        model,
        cut_at=split_points,
        concrete_args=concrete_args,
        example_inputs=example_inputs,
        tracer=tracer,
    )
    graph = traced.graph
    assignment = _assign_stages(graph, split_points)
    if traced.method == "export":  # masks and positions: recompute from the inputs, not send
        sink_duplicates(graph, assignment)
    num_stages = len(split_points) + 1
    placement = list(range(num_stages)) if placement is None else list(placement)
    if len(placement) != num_stages:
        raise ValueError(
            f"placement {placement} has {len(placement)} entries for "
            f"{num_stages} stages; give one rank per stage"
        )
    return build_stage_graph(traced, assignment, placement, relay_skips=relay_skips)


def _check_split_points(model: nn.Module, split_points: Sequence[str]) -> None:
    names = {name for name, _ in model.named_modules() if name}
    for point in split_points:
        if point not in names:
            raise unknown_module(model, point, "split point")
    if len(set(split_points)) != len(split_points):
        raise ValueError(f"split points {list(split_points)} repeat a name; give each once")


def _assign_stages(graph: fx.Graph, split_points: Sequence[str]) -> dict[fx.Node, int]:
    """Stage of every node: nodes before the first call into split point i belong to stage i."""
    assignment: dict[fx.Node, int] = {}
    stage = 0
    for node in graph.nodes:
        if node.op in COMPUTE_OPS:
            path = module_path(node)
            for later, point in enumerate(split_points[stage:], start=stage + 1):
                if within(path, point):
                    if later != stage + 1:
                        raise ValueError(
                            f"split point {point!r} runs before {split_points[stage]!r} in "
                            "forward; list split points in the order forward calls them"
                        )
                    stage = later
                    break
        assignment[node] = stage
    if stage != len(split_points):
        raise ValueError(
            f"split point {split_points[stage]!r} is never called by forward "
            "(or only inside a traced-through call); choose modules that forward "
            "calls directly"
        )
    place_attributes(graph, assignment, len(split_points) + 1)
    return assignment
