"""What a checkpoint holds, as Stateful views of one rank: model, optimizer, random state,
progress, and the layout (split, placement, schedule) it was saved with."""

from __future__ import annotations

import hashlib
import pickle
import random
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from conveyor.pipeline import Pipeline

__all__ = [
    "LAYOUT_DEFAULTS",
    "LAYOUT_FIELDS",
    "NUMERICS_FIELDS",
    "ModelState",
    "OptimizerState",
    "Progress",
    "RandomState",
    "describe_layout",
    "rank_module",
]


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state keyed by parameter name, one entry per parameter and hyperparameter
(``state.<name>.exp_avg``, ``param_groups.<name>.lr``), so it reshards like the model."""

LAYOUT_FIELDS = ("split_points", "placement", "num_stages", "num_ranks", "tp", "fsdp")
"""How the model is cut, placed and sharded. Changing them moves parameters between ranks
but computes the same thing: each stage still runs its micro-batches in the schedule's order."""
NUMERICS_FIELDS = ("schedule", "num_microbatches", "loss_reduction", "seed", "dp")
"""Changing these changes the arithmetic: summation order of micro-batch gradients and losses
(schedule, micro-batches, data-parallel replicas, whose gradients are summed by an
all-reduce), the loss's scale, or the dropout streams (seed)."""
LAYOUT_DEFAULTS = {"dp": 1, "tp": 1, "fsdp": False}
"""What a manifest written before data parallelism means by a field it lacks."""


def describe_layout(pipe: Pipeline) -> dict[str, Any]:
    """The split, placement and schedule of ``pipe``, as plain data for the manifest."""
    return {
        "split_points": list(pipe.split_points),
        "placement": [stage.rank for stage in pipe.graph.stages],
        "num_stages": pipe.graph.num_stages,
        "num_ranks": pipe.num_ranks,
        "dp": pipe.num_replicas,
        "tp": 1 if pipe.mesh is None else pipe.mesh.shape.tp,
        "fsdp": pipe.config.fsdp and pipe.num_replicas > 1,
        "schedule": str(pipe.config.schedule),
        "num_microbatches": pipe.config.num_microbatches,
        "loss_reduction": pipe.config.loss_reduction,
        "seed": pipe.config.seed,
        "program_sha256": hashlib.sha256(str(pipe.program).encode()).hexdigest(),
        "config": pipe.config.to_dict(),
    }


def rank_module(pipe: Pipeline) -> nn.Module:
    """One module holding every parameter of this rank's stages under its original name.

    ``torch.distributed.checkpoint.state_dict`` maps optimizer state to names through a
    module; a rank with several stages (virtual stages) has several, so they are merged.
    """
    root = nn.Module()
    for module in pipe.stages.values():
        for name, parameter in module.named_parameters(remove_duplicate=False):
            *path, leaf = name.split(".")
            owner = root
            for part in path:
                if part not in dict(owner.named_children()):
                    owner.add_module(part, nn.Module())
                owner = owner.get_submodule(part)
            if leaf not in dict(owner.named_parameters(recurse=False)):
                owner.register_parameter(leaf, parameter)
    return root


class ModelState:
    """This rank's parameters and buffers under the model's original names."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe

    def state_dict(self) -> dict[str, Any]:
        return dict(self.pipe.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pipe.load_state_dict(state)


class OptimizerState:
    """The optimizer's state and hyperparameters keyed by parameter name.

    Uses ``torch.distributed.checkpoint.state_dict`` (flattened, so it reshards). That helper
    initializes an untouched optimizer by taking a zero-learning-rate step, which would start
    Adam's step count early; so an optimizer that has not stepped is saved as its
    hyperparameters alone, and restored that way. ``load_with_state`` says which kind the
    checkpoint holds when building the template to load into.
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module = module
        self.optimizer = optimizer
        self.load_with_state: bool | None = None
        self.saved: set[str] | None = None
        """When loading: the ``state.`` entries the checkpoint holds. A parameter that never
        had a gradient (an auxiliary head) has no optimizer state, so none was saved."""

    def state_dict(self) -> dict[str, Any]:
        saving = self.load_with_state is None
        with_state = bool(self.optimizer.state) if saving else self.load_with_state
        if with_state:
            state = dict(get_optimizer_state_dict(self.module, self.optimizer, options=_FLAT))
        else:
            state = self._hyperparameters()
        if saving:
            return self._with_aliases(state)
        saved = self.saved
        return {k: v for k, v in state.items() if saved is None or _kept(k, saved)}

    def _with_aliases(self, state: dict[str, Any]) -> dict[str, Any]:
        """Entries of a parameter known by several names (weights tied within this rank)
        under every name, as the model's state_dict has them: a split that puts the users on
        different ranks then finds each one's entries."""
        names: dict[int, list[str]] = {}
        for name, parameter in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(name)
        aliases = {first: rest for first, *rest in names.values() if rest}
        for key, value in list(state.items()):
            section, _, rest = key.partition(".")
            for first, others in aliases.items():
                if rest.startswith(first + "."):
                    for other in others:
                        state[f"{section}.{other}{rest[len(first) :]}"] = value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if any(key.startswith("state.") for key in state):
            # torch's helper wants every parameter's entries: those the checkpoint lacks come
            # from the template (built by a zero step), then are dropped, as never saved
            full = dict(get_optimizer_state_dict(self.module, self.optimizer, options=_FLAT))
            set_optimizer_state_dict(self.module, self.optimizer, {**full, **state}, options=_FLAT)
            for name, parameter in self.module.named_parameters():
                if not any(key.startswith(f"state.{name}.") for key in state):
                    self.optimizer.state.pop(parameter, None)
            return
        names = {id(p): name for name, p in self.module.named_parameters()}
        for group in self.optimizer.param_groups:
            first = names[id(group["params"][0])]
            for key in group:
                if key != "params":
                    group[key] = state[f"param_groups.{first}.{key}"]

    def _hyperparameters(self) -> dict[str, Any]:
        """``param_groups.<name>.<key>`` entries, as the flattened helper writes them."""
        names = {id(p): name for name, p in self.module.named_parameters()}
        return {
            f"param_groups.{names[id(p)]}.{key}": value
            for group in self.optimizer.param_groups
            for p in group["params"]
            for key, value in group.items()
            if key != "params"
        }


def _kept(key: str, saved: set[str]) -> bool:
    """Whether a template entry is loaded: hyperparameters always, state if it was saved."""
    return not key.startswith("state.") or key in saved


class RandomState:
    """Every generator of this process: torch CPU (and CUDA), Python ``random``, and numpy's
    global one when numpy is loaded. Saved per rank under ``rank<N>``; ``source_rank`` picks
    which rank's entry to restore (another one after a change in the number of ranks)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.source_rank = rank
        self.keys: set[str] | None = None
        """When loading: the entries the checkpoint holds for ``source_rank``."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            state["numpy"] = numpy.random.get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            state["cuda"] = torch.cuda.get_rng_state_all()
        if self.keys is not None:
            state = {k: v for k, v in state.items() if k in self.keys}
        return {f"rank{self.source_rank}": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state[f"rank{self.source_rank}"]
        torch.set_rng_state(saved["torch"])
        random.setstate(saved["python"])
        if "numpy" in saved and "numpy" in sys.modules:
            sys.modules["numpy"].random.set_state(saved["numpy"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])


class Progress:
    """The step count and ``Pipeline.step_index``, which seeds every micro-batch's dropout."""

    def __init__(self, pipe: Pipeline) -> None:
        self.pipe = pipe
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "step_index": self.pipe.step_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.pipe.step_index = int(state["step_index"])


def digest(value: Any) -> str:
    """A short fingerprint of picklable ``value``, to compare small states across ranks."""
    return hashlib.sha256(pickle.dumps(value)).hexdigest()[:16]
