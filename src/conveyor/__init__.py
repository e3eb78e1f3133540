"""conveyor: pipeline-parallel training of large PyTorch models."""

from conveyor.config import PipelineConfig
from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph, chain
from conveyor.pipeline import Pipeline
from conveyor.rng import microbatch_seed
from conveyor.schedule import SCHEDULES, Action, Program, ProgramError, build_program, validate
from conveyor.simulate import execute

__all__ = [
    "MODEL_OUTPUT", "SCHEDULES", "Action", "Pipeline", "PipelineConfig", "Program",
    "ProgramError", "Stage", "StageGraph", "build_program", "chain", "execute",
    "microbatch_seed", "validate",
]
