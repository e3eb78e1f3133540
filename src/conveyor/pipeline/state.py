"""The whole model's state on every rank: state_dict and load_state_dict under the plain
model's names (a module registered twice, under both), and save_pretrained's shards.

    whole = WholeState(model, graph, ties)
    whole.state_dict(stages)                 # this rank's part, keyed like the plain model's
    whole.load(stages, state, strict, rank)  # checked against the whole model's names and shapes
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from conveyor.files import write_atomic
from conveyor.graph import StageGraph
from conveyor.pipeline.weights import save_stage_files, write_index
from conveyor.runtime.sharded import is_dtensor, local
from conveyor.runtime.tied import Tie

__all__ = ["WholeState", "save_pretrained", "whole"]


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole on this rank: a DTensor's shards gathered (collective), else itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def placed_like(value: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as this rank's part of ``current`` when that is a DTensor
    (data or tensor parallelism): each rank slices its own shard, without communication."""
    if not is_dtensor(current) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor  # loaded: current is a DTensor

    return distribute_tensor(
        value.to(current.device), current.device_mesh, current.placements, src_data_rank=None
    )


def _shapes(name: str, given: Any, shape: torch.Size) -> str:
    """``name`` with both shapes if ``given`` is a tensor of another shape than ``shape``."""
    if not isinstance(given, torch.Tensor) or given.shape == shape:
        return ""
    return f"{name} {tuple(given.shape)} (the model's: {tuple(shape)})"


def _whole_state(
    model: nn.Module | StageGraph, graph: StageGraph
) -> tuple[dict[str, list[str]], dict[str, torch.Size]]:
    """(aliases, shapes) of the whole model's state_dict: the shape of each tensor every
    stage holds, under each of its names; and the names no stage holds, by the name a stage
    holds the same tensor by (a module registered twice, ``self.out = self.shared``, is
    traced by one of its names, while the plain state_dict has both)."""
    held = {k: v for st in graph.stages if st.module is not None
            for k, v in st.module.state_dict().items()}  # fmt: skip
    aliases = _aliases(model, set(held))
    shapes = {k: v.shape for k, v in held.items() if isinstance(v, torch.Tensor)}
    for name, others in aliases.items():
        shapes.update(dict.fromkeys(others, shapes[name]) if name in shapes else {})
    return aliases, shapes


def _aliases(model: nn.Module | StageGraph, held: set[str]) -> dict[str, list[str]]:
    """Names of the plain model's tensors not in ``held``, by a held name of the same
    tensor."""
    if not isinstance(model, nn.Module):
        return {}
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    aliases: dict[str, list[str]] = {}
    for names in by_tensor.values():
        kept = [n for n in names if n in held]
        if kept and len(kept) < len(names):
            aliases[kept[0]] = [n for n in names if n not in held]
    return aliases


class WholeState:
    """The whole model's state_dict names and shapes, known on every rank, so that every rank
    checks a state_dict alike; and the names a stage's tensor has that no stage holds."""

    def __init__(self, model: nn.Module | StageGraph, graph: StageGraph, ties: list[Tie]) -> None:
        self.graph = graph
        self.ties = ties
        self.aliases, self.shapes = _whole_state(model, graph)
        """A held tensor's other names that no stage holds; the shape of every tensor of the
        whole model's state_dict, under each of its names."""

    def state_dict(self, stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed like the plain model's state_dict (a
        module registered under two names, under both)."""
        state: dict[str, torch.Tensor] = {}
        for module in stages.values():
            state.update(module.state_dict())
        for name, others in self.aliases.items():
            if name in state:
                state.update(dict.fromkeys(others, state[name]))
        return state

    def load(
        self, stages: dict[int, nn.Module], state: dict[str, torch.Tensor], strict: bool, rank: int
    ) -> None:
        """Load this rank's entries of ``state``; See ``Pipeline.load_state_dict``."""
        self._check(state, strict, rank)
        for s, module in stages.items():
            current = module.state_dict()
            wanted = current.keys()
            missing = [k for k in wanted if k not in state]
            if missing and strict:
                raise KeyError(
                    f"rank {rank} (stage {s}): state lacks {missing[:5]}"
                    f"{' ...' if len(missing) > 5 else ''}; pass a state_dict of the "
                    "same model, or strict=False to keep the current values"
                )
            module.load_state_dict(
                {k: placed_like(state[k], current[k]) for k in wanted if k in state},
                strict=False,
            )

    def _check(self, state: dict[str, torch.Tensor], strict: bool, rank: int) -> None:
        """Entries of the whole model's names and shapes only (strict: every name known)."""
        unexpected = sorted(k for k in state if k not in self.shapes)
        if strict and unexpected:
            raise KeyError(
                f"rank {rank}: state has entries no stage of the model holds: "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; pass a "
                "state_dict of the same model, or strict=False to ignore them"
            )
        wrong = [_shapes(k, v, self.shapes[k]) for k, v in state.items() if k in self.shapes]
        wrong = [w for w in wrong if w]
        if wrong:
            raise ValueError(
                f"rank {rank}: state has entries of other shapes: "
                f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; pass a "
                "state_dict of a model of the same sizes"
            )

    def own_tensors(self, state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """``state`` (this rank's) without the names of tied weights another rank writes, or
        that are another name of a tensor this rank writes."""
        own: dict[str, torch.Tensor] = {}
        written: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in state.items():
            where = (local(tensor).data_ptr(), tuple(tensor.shape))
            if where not in written:  # one tensor under two names in one stage: once
                written.add(where)
                own[name] = tensor
        for tie in self.ties:
            for _, name in tie.users[1:]:
                own.pop(name, None)
            if self.graph.rank_of(tie.users[0][0]) != rank:
                own.pop(tie.name, None)
        return own


def save_pretrained(
    directory: Path,
    tensors: dict[str, torch.Tensor],
    model_config: Any,
    group: dist.ProcessGroup | None,
    writes: bool,
    on_mesh: bool,
) -> Path:
    """Write each rank's ``tensors`` (already gathered whole) as one safetensors shard, and
    rank 0 the index and the model's config: what ``from_pretrained(directory)`` reads. Only
    ranks that ``writes`` (one pipeline of a mesh) write; every rank of the job waits."""
    directory.mkdir(parents=True, exist_ok=True)
    if writes:
        rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
        shard = save_stage_files(tensors, directory, rank, num_ranks)
        shards: list[Any] = [None] * num_ranks
        dist.all_gather_object(shards, shard, group=group)
        if rank == 0:
            if model_config is not None and hasattr(model_config, "to_json_string"):
                write_atomic(directory / "config.json", model_config.to_json_string())
            write_index(directory, shards)
    dist.barrier(group=None if on_mesh else group)
    return directory
