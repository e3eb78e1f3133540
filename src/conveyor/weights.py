"""Weights in files: each rank reads only its own stages' tensors, and writes them back.

    pipe = Pipeline(meta_model, split_points=[...], weights="gpt2-small/")   # per-stage load
    pipe.save_pretrained("trained/")   # collective: shards by rank + index, from_pretrained reads

A model built on the meta device holds no memory; each rank allocates only the tensors of its
own stages, filling them from safetensors files (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) that are opened lazily, tensor by tensor, so no rank ever
holds the whole model. Tensors the files lack are initialized the way the model's own modules
initialize themselves (a transformers model's ``_init_weights``, else ``reset_parameters``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from conveyor.files import atomic_path, write_atomic

__all__ = ["INDEX", "Initializer", "WeightFiles", "materialize", "save_stage_files", "write_index"]

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightFiles:
    """A directory of safetensors weights, read one tensor at a time."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.directory / SINGLE).is_file():
            with safe_open(self.directory / SINGLE, framework="pt") as file:
                weight_map = dict.fromkeys(file.keys(), SINGLE)
        else:
            raise FileNotFoundError(
                f"no weights in {str(self.directory)!r}: expected {SINGLE} or {INDEX} (a "
                "directory written by save_pretrained)"
            )
        self.weight_map = weight_map
        self._open: dict[str, Any] = {}
        self._safe_open = safe_open

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor stored under ``name`` (read now, from its shard), or None."""
        shard = self.weight_map.get(name)
        if shard is None:
            return None
        if shard not in self._open:
            self._open[shard] = self._safe_open(self.directory / shard, framework="pt")
        tensor: torch.Tensor = self._open[shard].get_tensor(name)
        return tensor


Initializer = Callable[[str, nn.Module], bool]
"""Initializes the tensors a module owns directly, given its qualified name; False if it
cannot."""


def materialize(
    stage: nn.Module,
    device: torch.device,
    *,
    initialize: Initializer,
    owners: nn.Module | None = None,
    files: WeightFiles | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> nn.Module:
    """``stage`` on ``device``: tensors on the meta device are allocated there, read from
    ``files`` (under their own name or a tied ``aliases`` name) or else initialized by
    ``initialize`` on the module of ``owners`` (default: the stage) that owns them. A tensor
    shared under several names stays one tensor.

    Raises:
        ValueError: a tensor is neither in the files nor initializable, or differs in shape.
    """
    tensors = _named_tensors(stage)
    if not any(t.is_meta for t in tensors.values()):
        return stage.to(device)
    made: dict[int, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if not tensor.is_meta:
            made[id(tensor)] = tensor.to(device)
            continue
        loaded = _read(files, name, tensor, aliases or {})
        if loaded is None:
            pending[name] = tensor
        else:
            made[id(tensor)] = loaded.to(device)
    made.update(_initialized(pending, device, owners or stage, initialize))
    saved = set(stage.state_dict(keep_vars=True))
    for name, tensor in tensors.items():
        _put(stage, name, made[id(tensor)], tensor, name in saved)
    return stage


def _read(
    files: WeightFiles | None,
    name: str,
    meta: torch.Tensor,
    aliases: Mapping[str, Sequence[str]],
) -> torch.Tensor | None:
    if files is None:
        return None
    for candidate in (name, *aliases.get(name, ())):
        tensor = files.get(candidate)
        if tensor is None:
            continue
        if tensor.shape != meta.shape:
            raise ValueError(
                f"{candidate!r} in {files.directory} has shape {tuple(tensor.shape)}, but the "
                f"model's {name!r} is {tuple(meta.shape)}; load weights of this model's config"
            )
        return tensor.to(meta.dtype)
    return None


def _initialized(
    pending: Mapping[str, torch.Tensor],
    device: torch.device,
    owners: nn.Module,
    initialize: Initializer,
) -> dict[int, torch.Tensor]:
    """New tensors for ``pending`` (meta tensors by name), initialized by their modules."""
    made: dict[int, torch.Tensor] = {}
    failed = []
    for owner_name in sorted({name.rpartition(".")[0] for name in pending}):
        owner = owners.get_submodule(owner_name)
        owner.to_empty(device=device, recurse=False)
        with torch.no_grad():
            if not initialize(owner_name, owner):
                failed.append(owner_name or "<root>")
                continue
        for name, tensor in pending.items():
            if name.rpartition(".")[0] == owner_name:
                made[id(tensor)] = _get(owner, name.rpartition(".")[2])
    if failed:
        raise ValueError(
            f"modules {failed} hold tensors on the meta device that no weights file provides "
            "and that they cannot initialize (no reset_parameters); pass weights=DIR with "
            "their values, or build the model with real tensors"
        )
    return made


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _get(module: nn.Module, leaf: str) -> torch.Tensor:
    value = getattr(module, leaf)
    assert isinstance(value, torch.Tensor)
    return value


def _put(
    module: nn.Module, name: str, tensor: torch.Tensor, old: torch.Tensor, saved: bool
) -> None:
    """Register ``tensor`` at ``name`` in ``module`` as ``old`` was registered there."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if isinstance(old, nn.Parameter):
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=old.requires_grad)
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor, persistent=saved)


def save_stage_files(
    state: Mapping[str, torch.Tensor], directory: Path, index: int, count: int
) -> tuple[str, dict[str, int]]:
    """Write one rank's tensors as shard ``index`` of ``count``; returns the shard's file name
    and each tensor's size in bytes."""
    from safetensors.torch import save_file

    name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
    # safetensors refuses tensors that share memory: each gets its own contiguous copy
    tensors = {key: value.detach().to("cpu").contiguous().clone() for key, value in state.items()}
    with atomic_path(directory / name) as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    return name, {key: t.numel() * t.element_size() for key, t in tensors.items()}


def write_index(directory: Path, shards: Sequence[tuple[str, Mapping[str, int]]]) -> Path:
    """The index of every shard's tensors, as transformers' ``from_pretrained`` reads it."""
    weight_map = {key: shard for shard, sizes in shards for key in sizes}
    total = sum(size for _, sizes in shards for size in sizes.values())
    data = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return write_atomic(directory / INDEX, json.dumps(data, indent=2) + "\n")
