"""From a model and settings to this rank's part of a Pipeline: the mesh, the device, the split
(StageGraph), checked against the ranks before any message.

    mesh = mesh_of(model, config, mesh, group, tp_plan, plan)     # None: one pipeline
    split_points, graph = split_as_planned(model, config, num_ranks, ...)

Every check here runs before the first message, so a mistake fails on every rank alike and
says what to change; a split that comes from a plan file is named as such.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from conveyor.config import PLAN_ENV, PipelineConfig, read_plan
from conveyor.graph import StageGraph
from conveyor.hf.loss import LABELS, model_loss
from conveyor.parallel import PipelineMesh, TPPlan, pipeline_mesh
from conveyor.parallel.tensor_parallel import check_plan
from conveyor.schedule import spec_of, stage_placement
from conveyor.split import (
    balance_to_split_points,
    even_balance,
    split_by_modules,
    split_model,
)
from conveyor.split.auto import auto_split
from conveyor.split.balance import balance_by_cost, split_candidates, split_points_by_cost
from conveyor.torch_compat import is_compiled

__all__ = [
    "blame_plan",
    "check_model",
    "check_stage_recompute",
    "default_device",
    "mesh_of",
    "split_as_planned",
    "split_summary",
    "usable_device",
    "with_layout",
]

logger = logging.getLogger(__name__)


def check_model(model: Any, loss_fn: Any) -> None:
    """Refuse, before anything else, what no Pipeline can be made of.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        TypeError: a compiled model, or a loss_fn that is not a function.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; launch with `conveyor run "
            "-n N script.py` (or torchrun) and call "
            "torch.distributed.init_process_group() before Pipeline(...)"
        )
    if is_compiled(model):
        raise TypeError(
            "the model was compiled (torch.compile(model)), which cannot be split: it is "
            "one compiled graph around the whole model. Pass the uncompiled model and "
            "call pipe.compile() to compile each stage on its own rank"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a function (outputs, targets) -> scalar loss, got "
            f"{type(loss_fn).__name__} {loss_fn!r}"
        )


def check_stage_recompute(config: PipelineConfig, graph: StageGraph) -> None:
    """One recompute mode per stage, if modes are given per stage."""
    modes = config.stage_recompute
    if modes is not None and len(modes) != graph.num_stages:
        raise ValueError(
            f"stage_recompute {list(modes)} has {len(modes)} modes for {graph.num_stages} "
            "stages; give one mode per stage"
        )


def mesh_of(
    model: nn.Module | StageGraph,
    config: PipelineConfig,
    mesh: DeviceMesh | None,
    group: dist.ProcessGroup | None,
    tp_plan: TPPlan | None,
    plan: str | os.PathLike[str] | None = None,
) -> PipelineMesh | None:
    """The mesh of ``mesh=`` or of the config's sizes (None: one pipeline over ``group``);
    every check runs before any communication, and names a plan file that set the sizes.
    See Note [pipeline mesh]."""
    sized = any(size not in (None, 1) for size in (config.dp, config.tp))
    if group is not None and (mesh is not None or sized):
        raise ValueError(
            "pass group= (one pipeline over a process group of your own) or a mesh (mesh=, "
            "or sizes dp=, pp=, tp=), not both"
        )
    names = list(mesh.mesh_dim_names or ()) if mesh is not None else []
    tp = mesh.size(names.index("tp")) if mesh is not None and "tp" in names else config.tp or 1
    if tp > 1 and not tp_plan:
        raise ValueError(
            f"tp={tp} splits every stage over {tp} ranks, which needs a plan: pass "
            'tp_plan={"module.name": ColwiseParallel(), ...} (torch.distributed.tensor.parallel)'
        )
    if tp_plan and tp == 1:
        raise ValueError(
            "tp_plan is given but there is no tensor parallelism; pass tp=N, or a mesh with "
            "a 'tp' dimension"
        )
    if tp_plan:
        check_plan(tp_plan, _module_names(model))
    if group is not None:
        return None
    timeout = timedelta(seconds=config.timeout_s)
    try:
        return pipeline_mesh(mesh, config.dp, config.pp, config.tp, dist.get_world_size(), timeout)
    except ValueError as error:
        blame_plan(error, plan)
        raise


def _module_names(model: nn.Module | StageGraph) -> list[str]:
    modules = [model] if isinstance(model, nn.Module) else [s.module for s in model.stages]
    return [name for m in modules if m is not None for name, _ in m.named_modules()]


def split_summary(graph: StageGraph, split_points: tuple[str, ...]) -> str:
    """'split before [...]' for a chain; the edges and depth of a graph pipeline."""
    if graph.depth == graph.num_stages:
        return f"split before {list(split_points)}"
    edges = [f"{s.index}->{c}" for s in graph.stages for c in graph.consumers(s.index)]
    return f"graph depth={graph.depth} edges={edges}"


def split_as_planned(
    model: nn.Module | StageGraph,
    config: PipelineConfig,
    num_ranks: int,
    concrete_args: dict[str, Any] | None,
    example_inputs: Any,
    plan: str | os.PathLike[str] | None,
    mesh: PipelineMesh | None = None,
    group: dist.ProcessGroup | None = None,
) -> tuple[tuple[str, ...], StageGraph]:
    """``_split``, checked against the number of ranks; when the split comes from a plan file
    (``plan=`` or ``conveyor run --plan``), an error says so: a plan fits the model and the
    ranks it was made for. ``group``: the ranks that agree on a split by measured cost (the
    pipeline's; on a mesh, None: every rank of the job builds the Pipeline)."""
    try:
        split_points, graph = _split(model, config, num_ranks, concrete_args, example_inputs, group)
        if graph.num_ranks != num_ranks:
            raise ValueError(_ranks_mismatch(graph.num_ranks, num_ranks, mesh))
    except (ValueError, TypeError) as error:
        source = plan
        if source is None:
            raise
        kind = ValueError if isinstance(error, ValueError) else TypeError
        raise kind(
            f"{error} (the split comes from plan file {str(source)!r}, which does not fit "
            "this model on these ranks; make a plan for it with `conveyor plan ... --out "
            "FILE`, or leave the plan out)"
        ) from error
    return split_points, graph


def _split(
    model: nn.Module | StageGraph,
    config: PipelineConfig,
    num_ranks: int,
    concrete_args: dict[str, Any] | None,
    example_inputs: Any,
    group: dist.ProcessGroup | None = None,
) -> tuple[tuple[str, ...], StageGraph]:
    """(split points, StageGraph): a prebuilt graph, stage_modules, auto_split, or a chain cut
    before split points (see conveyor.split)."""
    if isinstance(model, StageGraph):
        if any(s.module is None for s in model.stages):
            raise ValueError(
                "the StageGraph has stages without modules (a topology); pass a "
                "graph from conveyor.split, or the model itself"
            )
        return (), model
    traced = {
        "example_inputs": example_inputs,
        "tracer": config.tracer,
        # interleaved 1F1B and ZB-V run chains: a value that skips stages (a skip connection,
        # a transformer's mask and rotary tables) is passed through every stage between
        "relay_skips": spec_of(config.schedule).needs_chain,
    }
    if config.stage_modules is not None:
        graph = split_by_modules(
            model, config.stage_modules, config.placement, concrete_args, **traced
        )
        return (), graph
    if config.auto_split:
        num_stages = len(config.placement) if config.placement is not None else num_ranks
        return (), auto_split(
            model,
            num_stages,
            num_microbatches=config.num_microbatches,
            placement=config.placement,
            concrete_args=concrete_args,
            leaf_modules=config.leaf_modules,
            **traced,
        )
    split_points = _split_points(model, config, num_ranks, example_inputs, group)
    graph = split_model(model, split_points, config.placement, concrete_args, **traced)
    return split_points, graph


def _ranks_mismatch(needed: int, num_ranks: int, mesh: PipelineMesh | None) -> str:
    """Why a split over ``needed`` ranks does not fit a pipeline of ``num_ranks``, and the
    launch that would fit it (on a mesh, in its dp, pp and tp sizes)."""
    if mesh is None:
        return (
            f"the split places stages on {needed} ranks but the process group has "
            f"{num_ranks}; launch with `conveyor run -n {needed}` or change the split"
        )
    shape = mesh.shape
    world = shape.dp * shape.pp * shape.tp
    fits = shape.dp * needed * shape.tp
    return (
        f"the split places stages on {needed} pipeline ranks but the mesh has pp={shape.pp} "
        f"(dp={shape.dp} x pp={shape.pp} x tp={shape.tp} on a world of {world}); change the "
        f"split to {shape.pp} pipeline ranks, or run pp={needed} on {fits} ranks "
        f"(`conveyor run -n {fits}` with dp={shape.dp}{f', tp={shape.tp}' if shape.tp > 1 else ''})"
    )


def blame_plan(error: ValueError, plan: str | os.PathLike[str] | None) -> None:
    """Note on a mesh ``error`` the plan file that set the mesh's sizes, if one did."""
    for path in (plan, os.environ.get(PLAN_ENV)):
        if path and {"dp", "tp", "pp"} & set(read_plan(path)):
            error.add_note(
                f"the mesh sizes come from plan file {str(path)!r}, made for another world; "
                "plan again with `conveyor plan --world-size N` for this one"
            )


def with_layout(config: PipelineConfig, num_ranks: int) -> PipelineConfig:
    """``config`` with the rank of every stage (conveyor.schedule.stage_placement)."""
    placement = stage_placement(
        config.schedule,
        num_ranks,
        num_stages=config.num_stages,
        virtual_stages=config.virtual_stages,
        style=config.placement_style,
    )
    if config.placement is not None or config.auto_split:
        return config
    return config.replace(placement=tuple(placement))


def _split_points(
    model: nn.Module,
    config: PipelineConfig,
    num_ranks: int,
    example_inputs: Any,
    group: dist.ProcessGroup | None,
) -> tuple[str, ...]:
    """Where to cut: the configured split points; an nn.Sequential's balance; else, given
    only the number of stages, the cut balanced by measured cost or by count (See Note
    [balance by cost])."""
    if config.split_points is not None:
        return tuple(config.split_points)
    if isinstance(config.balance, tuple):
        if not isinstance(model, nn.Sequential):
            raise TypeError(
                f"balance splits an nn.Sequential, but the model is a "
                f"{type(model).__name__}; pass split_points=[...] (qualified names "
                "of the submodules that start each stage) instead"
            )
        return tuple(balance_to_split_points(model, config.balance))
    num_stages = config.num_stages or len(config.placement or range(num_ranks))
    if num_stages == 1 and not isinstance(model, nn.Sequential):
        return ()
    candidates = _candidates(model, num_ranks)
    timed = example_inputs is not None and num_stages > 1
    how = config.balance or ("cost" if timed else "even")
    why = _not_timeable(model, example_inputs) if how == "cost" or not timed else ""
    if how == "even" or why:
        _log_even(config.balance, num_stages, why)
        if isinstance(model, nn.Sequential):  # checks a layer is not repeated, too
            return tuple(balance_to_split_points(model, even_balance(len(model), num_stages)))
        counts = even_balance(len(candidates), num_stages)
        return tuple(candidates[sum(counts[:i])] for i in range(1, num_stages))
    options: dict[str, Any] = {
        "num_microbatches": config.num_microbatches,
        "placement": config.placement,
        # None is the whole job (a pipeline over the world, or every rank of a mesh): all agree
        "group": dist.group.WORLD if group is None and dist.is_initialized() else group,
    }
    if isinstance(model, nn.Sequential):
        choice = balance_by_cost(model, num_stages, example_inputs, **options)
    else:
        own = isinstance(example_inputs, dict) and LABELS in example_inputs
        choice = split_points_by_cost(
            model, num_stages, example_inputs, candidates=candidates,
            loss_fn=model_loss if own else None, **options,
        )  # fmt: skip
    logger.info("%s", choice)
    advice = choice.heavy_last_unit()
    if advice is not None:
        logger.warning("%s", advice)
    return tuple(choice.split_points)


# Note [balance by cost]:
# Given the number of stages and not the cut, conveyor cuts where the slowest stage is fastest
# on measured costs: each layer of an nn.Sequential (or the embedding and each repeated block
# of another model, a transformer's) is timed forward and backward on one micro-batch of the
# example inputs (conveyor.split.balance, a couple of seconds, cached per process), every rank
# agrees on the times, and the cut comes from them, logged with the predicted per-stage times
# beside the even split's. A language model's embedding and output head are not one layer's
# cost each, so an even count leaves the last rank the bottleneck. Without example inputs, for
# a model built on the meta device (nothing to time), or with balance='even', the layers are
# split evenly by count.
def _candidates(model: nn.Module, num_ranks: int) -> list[str]:
    """The submodules a stage may start at: an nn.Sequential's layers, or the repeated
    blocks of another model (a transformer's ``model.layers.*``) and its vocabulary chunks."""
    if isinstance(model, nn.Sequential):
        return [str(index) for index in range(len(model))]
    try:
        return split_candidates(model)
    except ValueError:
        raise ValueError(
            f"cannot split a {type(model).__name__} over {num_ranks} ranks "
            "without split points; pass split_points=[...] naming the "
            "submodules that start stages 1.., e.g. ['layers.4'], "
            "stage_modules=(...) naming each stage's submodules, or "
            "auto_split=True"
        ) from None


def _not_timeable(model: nn.Module, example_inputs: Any) -> str:
    """Why the model's layers cannot be timed ('' when they can)."""
    if example_inputs is None:
        return "no example_inputs to time its layers on"
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return "it is built on the meta device, with nothing to time"
    return ""


def _log_even(balance: str | None, num_stages: int, why: str) -> None:
    """Say why the layers are split evenly by count."""
    if balance is None and num_stages > 1:
        logger.info(
            "splitting evenly by layer count (%s); pass example_inputs to balance the "
            "stages by measured cost, or balance=... for a split of your own",
            why or "balance='even'",
        )
    elif why:
        logger.warning("balance='cost' cannot time the model (%s); splitting evenly", why)


def usable_device(device: torch.device | str) -> torch.device:
    """``device``, if this torch build and machine have it."""
    found = torch.device(device)
    if found.type != "cpu" and found.type != "meta":
        module = getattr(torch, found.type, None)
        available = getattr(module, "is_available", None)
        if available is not None and not available():
            raise ValueError(
                f"device={str(device)!r}, but this torch ({torch.__version__}) sees no "
                f"{found.type} device here; pass device='cpu' (with the gloo backend) or leave "
                "device out to use this process's accelerator when there is one"
            )
    return found


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """CPU for gloo; otherwise this process's current accelerator (one GPU per rank)."""
    if dist.get_backend(group) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
