"""Weights in files: each rank reads only its own stages' tensors, and writes them back.

    pipe = Pipeline(meta_model, split_points=[...], weights="gpt2-small/")   # per-stage load
    pipe.save_pretrained("trained/")   # collective: shards by rank + index, from_pretrained reads

A model built on the meta device holds no memory; each rank allocates only the tensors of its
own stages, filling them from safetensors files (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) that are opened lazily, tensor by tensor, so no rank ever
holds the whole model. Tensors the files lack are initialized the way the model's own modules
initialize themselves (a transformers model's ``_init_weights``, else ``reset_parameters``);
what nothing initializes is tracked until it is loaded (conveyor.pipeline.uninitialized).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from conveyor.files import atomic_path, write_atomic
from conveyor.graph import StageGraph
from conveyor.hf.weights import initializer, key_map
from conveyor.pipeline.uninitialized import Unset
from conveyor.split.export import place_on
from conveyor.split.stages import EXPORTED
from conveyor.text import listed

__all__ = [
    "INDEX",
    "Initializer",
    "WeightFiles",
    "materialize",
    "materialize_stages",
    "save_stage_files",
    "unread",
    "write_index",
]

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class WeightFiles:
    """A directory of safetensors weights, read one tensor at a time by model name (through
    the model's key map, conveyor.hf.weights), remembering which file keys were read."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module | None = None,
        tied: Iterable[Sequence[str]] = (),
    ) -> None:
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
        self.keys = key_map(model, weight_map, tied)
        """Which file keys fill which model tensor; See Note [weights as from_pretrained
        reads them]."""
        self.used: set[str] = set()
        """File keys read so far."""
        self._open: dict[str, Any] = {}
        self._safe_open = safe_open

    def get(self, key: str) -> torch.Tensor:
        """The tensor stored under file key ``key`` (read now, from its shard)."""
        shard = self.weight_map[key]
        if shard not in self._open:
            self._open[shard] = self._safe_open(self.directory / shard, framework="pt")
        tensor: torch.Tensor = self._open[shard].get_tensor(key)
        self.used.add(key)
        return tensor

    def tensor(self, name: str) -> torch.Tensor | None:
        """The model tensor ``name`` as ``from_pretrained`` reads it, or None if the files
        have no source for it."""
        return self.keys.read(name, self.get)


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
    unset: Unset | None = None,
) -> nn.Module:
    """``stage`` on ``device``, its tensors read from ``files`` as ``from_pretrained`` reads
    them; tensors on the meta device the files lack are allocated and initialized by
    ``initialize`` on the module of ``owners`` (default: the stage) that owns them, children
    before parents. A tensor shared under several names stays one tensor. Tensors nothing
    initialized are added to ``unset`` (logged; they can still be loaded), or without one
    raise. See Note [meta materialization].

    Raises:
        ValueError: a tensor in the files differs in shape, or (without ``unset``) a tensor is
            neither in the files nor initialized.
    """
    tensors = _named_tensors(stage)
    if files is None and not any(t.is_meta for t in tensors.values()):
        return stage.to(device)
    made: dict[int, torch.Tensor] = {}
    pending: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        loaded = _read(files, name, tensor)
        if loaded is not None:
            made[id(tensor)] = _like(tensor, loaded.to(device))
        elif tensor.is_meta:
            pending[name] = tensor
        else:
            made[id(tensor)] = _like(tensor, tensor.to(device))
    saved = set(stage.state_dict(keep_vars=True))
    lacking = [name for name in pending if name in saved]
    if files is not None and lacking:
        logger.warning(
            "%s are not in %s and were initialized by the model's own initializer, as "
            "from_pretrained initializes what a checkpoint lacks",
            listed(lacking),
            files.directory,
        )
    left = Unset()
    made.update(_initialized(pending, device, owners or stage, initialize, left))
    _report(left, unset)
    for name, tensor in tensors.items():
        _put(stage, name, made[id(tensor)], tensor, name in saved)
    return stage


def _like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` as a Parameter if ``old`` was one, made once per tensor: every name of a tied
    weight must register this one object, or the tie breaks into copies (See Note [meta
    materialization])."""
    if isinstance(old, nn.Parameter) and not isinstance(new, nn.Parameter):
        return nn.Parameter(new, requires_grad=old.requires_grad)
    return new


def _read(files: WeightFiles | None, name: str, old: torch.Tensor) -> torch.Tensor | None:
    """Model tensor ``name`` from ``files`` in ``old``'s dtype, or None if they lack it."""
    tensor = files.tensor(name) if files is not None else None
    if tensor is None:
        return None
    assert files is not None
    if tensor.shape != old.shape:
        source = files.keys.sources[name].keys
        raise ValueError(
            f"{listed(list(source))} in {files.directory} make a tensor of shape "
            f"{tuple(tensor.shape)} for the model's {name!r}, which is {tuple(old.shape)}; "
            "load weights of this model's config"
        )
    return tensor.to(old.dtype)


def _initialized(
    pending: Mapping[str, torch.Tensor],
    device: torch.device,
    owners: nn.Module,
    initialize: Initializer,
    unset: Unset,
) -> dict[int, torch.Tensor]:
    """New tensors for ``pending`` (meta tensors by name), initialized by their modules,
    children first; what stays unset is added to ``unset``."""
    by_owner: dict[str, list[str]] = {}
    for name in pending:
        owner_name, _, leaf = name.rpartition(".")
        by_owner.setdefault(owner_name, []).append(leaf)
    order = {name: i for i, (name, _) in enumerate(owners.named_modules())}
    made: dict[int, torch.Tensor] = {}
    for owner_name in sorted(by_owner, key=lambda n: (-_depth(n), order.get(n, 0))):
        owner = owners.get_submodule(owner_name)
        owner.to_empty(device=device, recurse=False)
        entries = unset.mark(owner_name, owner, by_owner[owner_name])
        with torch.no_grad():
            initialized = initialize(owner_name, owner)
        unset.keep(entries, initialized)
        for leaf in by_owner[owner_name]:
            name = f"{owner_name}.{leaf}" if owner_name else leaf
            made[id(pending[name])] = _get(owner, leaf)
    return made


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


def _report(left: Unset, unset: Unset | None) -> None:
    """Tensors nothing initialized: an error without ``unset``, else logged and kept there."""
    names = left.names()
    if not names:
        return
    if unset is None:
        raise ValueError(left.problem("materializing on the meta device"))
    logger.warning(
        "%s were built on the meta device and nothing initializes them (no weights file "
        "holds them, their modules have no initializer that sets them); load their values "
        "with Pipeline.load_state_dict before the first step, which refuses to run until then",
        listed(names),
    )
    unset.entries += left.entries


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


def unread(files: WeightFiles, held: Iterable[str], read: Iterable[str]) -> list[str]:
    """File keys ``from_pretrained`` reads into a tensor some stage holds (``held``, the names
    of every stage's tensors) that no rank read (``read``, every rank's ``files.used``)."""
    sources = files.keys.sources
    wanted = {key for name in held if name in sources for key in sources[name].keys}
    return sorted(wanted - set(read))


def materialize_stages(
    graph: StageGraph,
    rank: int,
    device: torch.device,
    model: nn.Module | None,
    weights: str | os.PathLike[str] | None,
    tied: list[list[str]],
    unset: Unset,
    group: dist.ProcessGroup | None,
) -> dict[int, nn.Module]:
    """This rank's stages on ``device``: tensors read from ``weights`` as ``from_pretrained``
    reads them, meta tensors the files lack initialized by the model's own modules. With
    ``weights``, the ranks then check together that every file key a stage needs was read
    (collective over ``group``)."""
    files = WeightFiles(weights, model, tied) if weights is not None else None
    stages = {}
    problem = ""
    try:
        for s in graph.stages_on(rank):
            module = graph.stages[s].module
            assert module is not None
            if isinstance(module, fx.GraphModule) and module.meta.get(EXPORTED):
                place_on(module, device)
            stages[s] = materialize(
                module,
                device,
                initialize=initializer(model) if model is not None else initializer(module),
                owners=model,
                files=files,
                unset=unset,
            )
    except ValueError as error:
        if files is None:
            raise
        problem = str(error)  # every rank learns of it below, instead of waiting
    if files is not None:
        _check_read(files, problem, graph, model, rank, group)
    return stages


def _check_read(
    files: WeightFiles,
    problem: str,
    graph: StageGraph,
    model: nn.Module | None,
    rank: int,
    group: dist.ProcessGroup | None,
) -> None:
    """Raise on every rank if a rank failed to load (``problem``), or if a file key that
    ``from_pretrained`` would read into a stage's tensor was read by no rank; warn about keys
    it would leave too. See Note [weights as from_pretrained reads them]."""
    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (problem, sorted(files.used)), group=group)
    failed = [(r, p) for r, (p, _) in enumerate(reports) if p]
    if failed:
        first_rank, first = failed[0]
        raise ValueError(first if first_rank == rank else f"rank {first_rank}: {first}")
    held = {k for st in graph.stages if st.module is not None
            for k in st.module.state_dict(keep_vars=True)}  # fmt: skip
    missed = unread(files, held, [k for _, used in reports for k in used])
    if missed:
        raise ValueError(
            f"weights in {files.directory}: {listed(missed)} fill tensors of this model "
            "(as from_pretrained reads them), but no rank read them; this is a conveyor "
            "bug, please report it with the model's class; build the model on a real "
            "device and load it with from_pretrained meanwhile"
        )
    if rank == 0 and files.keys.ignored:
        logger.warning(
            "weights in %s: %s fill no tensor of %s and were not loaded (from_pretrained "
            "leaves them too)",
            files.directory,
            listed(files.keys.ignored),
            type(model).__name__,
        )
