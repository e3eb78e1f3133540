"""Pipeline: the user's entry point; splits the model, keeps this rank's stages, runs steps."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor import microbatch
from conveyor.comm import Meta, P2P
from conveyor.config import PipelineConfig
from conveyor.runtime import LossFn, Runtime, StepInputs
from conveyor.schedule import Program, Schedule, build_program, forward_only
from conveyor.simulate import execute
from conveyor.split import balance_to_split_points, bind_inputs, even_balance, split_model

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline:
    """A model cut into stages over the ranks of a process group; each rank runs its own.

        pipe = conveyor.Pipeline(model, balance=[3, 5], num_microbatches=8, loss_fn=loss_fn)
        loss = pipe.step(inputs, targets)   # on every rank; the loss on the last stage's rank
        optimizer.step()                    # over pipe.parameters(): this rank's stages only

    Every rank calls ``step`` with the same batch (as data-parallel scripts do): each rank
    takes the model inputs its stages use from its own copy, and all ranks agree on shapes.
    A model built on the meta device is materialized stage by stage, so no rank ever holds
    more than its own stages.
    """

    def __init__(self, model: nn.Module, config: PipelineConfig | None = None, *,
                 loss_fn: LossFn | None = None, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | None = None, schedule: str | Schedule | None = None,
                 concrete_args: dict[str, Any] | None = None, **options: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; launch with `conveyor run "
                               "-n N script.py` (or torchrun) and call "
                               "torch.distributed.init_process_group() before Pipeline(...)")
        if isinstance(schedule, str):
            options["schedule"] = schedule
        config = dataclasses.replace(config or PipelineConfig(), **options)
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = torch.device(device) if device is not None else _default_device(group)
        self.loss_fn = loss_fn
        self._model = model
        self.split_points = _split_points(model, config, self.num_ranks)
        self.graph = split_model(model, self.split_points, config.placement, concrete_args)
        if self.graph.num_ranks != self.num_ranks:
            raise ValueError(f"the split places stages on {self.graph.num_ranks} ranks but the "
                             f"process group has {self.num_ranks}; launch with "
                             f"`conveyor run -n {self.graph.num_ranks}` or change the split")
        self.topology = self.graph.topology()
        self.program = build_program(schedule if callable(schedule) else config.schedule,
                                     self.topology, config.num_microbatches)
        self._inference = build_program(forward_only, self.topology, config.num_microbatches)
        self.stages = {s: _materialize(self.graph.stages[s].module, self.device)
                       for s in self.graph.stages_on(self.rank)}
        self._check_untied()
        p2p = P2P(group, self.device, timedelta(seconds=config.timeout_s))
        self._runtime = Runtime(self.graph, self.rank, p2p, self.device, loss_fn,
                                config.checkpoint, config.seed)
        self.step_index = 0
        if self.rank == 0:
            logger.info("%s", self.describe())

    # -- running ---------------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad``.

        Returns the batch's loss (detached) on the rank that holds the last stage, None on the
        others. Call the optimizer and ``zero_grad`` as in plain training.
        """
        state = self._runtime.run(self.program[self.rank], self._inputs(inputs, targets, True))
        self.step_index += 1
        if not state.losses:
            return None
        return torch.stack([state.losses[k] for k in sorted(state.losses)]).sum().detach()

    def forward(self, inputs: Any) -> Any:
        """Inference: the model's output for ``inputs`` on the last stage's rank, else None."""
        with torch.no_grad():
            state = self._runtime.run(self._inference[self.rank],
                                      self._inputs(inputs, None, False))
        if not state.model_outputs:
            return None
        return microbatch.merge([state.model_outputs[k] for k in sorted(state.model_outputs)])

    __call__ = forward

    def _inputs(self, inputs: Any, targets: Any, is_training: bool) -> StepInputs:
        m = self.config.num_microbatches
        bound = bind_inputs(self._model, inputs)
        size = microbatch.batch_size(bound)
        chunks = microbatch.split(bound, m, size)
        if size is None:
            weights = [1.0] * m
        else:
            counts = [microbatch.batch_size(c) or 0 for c in chunks]
            weights = ([c / size for c in counts] if self.config.loss_reduction == "mean"
                       else [1.0] * m)
        split_targets = None if targets is None else microbatch.split(targets, m, size)
        return StepInputs(chunks, [_signature(c) for c in chunks], split_targets, weights,
                          self.step_index, is_training)

    # -- the local part of the model ------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, for its optimizer."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's original qualified names."""
        seen: set[nn.Parameter] = set()
        for module in self.stages.values():
            for name, p in module.named_parameters():
                if p not in seen:
                    seen.add(p)
                    yield name, p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed like the plain model's state_dict."""
        state: dict[str, torch.Tensor] = {}
        for module in self.stages.values():
            state.update(module.state_dict())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's entries of ``state`` (a full model state_dict works).

        Raises:
            KeyError: with ``strict``, an entry this rank needs is missing from ``state``.
        """
        for s, module in self.stages.items():
            wanted = module.state_dict().keys()
            missing = [k for k in wanted if k not in state]
            if missing and strict:
                raise KeyError(f"rank {self.rank} (stage {s}): state lacks {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}; pass a state_dict of the "
                               "same model, or strict=False to keep the current values")
            module.load_state_dict({k: state[k] for k in wanted if k in state}, strict=False)

    def train(self, mode: bool = True) -> Pipeline:
        for module in self.stages.values():
            module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def describe(self) -> str:
        """One line: the plan, as logged at start-up."""
        estimate = execute(self.program, self.topology)
        return (f"schedule={self.config.schedule} stages={self.graph.num_stages} "
                f"ranks={self.num_ranks} microbatches={self.config.num_microbatches} "
                f"split before {list(self.split_points)} checkpoint={self.config.checkpoint} "
                f"est. bubble={estimate.bubble_fraction:.0%}")

    def program_text(self) -> str:
        return str(self.program)

    def _check_untied(self) -> None:
        owners: dict[str, list[int]] = {}
        for stage in self.graph.stages:
            if stage.module is not None:
                for name, _ in stage.module.named_parameters():
                    owners.setdefault(name, []).append(stage.index)
        shared = {n: s for n, s in owners.items() if len({self.graph.rank_of(i) for i in s}) > 1}
        if shared:
            raise ValueError(f"parameters {sorted(shared)[:4]} are used by stages on different "
                             "ranks (tied weights); tie them explicitly or keep their users on "
                             "one rank")


def _split_points(model: nn.Module, config: PipelineConfig, num_ranks: int) -> tuple[str, ...]:
    """Where to cut: the configured split points, or the layers that start each stage of an
    nn.Sequential split by balance (even by default)."""
    split_points = config.split_points
    if split_points is None:
        if isinstance(model, nn.Sequential):
            balance = config.balance or even_balance(len(model), config.num_stages or num_ranks)
            split_points = tuple(balance_to_split_points(model, balance))
        elif config.balance is not None:
            raise TypeError(f"balance splits an nn.Sequential, but the model is a "
                            f"{type(model).__name__}; pass split_points=[...] (qualified names "
                            "of the submodules that start each stage) instead")
        elif num_ranks > 1:
            raise ValueError(f"cannot split a {type(model).__name__} over {num_ranks} ranks "
                             "without split points; pass split_points=[...] naming the "
                             "submodules that start stages 1.., e.g. ['layers.4']")
        else:
            split_points = ()
    return tuple(split_points)


def _materialize(module: nn.Module | None, device: torch.device) -> nn.Module:
    """Move a stage to ``device``; a stage on the meta device is allocated and initialized
    there with each submodule's ``reset_parameters`` (load a state_dict for other values)."""
    assert module is not None
    tensors = list(module.parameters()) + list(module.buffers())
    if not any(t.is_meta for t in tensors):
        return module.to(device)
    module.to_empty(device=device)
    uninitialized = []
    for name, sub in module.named_modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        elif any(True for _ in sub.parameters(recurse=False)):
            uninitialized.append(name)
    if uninitialized:
        logger.warning("modules %s have no reset_parameters(); their parameters are "
                       "uninitialized until you call Pipeline.load_state_dict", uninitialized)
    return module


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    """CPU for gloo; otherwise this process's current accelerator (one GPU per rank)."""
    if dist.get_backend(group) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _signature(chunk: dict[str, Any]) -> str:
    """Shapes, dtypes and constants of a micro-batch: the key for exchanged shapes."""
    meta = Meta.of(chunk)
    return repr((meta.spec, [(leaf.shape, leaf.dtype, leaf.constant) for leaf in meta.leaves]))
