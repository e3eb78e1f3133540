"""conveyor: pipeline-parallel training of large PyTorch models.

    pipe = conveyor.Pipeline(model, balance=[3, 3], num_microbatches=8, loss_fn=loss_fn)
    loss = pipe.step(inputs, targets)            # every rank, the same batch
    tokens = pipe.generate(prompts, max_new_tokens=32)   # KV cache per stage, groups in flight
    report = conveyor.plan(workload, num_ranks=2, memory_budget=2**30, batch_size=32)

The flow (DESIGN.md): ``split`` a model into a ``StageGraph`` (conveyor.graph), ``schedule``
it into a ``Program`` (conveyor.program), then run it (``runtime``) or ``simulate`` it; both
give a ``Timeline`` (conveyor.trace). Around them: ``planner``, ``checkpoint``, ``cli``.
"""

from conveyor.checkpoint import Checkpointer, CheckpointError
from conveyor.config import CheckpointConfig, PipelineConfig
from conveyor.data import ResumableLoader
from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph, chain
from conveyor.inference import DecodePipeline, GenerationConfig
from conveyor.pipeline import Pipeline
from conveyor.planner import PlanReport, Workload, plan, profile_model
from conveyor.program import Action, Program
from conveyor.runtime.batchnorm import DeferredBatchNorm
from conveyor.runtime.peers import PeerLostError
from conveyor.runtime.rng import microbatch_seed
from conveyor.schedule import SCHEDULES, ProgramError, build_program, validate
from conveyor.simulator import simulate
from conveyor.split import pop, skippable, stash, verify_skips
from conveyor.trace import Timeline
from conveyor.training import Throughput

__all__ = [
    "MODEL_OUTPUT",
    "SCHEDULES",
    "Action",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "DecodePipeline",
    "DeferredBatchNorm",
    "GenerationConfig",
    "PeerLostError",
    "Pipeline",
    "PipelineConfig",
    "PlanReport",
    "Program",
    "ProgramError",
    "ResumableLoader",
    "Stage",
    "StageGraph",
    "Throughput",
    "Timeline",
    "Workload",
    "build_program",
    "chain",
    "microbatch_seed",
    "plan",
    "pop",
    "profile_model",
    "simulate",
    "skippable",
    "stash",
    "validate",
    "verify_skips",
]
