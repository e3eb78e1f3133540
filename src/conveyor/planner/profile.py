"""Profile a model on the device it runs on: per-layer (or graph node) costs, runtime overheads
and the link between ranks, saved as plain JSON for the simulator and the planner.

    workload = conveyor.planner.example("gpt")
    profile = profile_model(workload, microbatch_sizes=[4, 8])      # one process, no peers
    profile.save("gpt.profile.json"); Profile.load("gpt.profile.json")

A *unit* is one node of the model traced with torch.fx, where nested ``nn.Sequential``
containers are traced through and every other submodule is one node: for an
``nn.Sequential`` the units are its layers. Times are medians of repeated runs, in seconds,
measured the way a Pipeline runs by default (no activation accounting); bytes follow
``conveyor.runtime.memory.ActivationMeter``'s accounting (storages, parameters excluded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from conveyor.files import write_atomic
from conveyor.planner.budget import passed
from conveyor.runtime.backward import WeightGrad, backward_input, grad_leaves
from conveyor.runtime.host_memory import keep_freed_memory
from conveyor.simulator import Link, Overheads  # kept with the simulator, named here too
from conveyor.split.capture import capture_graph
from conveyor.split.inputs import bind_inputs
from conveyor.split.untouched import untouched
from conveyor.torch_compat import pytree

__all__ = [
    "Link",
    "Overheads",
    "Profile",
    "Unit",
    "UnitStats",
    "Workload",
    "profile_model",
    "scaled",
    "trace_units",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class Workload:
    """What to profile: a model, a batch maker and the loss."""

    name: str
    model: nn.Module
    batch: Callable[[int], tuple[Any, Any]]
    """batch_size -> (inputs, targets), as ``Pipeline.step`` takes them."""
    loss_fn: LossFn


@dataclass(frozen=True)
class Unit:
    """One node of the traced model: what it is and what it consumes."""

    name: str
    """The fx node's name."""
    target: str
    """The submodule's qualified name for a module call (a valid split point), else ''."""
    inputs: tuple[int, ...]
    """Units whose outputs it consumes, in argument order; -1 - i for the model's i-th input."""
    param_bytes: int
    """Bytes of the parameters and buffers it owns (each counted at its first user)."""
    trainable_bytes: int
    """Bytes of those parameters that get gradients (and optimizer state)."""


@dataclass(frozen=True)
class UnitStats:
    """One unit's costs at one micro-batch size."""

    forward: float
    backward: float
    """Full backward: input and weight gradients."""
    backward_input: float
    """Input gradients only: the I of the runtime's split backward (conveyor.runtime.backward)."""
    backward_weight: float
    """The weight gradients that I deferred: W (``WeightGrad.run``)."""
    saved_bytes: int
    """Storages autograd keeps for backward, other than its inputs' and its outputs'."""
    output_bytes: int
    saves_input: tuple[bool, ...]
    """Per input: whether autograd keeps that input for backward."""
    saves_output: bool
    """Whether autograd keeps its output (e.g. GELU, softmax do)."""
    message_bytes: int = 0
    """Bytes of its output tensors as a message carries them (views count whole)."""
    weight_grad_bytes: int = 0
    """Gradients a split backward keeps from I until W
    (``conveyor.runtime.backward.WeightGrad``)."""

    def scaled(self, other: UnitStats, weight: float) -> UnitStats:
        """Linear interpolation towards ``other`` (weight 0: self, 1: other), floored at 0."""

        def mix(a: float, b: float) -> float:
            return max(0.0, a + (b - a) * weight)

        return UnitStats(
            mix(self.forward, other.forward),
            mix(self.backward, other.backward),
            mix(self.backward_input, other.backward_input),
            mix(self.backward_weight, other.backward_weight),
            round(mix(self.saved_bytes, other.saved_bytes)),
            round(mix(self.output_bytes, other.output_bytes)),
            self.saves_input,
            self.saves_output,
            round(mix(self.message_bytes, other.message_bytes)),
            round(mix(self.weight_grad_bytes, other.weight_grad_bytes)),
        )


@dataclass
class Profile:
    """Measured costs of one model on one device; JSON on disk (``save``/``load``)."""

    model: str
    units: tuple[Unit, ...]
    stats: dict[int, tuple[UnitStats, ...]]
    """Per micro-batch size (samples), each unit's costs."""
    loss: dict[int, tuple[float, float]]
    """Per micro-batch size: the loss's forward and backward seconds."""
    input_bytes_per_sample: int
    """Bytes of the model inputs per sample (the last stage's targets not included)."""
    model_input_bytes: tuple[int, ...] = ()
    """Bytes per sample of each model input (forward's parameters, in order)."""
    overheads: Overheads = field(default_factory=Overheads)
    link: Link | None = None
    """None until measured between two ranks (``conveyor.planner.calibrate.measure_link``);
    transfers are then free."""
    optimizer_state_per_param: float = 2.0
    """Optimizer state bytes per trainable parameter byte (AdamW keeps two moments: 2)."""
    depth: int = 1
    """Unit depth the model was traced at (see ``trace_units``)."""
    calibration: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per micro-batch size: how much longer the whole model's forward and backward took, run
    in sequence, than the sum of its units measured alone (applied to ``stats`` already)."""
    environment: dict[str, Any] = field(default_factory=dict)
    unmeasured_sizes: tuple[int, ...] = ()
    """Micro-batch sizes asked for but not measured: the time budget ran out first. The
    planner does not search the micro-batch counts that would run them."""
    budget_notes: tuple[str, ...] = ()
    """What else the time budget left out (passes, precision, calibration), one note each;
    empty when the measurement was complete."""
    reduce_link: Link | None = None
    """The link a ring all-reduce sees between two ranks (``calibrate.measure_allreduce``),
    for gradient reductions over data-parallel replicas; None until measured."""

    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def microbatch_sizes(self) -> list[int]:
        return sorted(self.stats)

    def at(self, microbatch_size: float) -> tuple[UnitStats, ...]:
        """Unit costs at ``microbatch_size``: measured, or interpolated linearly between the
        two nearest measured sizes (extrapolated from the two nearest outside them)."""
        sizes = self.microbatch_sizes
        if not sizes:
            raise ValueError(f"profile of {self.model!r} holds no measurements")
        exact = round(microbatch_size)
        if exact == microbatch_size and exact in self.stats:
            return self.stats[exact]
        if len(sizes) == 1:
            ratio = microbatch_size / sizes[0]
            return tuple(
                s.scaled(_times(s, 0.0), 1.0 - ratio)
                if ratio < 1
                else s.scaled(_times(s, 2.0), ratio - 1.0)
                for s in self.stats[sizes[0]]
            )
        low, high = _bracket(sizes, microbatch_size)
        weight = (microbatch_size - low) / (high - low)
        return tuple(
            a.scaled(b, weight) for a, b in zip(self.stats[low], self.stats[high], strict=True)
        )

    def loss_at(self, microbatch_size: float) -> tuple[float, float]:
        sizes = self.microbatch_sizes
        if len(sizes) == 1:
            forward, backward = self.loss[sizes[0]]
            ratio = microbatch_size / sizes[0]
            return forward * ratio, backward * ratio
        low, high = _bracket(sizes, microbatch_size)
        weight = (microbatch_size - low) / (high - low)
        (f0, b0), (f1, b1) = self.loss[low], self.loss[high]
        return max(0.0, f0 + (f1 - f0) * weight), max(0.0, b0 + (b1 - b0) * weight)

    def check(self, units: Sequence[Unit]) -> None:
        """Raise ValueError unless ``units`` (a traced model's) are this profile's units."""
        mine = [(u.name, u.param_bytes) for u in self.units]
        theirs = [(u.name, u.param_bytes) for u in units]
        if mine != theirs:
            diff = next(
                (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                min(len(mine), len(theirs)),
            )
            raise ValueError(
                f"profile {self.model!r} does not match the model: the profile has "
                f"{len(mine)} units, the model {len(theirs)}, first difference at unit {diff} "
                f"({mine[diff] if diff < len(mine) else 'none'} vs "
                f"{theirs[diff] if diff < len(theirs) else 'none'}); profile this model again "
                "(conveyor plan ... --save-profile FILE)"
            )

    # -- files -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "units": [dataclasses.asdict(u) for u in self.units],
            "stats": {str(k): [dataclasses.asdict(s) for s in v] for k, v in self.stats.items()},
            "loss": {str(k): list(v) for k, v in self.loss.items()},
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "model_input_bytes": list(self.model_input_bytes),
            "overheads": dataclasses.asdict(self.overheads),
            "link": _link_dict(self.link),
            "optimizer_state_per_param": self.optimizer_state_per_param,
            "depth": self.depth,
            "calibration": {str(k): list(v) for k, v in self.calibration.items()},
            "environment": self.environment,
            "unmeasured_sizes": list(self.unmeasured_sizes),
            "budget_notes": list(self.budget_notes),
            "reduce_link": _link_dict(self.reduce_link),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        def unit(d: dict[str, Any]) -> Unit:
            return Unit(**{**d, "inputs": tuple(d["inputs"])})

        def stat(d: dict[str, Any]) -> UnitStats:
            return UnitStats(**{**d, "saves_input": tuple(d["saves_input"])})

        return cls(
            model=data["model"],
            units=tuple(unit(u) for u in data["units"]),
            stats={int(k): tuple(stat(s) for s in v) for k, v in data["stats"].items()},
            loss={int(k): (float(v[0]), float(v[1])) for k, v in data["loss"].items()},
            input_bytes_per_sample=int(data["input_bytes_per_sample"]),
            model_input_bytes=tuple(int(b) for b in data.get("model_input_bytes", ())),
            overheads=Overheads(**data.get("overheads", {})),
            link=None if data.get("link") is None else Link(**data["link"]),
            optimizer_state_per_param=float(data.get("optimizer_state_per_param", 2.0)),
            depth=int(data.get("depth", 1)),
            calibration={
                int(k): (float(v[0]), float(v[1])) for k, v in data.get("calibration", {}).items()
            },
            environment=dict(data.get("environment", {})),
            unmeasured_sizes=tuple(int(s) for s in data.get("unmeasured_sizes", ())),
            budget_notes=tuple(str(n) for n in data.get("budget_notes", ())),
            reduce_link=None if data.get("reduce_link") is None else Link(**data["reduce_link"]),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile written by ``save``; ValueError names a file that is not one."""
        try:
            data = json.loads(Path(path).read_text())
            return cls.from_dict(data)
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{str(path)!r} is not a conveyor profile ({error!r}); write one "
                "with `conveyor plan ... --save-profile FILE`"
            ) from error


def _link_dict(link: Link | None) -> dict[str, float] | None:
    return None if link is None else dataclasses.asdict(link)


def _bracket(sizes: list[int], value: float) -> tuple[int, int]:
    """The two measured sizes to interpolate (or extrapolate) ``value`` from."""
    above = [s for s in sizes if s >= value]
    if not above:
        return sizes[-2], sizes[-1]
    high = above[0]
    index = sizes.index(high)
    return (sizes[index - 1], high) if index > 0 else (sizes[0], sizes[1])


def _times(stats: UnitStats, factor: float) -> UnitStats:
    return UnitStats(
        stats.forward * factor,
        stats.backward * factor,
        stats.backward_input * factor,
        stats.backward_weight * factor,
        round(stats.saved_bytes * factor),
        round(stats.output_bytes * factor),
        stats.saves_input,
        stats.saves_output,
        round(stats.message_bytes * factor),
        round(stats.weight_grad_bytes * factor),
    )


# -- tracing into units ------------------------------------------------------------------------


def _leaf_at(depth: int) -> Callable[[nn.Module, str], bool]:
    """Leaf rule for units at ``depth``: nn.Sequential is always traced through; torch.nn's own
    modules are always leaves; other modules are leaves from ``depth`` levels down."""

    def leaf(module: nn.Module, name: str) -> bool:
        if isinstance(module, nn.Sequential):
            return False
        if type(module).__module__.startswith("torch.nn"):
            return True
        return name.count(".") + 1 >= depth

    return leaf


def trace_units(
    model: nn.Module, depth: int = 1
) -> tuple[fx.Graph, list[fx.Node], tuple[Unit, ...]]:
    """Trace ``model`` into units: the fx graph, its unit nodes in order, and their Units.

    At ``depth`` 1 the units are the model's submodules (an nn.Sequential's layers, nested
    nn.Sequential containers opened up); at depth 2 the submodules of those, and so on.

    Raises:
        TypeError: the model (or, deeper, a layer) cannot be traced with torch.fx.
    """
    try:
        graph = capture_graph(model, (), leaf=_leaf_at(depth))
    except TypeError as error:
        raise TypeError(
            f"{error}. The planner profiles a model traced by torch.fx; one that only "
            "torch.export traces (a Hugging Face model) cannot be planned yet: split it by "
            "hand (split_points=..., example_inputs=...) and compare schedules on measured "
            "timelines (Pipeline(..., trace=True))"
        ) from error
    nodes = [n for n in graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    index = {n: i for i, n in enumerate(nodes)}
    index.update({n: -1 - i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")})
    seen: set[int] = set()
    units = []
    for node in nodes:
        inputs = tuple(index[a] for a in node.all_input_nodes if a.op != "get_attr")
        owned = _owned_tensors(model, node, graph)
        fresh = [(t, trainable) for t, trainable in owned if id(t) not in seen]
        seen.update(id(t) for t, _ in owned)
        units.append(
            Unit(
                node.name,
                str(node.target) if node.op == "call_module" else "",
                inputs,
                sum(_nbytes(t) for t, _ in fresh),
                sum(_nbytes(t) for t, trainable in fresh if trainable),
            )
        )
    return graph, nodes, tuple(units)


def _owned_tensors(
    model: nn.Module, node: fx.Node, graph: fx.Graph
) -> list[tuple[torch.Tensor, bool]]:
    """Parameters and buffers a node uses: its module's, or the get_attr values it reads."""
    if node.op == "call_module":
        module = model.get_submodule(str(node.target))
        return [(p, p.requires_grad) for p in module.parameters()] + [
            (b, False) for b in module.buffers()
        ]
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _attr(model, str(arg.target))
            if isinstance(value, torch.Tensor):
                found.append((value, value.requires_grad))
    return found


def _attr(model: nn.Module, target: str) -> Any:
    value: Any = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _run_node(model: nn.Module, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    if node.op == "call_module":
        return model.get_submodule(str(node.target))(*args, **kwargs)
    if node.op == "call_function":
        assert callable(node.target)
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        receiver, *rest = args
        return getattr(receiver, str(node.target))(*rest, **kwargs)
    if node.op == "get_attr":
        return _attr(model, str(node.target))
    raise AssertionError(f"not a computing node: {node.op}")


# -- measuring units ---------------------------------------------------------------------------


def profile_model(
    workload: Workload,
    microbatch_sizes: Sequence[int] = (4,),
    *,
    depth: int = 1,
    threads: int | None = 1,
    min_time_s: float = 0.02,
    min_repeats: int = 5,
    passes: int = 3,
    deadline: float | None = None,
) -> Profile:
    """Measure every unit's forward, backward (input and weight parts), saved and output bytes
    at each micro-batch size, in this process (no peers needed).

    Args:
        threads: torch threads while measuring (default 1: one rank per core, as
            ``conveyor run`` and torchrun start ranks); None keeps the current setting.
        min_time_s: each measurement repeats until it has run this long (and ``min_repeats``
            times); the median is kept.
        passes: every unit is measured in this many passes over the model, and the median
            of the passes is kept, so that a burst of other work on the machine spoils one
            pass of one unit rather than all of its measurement.
        deadline: ``time.monotonic()`` to stop by (None: measure everything). Sizes are
            measured in the order given, each size's first pass before any second pass;
            what the deadline cuts is listed in the profile's ``unmeasured_sizes`` and
            ``budget_notes``. The first pass at the first size is always finished, past the
            deadline with each unit timed quickly (See Note [planning budget]).

    Measures with freed host memory kept for reuse, as a Pipeline runs by default
    (``conveyor.runtime.host_memory``; process-wide).
    """
    if not microbatch_sizes or any(size < 1 for size in microbatch_sizes):
        raise ValueError(
            f"microbatch_sizes must be positive sample counts, got {list(microbatch_sizes)}"
        )
    order = list(dict.fromkeys(microbatch_sizes))
    keep_freed_memory()
    model = workload.model
    graph, nodes, units = trace_units(model, depth)
    rounds: dict[int, list[_Round]] = {size: [] for size in order}
    batches: dict[int, tuple[Any, Any]] = {}
    measure = _Timer(min_time_s / max(passes, 1), min_repeats)
    began = time.monotonic()
    logger.info(
        "profiling %s: %d units at micro-batch sizes %s, %d passes%s",
        workload.name,
        len(nodes),
        order,
        max(passes, 1),
        "" if deadline is None else f" (for up to {max(0.0, deadline - began):.0f} s)",
    )
    with _threads(threads), untouched(model):
        model.train()
        for pass_index in range(max(passes, 1)):
            for size in order:
                is_least = pass_index == 0 and size == order[0]  # a plan needs this one
                if not is_least and passed(deadline):
                    break
                if size not in batches:
                    batches[size] = workload.batch(size)
                logger.debug(
                    "profiling %s: pass %d at micro-batch size %d", workload.name, pass_index, size
                )
                done = _one_pass(workload, graph, nodes, batches[size], measure, deadline, is_least)
                if done is not None:
                    rounds[size].append(done)
    profile = _from_rounds(workload, graph, units, rounds, batches, depth, threads)
    notes = _cut_notes(order, rounds, max(passes, 1), len(nodes))
    if notes:
        logger.info(
            "profiling %s stopped at its deadline after %.1f s: %s",
            workload.name,
            time.monotonic() - began,
            "; ".join(notes),
        )
    return replace(
        profile,
        unmeasured_sizes=tuple(size for size in order if not rounds[size]),
        budget_notes=tuple(notes),
    )


@dataclass(frozen=True)
class _Round:
    """One pass over the units at one micro-batch size."""

    alone: tuple[UnitStats, ...]
    loss: tuple[float, float]
    factors: tuple[float, float] | None
    """Note [units in sequence]'s factors; None when the deadline left no time for them."""
    quick_from: int | None = None
    """The first unit timed quickly (3 runs), when the deadline passed during the pass."""


def _one_pass(
    workload: Workload,
    graph: fx.Graph,
    nodes: Sequence[fx.Node],
    batch: tuple[Any, Any],
    measure: _Timer,
    deadline: float | None,
    must_finish: bool,
) -> _Round | None:
    """Every unit, the loss and the model in sequence, at one size; None when the deadline
    passes first, unless ``must_finish`` (then the rest is timed quickly)."""
    model = workload.model
    inputs, targets = batch
    env = _capture(model, graph, inputs)
    output = env[next(n for n in graph.nodes if n.op == "output").args[0]]
    alone: list[UnitStats] = []
    quick_from = None
    for index, node in enumerate(nodes):
        if quick_from is None and passed(deadline):
            if not must_finish:
                return None
            # the median of 3 runs: a single run would carry any preemption whole
            quick_from, measure = index, _Timer(0.0, 3)
        # every unit is timed: layers alike in code and shapes may still differ in cost
        alone.append(_unit_stats(model, node, env, measure))
    if passed(deadline) and not must_finish:
        return None
    loss = _loss_times(workload.loss_fn, output, targets, measure)
    factors = None
    if not passed(deadline):
        factors = _in_sequence(workload, inputs, targets, alone, loss, measure)
    _zero_grads(model)
    return _Round(tuple(alone), loss, factors, quick_from)


def _from_rounds(
    workload: Workload,
    graph: fx.Graph,
    units: tuple[Unit, ...],
    rounds: dict[int, list[_Round]],
    batches: dict[int, tuple[Any, Any]],
    depth: int,
    threads: int | None,
) -> Profile:
    """The profile of the sizes measured: medians over their passes, scaled by the factors."""
    stats: dict[int, tuple[UnitStats, ...]] = {}
    losses: dict[int, tuple[float, float]] = {}
    calibration: dict[int, tuple[float, float]] = {}
    per_sample = 0
    per_input: tuple[int, ...] = ()
    for size in sorted(s for s, done in rounds.items() if done):
        done = rounds[size]
        alone = tuple(_median_stats([r.alone[u] for r in done]) for u in range(len(units)))
        losses[size] = (
            statistics.median(r.loss[0] for r in done),
            statistics.median(r.loss[1] for r in done),
        )
        fitted = [r.factors for r in done if r.factors is not None]
        factors = (
            (statistics.median(f[0] for f in fitted), statistics.median(f[1] for f in fitted))
            if fitted
            else (1.0, 1.0)
        )
        calibration[size] = factors
        stats[size] = tuple(_times_by(s, *factors) for s in alone)
        bound = bind_inputs(workload.model, batches[size][0])
        per_sample = _tree_bytes(bound) // size
        per_input = tuple(
            _tree_bytes(bound.get(str(n.target))) // size
            for n in graph.nodes
            if n.op == "placeholder"
        )
        logger.info(
            "profiled %s at micro-batch size %d: forward %.2f ms, backward %.2f ms",
            workload.name,
            size,
            1e3 * sum(s.forward for s in stats[size]),
            1e3 * sum(s.backward for s in stats[size]),
        )
    return Profile(
        workload.name,
        units,
        stats,
        losses,
        per_sample,
        per_input,
        depth=depth,
        calibration=calibration,
        environment=_environment(threads if threads is not None else torch.get_num_threads()),
    )


def _units(first: int, num_units: int) -> str:
    """'units 3-6 of 6' (``first`` counted from 0), or 'unit 6 of 6'."""
    if first == num_units - 1:
        return f"unit {num_units} of {num_units}"
    return f"units {first + 1}-{num_units} of {num_units}"


def _cut_notes(
    order: list[int], rounds: dict[int, list[_Round]], passes: int, num_units: int
) -> list[str]:
    """What the deadline left out of a profile, one note each."""
    notes = []
    missing = [size for size in order if not rounds[size]]
    if missing:
        notes.append(f"micro-batch sizes {missing} not profiled")
    for size in order:
        if 0 < len(rounds[size]) < passes:
            notes.append(f"{len(rounds[size])} of {passes} passes at micro-batch size {size}")
        notes += [
            f"{_units(r.quick_from, num_units)} at micro-batch size {size} timed quickly "
            "(median of 3 runs)"
            for r in rounds[size]
            if r.quick_from is not None
        ]
        if rounds[size] and all(r.factors is None for r in rounds[size]):
            notes.append(f"micro-batch size {size} not calibrated in sequence")
    return notes


@contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _environment(threads: int) -> dict[str, Any]:
    return {
        "device": "cpu",
        "threads": threads,
        "torch": torch.__version__,
        "host": platform.node(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _capture(model: nn.Module, graph: fx.Graph, inputs: Any) -> dict[fx.Node, Any]:
    """Every node's value in one forward of ``inputs`` (no autograd graph kept)."""
    bound = bind_inputs(model, inputs)
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = bound[str(node.target)]
            elif node.op != "output":
                env[node] = _run_node(model, node, env)
    return env


class _Timer:
    """Median seconds of a callable, repeated until ``min_time_s`` and ``min_repeats``."""

    def __init__(self, min_time_s: float, min_repeats: int) -> None:
        self.min_time_s = min_time_s
        self.min_repeats = min_repeats

    def __call__(self, prepare: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        run(prepare())  # warm-up
        samples: list[float] = []
        spent = 0.0
        while len(samples) < self.min_repeats or spent < self.min_time_s:
            state = prepare()
            start = time.perf_counter()
            run(state)
            samples.append(time.perf_counter() - start)
            spent += samples[-1]
            if len(samples) >= 10_000:
                break
        return statistics.median(samples)


def _fresh(value: Any) -> Any:
    """A value's tensors as new autograd leaves (floating ones require grad, as a stage's
    inputs from other units do)."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_(t.is_floating_point() or t.is_complex())

    return pytree.tree_map_only(torch.Tensor, leaf, value)


def _unit_stats(
    model: nn.Module, node: fx.Node, env: dict[fx.Node, Any], measure: _Timer
) -> UnitStats:
    sources = [a for a in node.all_input_nodes if a.op != "get_attr"]

    def inputs() -> dict[fx.Node, Any]:
        local = dict(env)
        for a in sources:
            local[a] = _fresh(env[a]) if a.op != "placeholder" else env[a]
        return local

    def forward(local: dict[fx.Node, Any]) -> Any:  # no meter, as Pipelines run by default
        return _run_node(model, node, local)

    def forward_for_backward(
        local: dict[fx.Node, Any],
    ) -> tuple[list[torch.Tensor], list[Any], list[torch.Tensor]]:
        out = forward(local)
        roots = grad_leaves(out)
        grads = [torch.ones_like(r) for r in roots]
        wrt = [t for a in sources for t in grad_leaves(local[a])]
        return roots, grads, wrt

    def backward(state: tuple[list[torch.Tensor], list[Any], list[torch.Tensor]]) -> None:
        roots, grads, _ = state
        if roots:
            torch.autograd.backward(roots, grads)

    def split(state: tuple[list[torch.Tensor], list[Any], list[torch.Tensor]]) -> WeightGrad:
        roots, grads, wrt = state
        return backward_input(roots, grads, wrt)[1]

    forward_time = measure(inputs, forward)
    has_backward = bool(forward_for_backward(inputs())[0])
    if not has_backward:
        return UnitStats(
            forward_time, 0.0, 0.0, 0.0, *_saved(model, node, inputs()), _tree_bytes(env[node])
        )
    backward_time = measure(lambda: forward_for_backward(inputs()), backward)
    # the runtime's split backward (conveyor.runtime.backward): I, then W from what I kept
    input_time = measure(lambda: forward_for_backward(inputs()), split)
    weight_time = measure(lambda: split(forward_for_backward(inputs())), WeightGrad.run)
    kept = _storages(split(forward_for_backward(inputs())).tensors())
    return UnitStats(
        forward_time,
        backward_time,
        input_time,
        weight_time,
        *_saved(model, node, inputs()),
        _tree_bytes(env[node]),
        sum(kept.values()),
    )


def _saved(
    model: nn.Module, node: fx.Node, local: dict[fx.Node, Any]
) -> tuple[int, int, tuple[bool, ...], bool]:
    """Bytes autograd keeps for one forward of ``node``, split as ActivationMeter counts them."""
    excluded = {
        t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())
    }
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _run_node(model, node, local)
    sources = [a for a in node.all_input_nodes if a.op != "get_attr"]
    input_storages = [_storages(local[a]) for a in sources]
    output_storages = _storages(out)
    saved = sum(
        b
        for p, b in kept.items()
        if p not in output_storages and not any(p in s for s in input_storages)
    )
    output_bytes = sum(
        b for p, b in output_storages.items() if not any(p in s for s in input_storages)
    )
    return (
        saved,
        output_bytes,
        tuple(any(p in kept for p in s) for s in input_storages),
        any(p in kept for p in output_storages),
    )


def _storages(value: Any) -> dict[int, int]:
    found = {}
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            storage = leaf.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _tree_bytes(value: Any) -> int:
    return sum(_nbytes(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _loss_times(loss_fn: LossFn, output: Any, targets: Any, measure: _Timer) -> tuple[float, float]:
    forward = measure(lambda: _fresh(output), lambda out: loss_fn(out, targets))

    def prepare() -> torch.Tensor:
        return loss_fn(_fresh(output), targets)

    backward = measure(prepare, lambda loss: loss.backward())
    return forward, backward


# Note [units in sequence]:
# A unit measured alone, again and again on the same input, finds its weights and buffers
# in cache and its memory freshly reused; inside a stage it follows other units. On this
# machine that makes the sum of the units' forwards 10-20% faster than the forward of the same
# units in sequence. So the whole model also runs in sequence, forward and backward, the way
# a stage does, and the units' times are scaled by the ratios, which the profile keeps in
# ``calibration``. Factors outside [0.5, 2] mean the measurement was disturbed, and are
# clamped.
def _in_sequence(
    workload: Workload,
    inputs: Any,
    targets: Any,
    units: Sequence[UnitStats],
    loss: tuple[float, float],
    measure: _Timer,
) -> tuple[float, float]:
    """(forward, backward) factors: the whole model in sequence over its units alone."""
    model = workload.model
    bound = bind_inputs(model, inputs)

    def forward(_: Any) -> Any:
        return model(**bound)

    def loss_of_forward() -> torch.Tensor:
        return workload.loss_fn(forward(None), targets)

    forward_time = measure(lambda: None, forward)
    backward_time = measure(loss_of_forward, lambda value: value.backward())
    _zero_grads(model)
    alone_forward = sum(u.forward for u in units)
    alone_backward = sum(u.backward for u in units) + loss[1]
    factors = (
        forward_time / alone_forward if alone_forward else 1.0,
        backward_time / alone_backward if alone_backward else 1.0,
    )
    return (min(max(factors[0], 0.5), 2.0), min(max(factors[1], 0.5), 2.0))


def _median_stats(passes: Sequence[UnitStats]) -> UnitStats:
    """One unit's stats: the median time of each kind over the passes (bytes are exact)."""

    def median(field: str) -> float:
        return float(statistics.median(getattr(p, field) for p in passes))

    return replace(
        passes[0],
        forward=median("forward"),
        backward=median("backward"),
        backward_input=median("backward_input"),
        backward_weight=median("backward_weight"),
    )


def _times_by(stats: UnitStats, forward: float, backward: float) -> UnitStats:
    return replace(
        stats,
        forward=stats.forward * forward,
        backward=stats.backward * backward,
        backward_input=stats.backward_input * backward,
        backward_weight=stats.backward_weight * backward,
    )


def _zero_grads(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def scaled(profile: Profile, factor: float, bandwidth_factor: float = 1.0) -> Profile:
    """A profile with every time multiplied by ``factor`` and the link's bandwidth by
    ``bandwidth_factor`` (what-if studies: a faster device, a slower network)."""
    stats = {
        size: tuple(
            replace(
                s,
                forward=s.forward * factor,
                backward=s.backward * factor,
                backward_input=s.backward_input * factor,
                backward_weight=s.backward_weight * factor,
            )
            for s in values
        )
        for size, values in profile.stats.items()
    }
    loss = {size: (f * factor, b * factor) for size, (f, b) in profile.loss.items()}
    link = (
        None
        if profile.link is None
        else replace(profile.link, bandwidth=profile.link.bandwidth * bandwidth_factor)
    )
    return replace(profile, stats=stats, loss=loss, link=link)
