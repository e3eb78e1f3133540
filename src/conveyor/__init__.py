"""conveyor: pipeline-parallel training of large PyTorch models.

    pipe = conveyor.Pipeline(model, balance=[3, 3], num_microbatches=8, loss_fn=loss_fn)
    loss = pipe.step(inputs, targets)            # every rank, the same batch
    tokens = pipe.generate(prompts, max_new_tokens=32)   # KV cache per stage, groups in flight
    report = conveyor.plan(workload, num_ranks=2, memory_budget=2**30, batch_size=32)

The flow (docs/design.md): ``split`` a model into a ``StageGraph`` (conveyor.graph), ``schedule``
it into a ``Program`` (conveyor.program), then run it (``runtime``) or ``simulate`` it; both
give a ``Timeline`` (conveyor.trace). Around them: ``planner``, ``checkpoint``, ``cli``.
"""

import importlib
import sys
import types
import warnings
from typing import TYPE_CHECKING, Any

from conveyor.config import CheckpointConfig, PipelineConfig
from conveyor.data import ResumableLoader
from conveyor.graph import MODEL_OUTPUT, Stage, StageGraph, chain
from conveyor.inference import GenerationConfig
from conveyor.pipeline import Pipeline
from conveyor.pipeline.decode import DecodePipeline
from conveyor.pipeline.training import Throughput
from conveyor.planner import PlanReport, Workload, plan, profile_model
from conveyor.program import Action, Program
from conveyor.runtime.batchnorm import DeferredBatchNorm
from conveyor.runtime.peers import PeerLostError
from conveyor.runtime.rng import microbatch_seed
from conveyor.schedule import SCHEDULES, ProgramError, build_program, validate
from conveyor.simulator import simulate
from conveyor.split import pop, skippable, stash, verify_skips
from conveyor.trace import Timeline

if TYPE_CHECKING:
    from conveyor.checkpoint import Checkpointer, CheckpointError

_LAZY = {"Checkpointer": "conveyor.checkpoint", "CheckpointError": "conveyor.checkpoint"}
"""Names read from their package on first use: conveyor.checkpoint imports
torch.distributed.checkpoint, which a run without checkpoints does not need (See Note
[DTensor unimported] in conveyor.runtime.sharded)."""

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

# Modules the re-layouts into packages moved (docs/design.md, "What moved"): their old names
# still import, as aliases that warn when a name is read from them. ``conveyor.plan`` stays
# the function above; ``from conveyor.plan import ...`` reads the planner's names.
_MOVED = {
    "autosplit": "conveyor.split.auto",
    "batchnorm": "conveyor.runtime.batchnorm",
    "partition": "conveyor.planner.partition",
    "plan": "conveyor.planner",
    "profile": "conveyor.planner.profile",
    "skip": "conveyor.split.skip",
    "huggingface": "conveyor.hf.loss",
    "weight_keys": "conveyor.hf.weights",
    "weights": "conveyor.pipeline.weights",
    "uninitialized": "conveyor.pipeline.uninitialized",
    "training": "conveyor.pipeline.training",
    "inference.pipeline": "conveyor.pipeline.decode",
    "inference.models": "conveyor.pipeline.decode",
    "inference.hf": "conveyor.hf.decode",
    "inference.parallelism": "conveyor.planner.parallelism",
    "runtime.faults": "conveyor.pipeline.faults",
    "split.tracing": "conveyor.split.capture",
    "planner.mesh": "conveyor.planner.layouts",
    "planner.decode_cost": "conveyor.inference.cost",
}


def _moved(old: str) -> types.ModuleType:
    """The alias of the moved module ``conveyor.<old>``: a name read from it is the new
    module's, with a DeprecationWarning naming the new module."""
    new = _MOVED[old]
    alias = types.ModuleType(f"conveyor.{old}", f"Moved to {new}; this alias warns.")

    def read(name: str) -> Any:
        if name.startswith("__") and name != "__all__":  # tools probing modules: no warning
            raise AttributeError(name)
        warnings.warn(
            f"conveyor.{old} moved to {new}: import from {new} instead "
            f"(the old name will be removed)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    vars(alias)["__getattr__"] = read
    return alias


for _old in _MOVED:
    sys.modules.setdefault(f"conveyor.{_old}", _moved(_old))

if not TYPE_CHECKING:  # to type checkers, conveyor has only the names above

    def __getattr__(name: str) -> Any:
        """The checkpoint names, imported on first use; ``conveyor.autosplit`` and the other
        moved modules, as their aliases."""
        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
            globals()[name] = value
            return value
        if name in _MOVED:
            return sys.modules[f"conveyor.{name}"]
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
