"""A Pipeline's stages on its mesh: split over the tensor-parallel ranks, wrapped for data
parallelism, and their gradients reduced as soon as each stage's backward is done.

    data = parallelize(stages, mesh, config, program, tied, tp_plan)   # None: one replica
    reductions = Reductions(data, recorded)     # RuntimeHooks.on_weights_done, then finish()

See Note [pipeline mesh] (conveyor.parallel.mesh) and Note [one reduction per step].
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta

from torch import fx, nn

from conveyor.config import PipelineConfig
from conveyor.parallel import DataParallel, PipelineMesh, TPPlan, parallelize_stages
from conveyor.program import Program
from conveyor.split.stages import EXPORTED
from conveyor.trace import REDUCE

__all__ = ["Reductions", "check_tensor_parallel", "parallelize"]

logger = logging.getLogger(__name__)


def parallelize(
    stages: Mapping[int, nn.Module],
    mesh: PipelineMesh | None,
    config: PipelineConfig,
    program: Program,
    tied: list[nn.Parameter],
    tp_plan: TPPlan | None,
) -> DataParallel | None:
    """Split this rank's stages over the tensor-parallel ranks, then wrap them for data
    parallelism (None with one replica)."""
    if mesh is None:
        return None
    if mesh.tp_mesh is not None and tp_plan:
        check_tensor_parallel(program, stages, config.schedule)
        parallelize_stages(stages, mesh.tp_mesh, tp_plan)
    if mesh.dp_mesh is None or mesh.num_replicas == 1:
        if config.fsdp:
            logger.warning("fsdp=True has nothing to shard over with one replica; ignored")
        return None
    return DataParallel(
        dict(stages),
        mesh.dp_mesh,
        fsdp=config.fsdp,
        split_backward=program.has_split_backward,
        tensor_parallel=mesh.tp_mesh is not None and bool(tp_plan),
        tied=tied,
        timeout=timedelta(seconds=config.timeout_s),
        reshard_after_forward=config.reshard_after_forward,
        reduction=config.loss_reduction,
    )


def check_tensor_parallel(program: Program, stages: Mapping[int, nn.Module], schedule: str) -> None:
    """Refuse what tensor parallelism cannot run, before any message: split backward (its
    weight gradients are DTensors, which it cannot keep from I to W), and stages split
    through torch.export (their modules are graph modules, not the nn.Linear and
    nn.Embedding a plan shards)."""
    if program.has_split_backward:
        raise ValueError(
            f"schedule {schedule!r} splits the backward into I and W, which "
            "tensor parallelism does not support; pick gpipe, 1f1b or interleaved-1f1b "
            "with tp, or drop tp"
        )
    exported = [
        s for s, module in stages.items()
        if isinstance(module, fx.GraphModule) and module.meta.get(EXPORTED)
    ]  # fmt: skip
    if exported:
        raise ValueError(
            "tensor parallelism shards nn.Linear and nn.Embedding modules, but this model "
            "was split through torch.export, whose stages hold graph modules (as Hugging "
            "Face models are split); split it with tracer='fx' if torch.fx traces it, or "
            "scale it with data parallelism (dp, fsdp=True) instead of tp"
        )


class Reductions:
    """Each stage's gradients reduced over the replicas once per step, as soon as its last
    backward action has run, each reduction recorded as the stage's ``reduce`` action."""

    def __init__(
        self, data: DataParallel, recorded: Callable[[str], AbstractContextManager[None]]
    ) -> None:
        self.data = data
        self.recorded = recorded

    def stage_done(self, stage: int) -> None:
        """Reduce a stage's gradients now (a stage whose reduction is in flight already: its
        wait comes at the step's end)."""
        if stage not in self.data.in_flight:
            with self.recorded(f"{REDUCE} {stage}"):
                self.data.stage_done(stage)

    def finish(self) -> None:
        """Wait for the reductions in flight, then reduce the parameters two local stages
        share."""
        for stage in self.data.in_flight:
            with self.recorded(f"{REDUCE} {stage}"):
                self.data.wait(stage)
        self.data.end_step()
