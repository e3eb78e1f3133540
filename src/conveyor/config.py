"""Configuration: frozen dataclasses in documented sections, validated before any process starts.

    config = PipelineConfig(balance=(3, 3), num_microbatches=8, schedule="zb-h1")
    config = PipelineConfig.from_dict(json.loads(text))          # a plan file, TOML, JSON
    config = resolve(config, plan="plan.json", options={...})    # every source, in one order

``PipelineConfig`` is made of sections: ``SplitConfig`` (how the model is cut and where the
stages go), ``TrainingConfig`` (what a step computes: schedule, micro-batches, recomputation,
loss, randomness) and ``RuntimeConfig`` (how ranks run it: timeouts, memory, tracing). Each
section validates its own fields; fields are also set and read flat (``config.schedule``), as
``Pipeline(model, schedule=...)`` takes them. ``ParallelConfig`` says how the pipeline is
replicated over a mesh: data-parallel replicas, FSDP, tensor parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import numbers
import operator
import os
import typing
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from conveyor.runtime.loss import LossReduction
from conveyor.runtime.recompute import RECOMPUTE_MODES, RecomputeMode

__all__ = [
    "CHECKPOINT_DIR_ENV",
    "DP_ENV",
    "PLAN_ENV",
    "TP_ENV",
    "TRACE_ENV",
    "CheckpointConfig",
    "ParallelConfig",
    "PipelineConfig",
    "RuntimeConfig",
    "SplitConfig",
    "SplitMethod",
    "TrainingConfig",
    "read_plan",
    "resolve",
]

logger = logging.getLogger(__name__)

PLAN_ENV = "CONVEYOR_PLAN"
"""Set by ``conveyor run --plan FILE``: every Pipeline then runs that plan."""
TRACE_ENV = "CONVEYOR_TRACE_DIR"
"""Set by ``conveyor run --trace DIR``: every Pipeline then traces to DIR."""
CHECKPOINT_DIR_ENV = "CONVEYOR_CHECKPOINT_DIR"
"""Set by ``conveyor run --checkpoint-dir DIR``; the default CheckpointConfig.directory."""
DP_ENV = "CONVEYOR_DP"
"""Set by ``conveyor run --dp N``: every Pipeline then runs N data-parallel replicas."""
TP_ENV = "CONVEYOR_TP"
"""Set by ``conveyor run --tp N``: every Pipeline then runs each stage on N tensor-parallel
ranks."""

SplitMethod = Literal["balance", "split_points", "stage_modules", "auto_split"]
_UNSPLIT = {"balance": None, "split_points": None, "stage_modules": None, "auto_split": False}
"""No way to split chosen: what another source's way to split replaces."""


@dataclass(frozen=True, kw_only=True)
class SplitConfig:
    """How the model is cut into stages, and which rank holds each stage."""

    balance: tuple[int, ...] | Literal["cost", "even"] | None = None
    """Layers per stage of an nn.Sequential; or how to choose them when only the number of
    stages is given: 'cost' (each layer timed on the example inputs, the slowest stage made
    as fast as it can be: conveyor.split.balance) or 'even' (layer counts). Default: 'cost'
    when example_inputs are given, else 'even'."""
    split_points: tuple[str, ...] | None = None
    """Qualified names of the submodules that start stages 1, 2, ... (any nn.Module)."""
    stage_modules: tuple[str, ...] | None = None
    """Submodules forming each stage, one entry per stage with comma-separated qualified names,
    e.g. ('text', 'image', 'head,norm'): stages that do not feed each other run concurrently
    (a graph pipeline; see conveyor.split.split_by_modules)."""
    auto_split: bool = False
    """Trace the model and cut it into one stage per rank (or per placement entry) for the
    shortest step, independent branches on different ranks (conveyor.split.auto)."""
    leaf_modules: tuple[str, ...] = ()
    """Submodules auto_split keeps whole and never traces: qualified names ('encoder.3') or
    class names ('Block'), e.g. for code torch.fx cannot trace."""
    tracer: Literal["auto", "fx", "export"] = "auto"
    """How the model is traced to split it: 'fx' (torch.fx; modules without a cut stay whole),
    'export' (torch.export on example_inputs: decorated forwards, masks built from inputs,
    Hugging Face models), or 'auto': fx, and export when fx cannot trace the model and
    example_inputs are given (logged)."""
    placement: tuple[int, ...] | None = None
    """Rank of each stage; default: stage i on rank i, or placement_style with more stages
    than ranks (virtual stages)."""
    virtual_stages: int | None = None
    """Stages per rank when balance, split points or stage modules do not fix the count;
    default: what the schedule needs (its spec in conveyor.schedule.SCHEDULES: 2 for
    interleaved-1f1b, zb-v and dualpipev, else 1)."""
    placement_style: Literal["loop", "v"] | None = None
    """How stages share ranks when placement is not given: 'loop' (stage s on rank s mod p,
    interleaved-1f1b) or 'v' (down the ranks and back, zb-v and dualpipev); default: the
    schedule's."""
    tie_weights: tuple[str, ...] = ()
    """Parameters to keep as one across stages: each entry a comma-separated group of
    qualified names, e.g. '0.tokens.weight,5.out.weight'. One Parameter object reached from
    several stages is tied without being listed."""

    def _check_split(self) -> None:
        if isinstance(self.balance, str) and self.balance not in ("cost", "even"):
            raise ValueError(
                f"balance {self.balance!r} is not a split; expected layers per stage, e.g. "
                "(3, 5), or 'cost' (by measured layer times) or 'even' (by layer count)"
            )
        for name in ("balance", "placement"):
            counts = getattr(self, name)
            if counts is not None and not isinstance(counts, str):
                object.__setattr__(self, name, tuple(_whole(name, c) for c in counts))
        if self.virtual_stages is not None:
            object.__setattr__(
                self, "virtual_stages", _whole("virtual_stages", self.virtual_stages)
            )
        methods = self.split_methods
        if len(methods) > 1:
            raise ValueError(
                f"pass one way to split, got {list(methods)}: balance "
                "(nn.Sequential), split_points (a chain), stage_modules (a graph "
                "by hand) or auto_split=True"
            )
        if self.stage_modules is not None and not all(m.strip(" ,") for m in self.stage_modules):
            raise ValueError(
                f"stage_modules {list(self.stage_modules)} has an empty stage; "
                "give each stage at least one submodule name"
            )
        if isinstance(self.balance, tuple) and any(b < 1 for b in self.balance):
            raise ValueError(
                f"balance {list(self.balance)} has a count below 1; every stage "
                "needs at least one layer"
            )
        if self.virtual_stages is not None and self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.placement_style not in (None, "loop", "v"):
            raise ValueError(f"placement_style must be 'loop' or 'v', got {self.placement_style!r}")
        for group in self.tie_weights:
            if len([n for n in group.split(",") if n.strip()]) < 2:
                raise ValueError(
                    f"tie_weights entry {group!r} names fewer than two "
                    "parameters; give a comma-separated group such as "
                    "'0.tokens.weight,5.out.weight'"
                )

    @property
    def split_methods(self) -> tuple[SplitMethod, ...]:
        """The ways to split that are set (valid configs set at most one)."""
        given = tuple(
            m for m in get_args(SplitMethod) if m != "auto_split" and getattr(self, m) is not None
        )
        return given + (("auto_split",) if self.auto_split else ())

    @property
    def num_stages(self) -> int | None:
        """Stages implied by balance, split points or stage modules; None otherwise."""
        if isinstance(self.balance, tuple):
            return len(self.balance)
        if self.split_points is not None:
            return len(self.split_points) + 1
        if self.stage_modules is not None:
            return len(self.stage_modules)
        return None


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What one step computes: the schedule, micro-batches, recomputation, loss, randomness."""

    num_microbatches: int = 4
    """Micro-batches per step. Fewer than the number of stages leaves ranks idle."""
    schedule: str = "1f1b"
    """Schedule name (see conveyor.schedule.SCHEDULES: gpipe, 1f1b, interleaved-1f1b, zb-h1,
    zb-v, ...) or a schedule file (one line of actions per rank; docs/schedules.md)."""
    recompute: RecomputeMode = "never"
    """Activation recomputation: 'always' keeps only stage inputs and recomputes forwards in
    backward, 'except_last' does so for all micro-batches but the last (whose activations are
    used at once), 'never' keeps everything."""
    stage_recompute: tuple[RecomputeMode, ...] | None = None
    """Activation recomputation per stage (one mode each); overrides recompute. The planner
    (conveyor.planner) writes it."""
    checkpoint: RecomputeMode | None = dataclasses.field(
        default=None, repr=False, metadata={"deprecated": True}
    )
    """Deprecated name of recompute (warns; removed in the next release)."""
    stage_checkpoint: tuple[RecomputeMode, ...] | None = dataclasses.field(
        default=None, repr=False, metadata={"deprecated": True}
    )
    """Deprecated name of stage_recompute (warns; removed in the next release)."""
    loss_reduction: LossReduction = "mean"
    """'mean': the loss is a per-sample mean, so micro-batch losses are weighted by their share
    of the batch and the step's loss equals the full batch's. 'token_mean': the loss is a mean
    over the targets not equal to -100 (a tensor, or the 'labels' of a dict of targets; a
    token-level loss with padding), so micro-batches are weighted by their share of the step's
    counted targets. 'sum': losses are added. A model's
    own loss (no loss_fn) is weighted by what it averages over: its counted labels."""
    seed: int = 0
    """Seed of the per-micro-batch random streams (dropout); See Note [micro-batch randomness]."""
    deferred_batch_norm: bool = False
    """Replace the model's BatchNorm layers by conveyor.runtime.batchnorm.DeferredBatchNorm,
    so the running statistics are those of the whole mini-batch (torchgpipe semantics)."""

    def _take_renamed(self) -> None:
        """Move a value given under a deprecated name to the new one, with a warning."""
        for old, new in RENAMED.items():
            value = getattr(self, old)
            if value is None:
                continue
            if getattr(self, new) != getattr(TrainingConfig, new):
                raise ValueError(
                    f"both {old}= and {new}= are set; {old} is the deprecated name of {new}: "
                    f"give only {new}="
                )
            warnings.warn(
                f"{old}= is deprecated and will be removed; it is now {new}= (activation "
                "recomputation; 'checkpoint' names saved runs, conveyor.checkpoint)",
                DeprecationWarning,
                stacklevel=5,
            )
            object.__setattr__(self, new, value)
            object.__setattr__(self, old, None)

    def _check_training(self) -> None:
        object.__setattr__(
            self, "num_microbatches", _whole("num_microbatches", self.num_microbatches)
        )
        object.__setattr__(self, "seed", _whole("seed", self.seed))
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        self._take_renamed()
        object.__setattr__(self, "recompute", _recompute_mode(self.recompute))
        if self.stage_recompute is not None:
            wrong = [m for m in self.stage_recompute if m not in RECOMPUTE_MODES]
            if wrong:
                raise ValueError(
                    f"stage_recompute has modes {wrong}; each must be one of "
                    f"{list(RECOMPUTE_MODES)}"
                )
        if self.loss_reduction not in get_args(LossReduction):
            raise ValueError(
                f"loss_reduction must be one of {list(get_args(LossReduction))}, got "
                f"{self.loss_reduction!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """How the ranks run a step: how long they wait, what memory they keep, what they record."""

    timeout_s: float = 60.0
    """Longest wait for a peer before the rank fails, naming the peer and the action."""
    compile_timeout_s: float = 600.0
    """Longest wait for a peer in a step whose stages compile (after Pipeline.compile: the
    first step, and the first with new input shapes or another mode), instead of timeout_s:
    a rank compiling its stage sends nothing meanwhile."""
    measure_memory: bool = False
    """Account activation memory for Pipeline.memory() and the trace: saved-tensor hooks on
    every forward, which cost 1.4-6% of a step on CPU (docs/benchmarks.md), hence off
    unless asked for."""
    keep_host_memory: bool = True
    """Keep host memory that tensors free for the next micro-batch instead of returning it to
    the system (glibc malloc, process-wide; See Note [freed host memory] in
    conveyor.runtime.host_memory): 10-25% faster backward on CPU; out of the box, a 1F1B step
    of the benchmark GPT took 3 page faults instead of 730-8,563 and 6-11% less CPU per rank
    (docs/benchmarks.md), at the price of the process holding its peak."""
    trace: bool = False
    """Record every action's start and end, waits and bytes sent (and activation memory with
    measure_memory) (conveyor.trace); read with Pipeline.timeline(). Off costs nothing."""
    trace_dir: str | None = None
    """Also write each rank's recorded steps to <trace_dir>/rank<N>.jsonl (implies trace);
    render with `conveyor trace DIR`."""

    def _check_runtime(self) -> None:
        for name in ("timeout_s", "compile_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number of seconds, got {value!r}")
            if not 0 < float(value) < math.inf:
                raise ValueError(f"{name} must be positive and finite (seconds), got {value}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the pipeline is replicated: the world is dp x pp x tp ranks on one DeviceMesh
    (conveyor.parallel); See Note [pipeline mesh]."""

    dp: int | None = None
    """Data-parallel replicas of the pipeline, each fed its share of the global batch;
    default: the size of the mesh's 'dp' dimension, else 1."""
    pp: int | None = None
    """Pipeline ranks of each replica; default: the mesh's 'pp' size, else what the world
    leaves (world size / (dp x tp))."""
    tp: int | None = None
    """Tensor-parallel ranks of each stage (needs a TP plan: Pipeline(..., tp_plan=...));
    default: the mesh's 'tp' size, else 1."""
    fsdp: bool = False
    """Shard each stage's parameters, gradients and optimizer state over the replicas
    (FSDP2 fully_shard); off, every replica holds them whole (FSDP2's replicate). Either
    way gradients are reduced once per step."""
    reshard_after_forward: bool = False
    """With fsdp: free the gathered parameters after each micro-batch's forward and gather
    them again for its backward (less memory, two all-gathers per micro-batch); off, they
    stay gathered from the step's first forward until its gradients are reduced."""
    broadcast_loss: bool = False
    """Pipeline.step returns the step's loss (the mean over replicas) on every rank, not
    only on the last stage's: a one-number broadcast at the end of each step."""

    def _check_parallel(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.reshard_after_forward and not self.fsdp:
            raise ValueError(
                "reshard_after_forward frees FSDP's gathered parameters, but fsdp is off; "
                "pass fsdp=True as well, or drop reshard_after_forward"
            )


@dataclass(frozen=True, kw_only=True)
class PipelineConfig(ParallelConfig, RuntimeConfig, TrainingConfig, SplitConfig):
    """How to cut, schedule, run and replicate a model: the sections' fields, set and read flat.

    Every field has a default that works on CPU.
    """

    def __post_init__(self) -> None:
        _check_sequences(self)
        self._check_split()
        self._check_training()
        self._check_runtime()
        self._check_parallel()
        if self.measure_memory and (self.dp or 1) > 1:
            raise ValueError(
                "measure_memory counts what autograd saves, and with data parallelism that "
                "includes FSDP2's gathered parameters, which it cannot tell from activations; "
                "measure activation memory with dp=1 (one replica), then scale out"
            )

    @classmethod
    def from_dict(
        cls, fields: Mapping[str, Any], source: str = "the configuration"
    ) -> PipelineConfig:
        """A config from plain data (JSON, TOML, a plan file): lists become tuples.

        Raises:
            ValueError: ``fields`` names a field PipelineConfig does not have; ``source``
                says where the fields came from.
        """
        return cls(**_fields_of(cls, fields, source))

    def replace(self, **fields: Any) -> PipelineConfig:
        """This config with ``fields`` changed (validated again)."""
        return dataclasses.replace(self, **_fields_of(type(self), fields, "the options"))

    def with_plan(self, fields: Mapping[str, Any]) -> PipelineConfig:
        """This config with a plan's fields: a plan's way to split replaces this one's."""
        plan = _fields_of(type(self), fields, "the plan")
        if set(plan) & set(get_args(SplitMethod)):
            plan = {**_UNSPLIT, **plan}
        return dataclasses.replace(self, **plan)

    def with_options(self, fields: Mapping[str, Any]) -> PipelineConfig:
        """This config with a script's own options, which win over a plan's: a way to split of
        theirs replaces the plan's, with the placement and per-stage checkpointing made for
        the plan's stages, and a ``recompute`` of theirs replaces the per-stage one."""
        options = _fields_of(type(self), fields, "the options")
        dropped: dict[str, Any] = {}
        if set(options) & set(get_args(SplitMethod)):
            dropped = {**_UNSPLIT, "placement": None, "stage_recompute": None}
        if "recompute" in options:
            dropped["stage_recompute"] = None
        return dataclasses.replace(self, **{**dropped, **options})

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain data (tuples as lists), for logs, JSON and checkpoints."""
        return {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()
            if k not in RENAMED
        }


RENAMED = {"checkpoint": "recompute", "stage_checkpoint": "stage_recompute"}
"""Deprecated field names and the fields they became (kept for one release)."""

_WORDS = {("balance", "cost"), ("balance", "even")}
"""Words a sequence field takes besides a sequence."""


def _check_sequences(config: PipelineConfig) -> None:
    """Fields that take a sequence hold a tuple of any iterable given (a list, a numpy array,
    a generator); a string or a single value is refused: ``"12"`` would be ``("1", "2")``."""
    for name, hint in _sequence_fields().items():
        value = getattr(config, name)
        if (
            value is None
            or isinstance(value, tuple)
            or (isinstance(value, str) and (name, value) in _WORDS)
        ):
            continue
        if isinstance(value, str | bytes) or not isinstance(value, Iterable):
            hint_one = f"; pass {name}=[{value!r}] for one entry" if isinstance(value, str) else ""
            raise TypeError(
                f"{name} takes a list ({hint}), got {type(value).__name__} {value!r}{hint_one}"
            )
        object.__setattr__(config, name, tuple(value))


@functools.cache
def _sequence_fields() -> dict[str, str]:
    """PipelineConfig's fields that hold tuples, with their types as written."""
    hints = typing.get_type_hints(PipelineConfig)
    return {
        name: str(hint).replace("typing.", "")
        for name, hint in hints.items()
        if any(typing.get_origin(a) is tuple for a in (hint, *typing.get_args(hint)))
    }


def _recompute_mode(value: Any) -> RecomputeMode:
    """``recompute`` as a plain mode name: a name passes, and so does an object whose
    ``str()`` is one (torchgpipe reads the mode with ``str()``, so its users pass enums)."""
    # a str mixed with Enum says 'Mode.NEVER' as str(): a str's own text is its value
    text = str.__str__(value) if isinstance(value, str) else str(value)
    for mode in RECOMPUTE_MODES:
        if text == mode:
            return mode
    said = "" if isinstance(value, str) or text == repr(value) else f", whose str() is {text!r}"
    raise ValueError(f"recompute must be one of {list(RECOMPUTE_MODES)}, got {value!r}{said}")


def _whole(name: str, value: Any) -> int:
    """``value`` as an int: integers pass, integral floats (``42.0``, as TOML or arithmetic
    make them) are converted, anything else is refused naming the field."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)  # int, numpy and torch integers
        if isinstance(value, numbers.Real):
            number = float(value)
            if number.is_integer():
                return int(number)
            raise ValueError(
                f"{name} must be a whole number, got {value!r}; pass an int such as "
                f"{max(1, round(number))}"
            )
    raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")


def _fields_of(cls: type, fields: Mapping[str, Any], source: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"{source} sets unknown fields {unknown}; expected "
            f"{cls.__name__} fields {sorted(known - set(RENAMED))}"
        )
    renamed = {k: RENAMED[k] for k in fields if k in RENAMED and RENAMED[k] in known}
    if renamed:
        warnings.warn(
            f"{source} uses deprecated field names: "
            + ", ".join(f"{old} is now {new}" for old, new in renamed.items()),
            DeprecationWarning,
            stacklevel=3,
        )
    return {renamed.get(k, k): tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def read_plan(path: str | os.PathLike[str]) -> dict[str, Any]:
    """PipelineConfig fields from a plan file written by ``conveyor plan --out FILE``.

    A plan file is JSON with the fields under ``"pipeline"`` (the rest describes the
    prediction). Raises ValueError naming the file if it holds no plan or unknown fields.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"plan file {str(path)!r} is not JSON ({error}); write one with "
            "`conveyor plan ... --out plan.json`"
        ) from error
    if not isinstance(data, dict) or not isinstance(data.get("pipeline"), dict):
        raise ValueError(
            f"plan file {str(path)!r} has no 'pipeline' section; write one with "
            "`conveyor plan ... --out plan.json`"
        )
    return _fields_of(PipelineConfig, data["pipeline"], f"plan file {str(path)!r}")


def _planned(config: PipelineConfig, path: str | os.PathLike[str]) -> PipelineConfig:
    """``config`` with the plan file ``path``'s fields; a bad value names the file."""
    fields = read_plan(path)
    try:
        return config.with_plan(fields)
    except (TypeError, ValueError) as error:
        raise type(error)(f"plan file {str(path)!r}: {error}") from error


def resolve(
    config: PipelineConfig | None = None,
    *,
    plan: str | os.PathLike[str] | None = None,
    options: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> PipelineConfig:
    """The configuration a Pipeline runs, from every source, later ones winning:

    1. ``config`` (default: PipelineConfig());
    2. the plan file ``plan`` (its way to split replaces the config's);
    3. ``options`` (``Pipeline(model, schedule=..., ...)``): a way to split or a
       ``recompute`` of theirs replaces the plan's (with its placement and per-stage
       recomputation);
    4. ``$CONVEYOR_PLAN`` (``conveyor run --plan FILE``): overrides the script;
    5. ``$CONVEYOR_TRACE_DIR`` (``conveyor run --trace DIR``): a trace directory, unless one
       is set already; ``$CONVEYOR_DP`` and ``$CONVEYOR_TP`` (``conveyor run --dp N --tp N``):
       mesh sizes, unless set already.
    """
    config = config or PipelineConfig()
    if plan is not None:
        config = _planned(config, plan)
    config = config.with_options(options or {})
    if environ.get(PLAN_ENV):
        config = _planned(config, environ[PLAN_ENV])
        logger.info("using the plan in %s (conveyor run --plan)", environ[PLAN_ENV])
    if environ.get(TRACE_ENV) and config.trace_dir is None:
        config = config.replace(trace_dir=environ[TRACE_ENV])
    for name, variable in (("dp", DP_ENV), ("tp", TP_ENV)):
        if environ.get(variable) and getattr(config, name) is None:
            config = config.replace(**{name: int(environ[variable])})
    return config


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where, how often and how checkpoints are saved and loaded (conveyor.checkpoint)."""

    directory: str | None = None
    """Directory of the run's checkpoints; default: $CONVEYOR_CHECKPOINT_DIR, which
    `conveyor run --checkpoint-dir DIR` sets."""
    every: int = 100
    """Steps between the checkpoints Checkpointer.maybe_save writes."""
    keep: int = 3
    """Newest complete checkpoints to keep; older ones are deleted only after a newer one is
    complete. 0 keeps all."""
    async_save: bool = True
    """Write in the background: training blocks only for an in-memory snapshot."""
    allow_reshard: bool = False
    """Load a checkpoint saved with another split, placement or number of stages or ranks."""
    allow_numerics_change: bool = False
    """Also load one saved with another schedule, micro-batch count, loss reduction or seed:
    the state loads bitwise, but later losses differ (summation order, dropout streams)."""
    timeout_s: float | None = None
    """Longest wait for the other ranks inside a checkpoint save, load or close; then the rank
    fails naming the lost one. Default: the pipeline's timeout_s. Raise it when the slowest
    rank's write of one checkpoint takes longer (the others wait for it)."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1 step, got {self.every}")
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {self.keep}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
