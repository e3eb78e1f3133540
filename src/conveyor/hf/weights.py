"""Which tensor of a weights directory fills which tensor of a model, as ``from_pretrained``
reads it: the model's own names, its tied names, and transformers' key renames and conversions.

    keys = key_map(meta_model, files.weight_map)
    tensor = keys.read("lm_head.weight", files)   # GPT-NeoX: read from 'embed_out.weight'

Checkpoints do not always name tensors as the module does: GPT-NeoX files call the head
``embed_out`` (the module is ``lm_head``), Mixtral files hold one tensor per expert (the module
one fused ``gate_up_proj``), and T5 and BART store their shared embedding once, as
``shared.weight``, for every name that uses it. For a transformers model the map is built by
transformers' own loading code (its conversion mapping, base-model prefix rule and tied-weight
declarations), so every tensor comes from the file key ``from_pretrained`` takes it from.
See Note [weights as from_pretrained reads them].
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from conveyor.hf.loss import is_transformers_model
from conveyor.split.vocab import ChunkedHeadLoss

__all__ = ["KeyMap", "Source", "initializer", "key_map"]

logger = logging.getLogger(__name__)


# Note [weights as from_pretrained reads them]:
# ``Pipeline(..., weights=DIR)`` fills each rank's stages from the files without any rank
# building the whole model, so it cannot call ``from_pretrained``; it must read what that
# reads. A model tensor's *source* is the file keys it is read from and, for a conversion
# (experts merged, a fused projection split), the transformers operation that makes it. Keys
# are renamed by transformers' own ``rename_source_key`` over the model's conversion mapping;
# a tensor the files lack takes the source of a tensor it is tied to (the same Parameter under
# two names in the model, or a ``_tied_weights_keys`` declaration, either way round, as
# ``tie_weights`` does when loading). File keys ``from_pretrained`` would not load either are
# named in a warning, as it does; a file key it would load that no rank read, or a tensor it
# would load that a rank initialized instead, is an error (conveyor.pipeline checks both
# across ranks), so no weight is ever silently left random.
@dataclass
class Source:
    """Where one model tensor comes from: file keys, and the conversion that joins them."""

    keys: tuple[str, ...]
    """The file keys read."""
    convert: Callable[[Callable[[str], torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """Makes every tensor of the conversion, by model name, from a reader of file keys; None
    for a tensor read as it is stored."""


@dataclass
class KeyMap:
    """The sources of a model's tensors in one weights directory."""

    sources: dict[str, Source] = field(default_factory=dict)
    """By model name: every name of the model's state a file key fills."""
    ignored: list[str] = field(default_factory=list)
    """File keys that fill no tensor of the model (``from_pretrained`` leaves them too)."""
    _made: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)

    def read(self, name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """The tensor for model name ``name``, read with ``get`` (file key -> tensor); None
        when the files have no source for it."""
        source = self.sources.get(name)
        if source is None:
            return None
        if source.convert is None:
            return get(source.keys[0])
        made = self._made.get(id(source))
        if made is None:  # one conversion makes several tensors: keep them for the others
            made = self._made[id(source)] = source.convert(get)
        return made[name]


def key_map(
    model: nn.Module | None, file_keys: Iterable[str], tied: Iterable[Sequence[str]] = ()
) -> KeyMap:
    """The source of each of ``model``'s tensors among ``file_keys`` (a transformers model's
    as ``from_pretrained`` maps them), a name of ``tied`` taking the source of another; without
    a model, each key fills the tensor of its name. See Note [weights as from_pretrained reads
    them]."""
    keys = sorted(file_keys)
    groups = [list(names) for names in tied]
    if model is None:
        found = KeyMap({k: Source((k,)) for k in keys})
    else:
        state = set(model.state_dict(keep_vars=True))
        if is_transformers_model(model):
            found = _transformers_sources(model, keys, state)
        else:
            found = KeyMap({k: Source((k,)) for k in keys if k in state})
            found.ignored = [k for k in keys if k not in state]
        groups += _tied_groups(model, state)
        _add_chunked_heads(model, found)
    _add_tied(found.sources, groups)
    return found


def _add_chunked_heads(model: nn.Module, found: KeyMap) -> None:
    """A head cut along the vocabulary (conveyor.split.vocab) reads each chunk's rows of the
    projection it was cut from, which the files hold whole."""
    for name, head in model.named_modules():
        if not isinstance(head, ChunkedHeadLoss) or head.source is None:
            continue
        for kind in ("weight", "bias"):
            key = f"{head.source}.{kind}"
            if key not in found.ignored:
                continue
            rows = {f"{name}.chunks.{i}.{kind}": span for i, span in enumerate(head.rows())}

            def cut(get: Callable[[str], torch.Tensor], key: str = key, rows: Any = rows) -> Any:
                whole = get(key)
                return {target: whole[a:b].clone() for target, (a, b) in rows.items()}

            source = Source((key,), cut)
            found.sources.update(dict.fromkeys(rows, source))
            found.ignored.remove(key)


def _tied_groups(model: nn.Module, state: set[str]) -> list[list[str]]:
    """Names that hold one tensor: the same object under several names, and transformers'
    tied-weight declarations (``target: source``)."""
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    groups = [names for names in by_tensor.values() if len(names) > 1]
    declared: Mapping[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    groups += [[t, s] for t, s in declared.items() if t in state and s in state]
    return groups


def _add_tied(sources: dict[str, Source], groups: list[list[str]]) -> None:
    """Give each name of a tied group without a source the source of a name that has one."""
    for names in groups:
        found = next((sources[n] for n in names if n in sources), None)
        if found is not None:
            for name in names:
                sources.setdefault(name, found)


def _transformers_sources(model: nn.Module, keys: list[str], state: set[str]) -> KeyMap:
    """Sources by transformers' own renaming and conversion rules (``from_pretrained``)."""
    loading = _transformers_loading()
    mapping = loading.get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, loading.WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, loading.WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta_state = dict.fromkeys(state, True)
    prefix = getattr(model, "base_model_prefix", None)
    found = KeyMap()
    groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    for key in sorted(keys, key=loading.dot_natural_key):
        renamed, pattern = loading.rename_source_key(key, renamings, converters, prefix, meta_state)
        if renamed not in state and key in state:  # as from_pretrained: keep the stored name
            renamed, pattern = loading.rename_source_key(key, [], [], prefix, meta_state)
        if renamed not in state:
            found.ignored.append(key)
        elif pattern is None:
            found.sources[renamed] = Source((key,))
        else:
            converter = by_pattern[pattern]
            groups.setdefault(renamed, (converter, []))[1].append((key, pattern))
    for first, (converter, parts) in groups.items():
        source = Source(tuple(k for k, _ in parts), _conversion(model, first, converter, parts))
        for target in converter.target_patterns:
            found.sources[first.replace(converter.target_patterns[0], target)] = source
    return found


def _conversion(
    model: nn.Module, first: str, converter: Any, parts: list[tuple[str, str]]
) -> Callable[[Callable[[str], torch.Tensor]], dict[str, torch.Tensor]]:
    """Run transformers' conversion ``converter`` (a fresh copy, as from_pretrained makes one
    per target) on the file keys ``parts`` (key, source pattern): the tensors it makes."""

    def convert(get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        fresh = copy.deepcopy(converter)
        for key, pattern in parts:
            fresh.add_tensor(first, key, pattern, lambda key=key: get(key))
        made = fresh.convert(first, model=model, config=getattr(model, "config", None))
        return {name: v[0] if isinstance(v, list) else v for name, v in made.items()}

    return convert


def _transformers_loading() -> Any:
    """transformers' loading code, checked for what conveyor calls."""
    try:
        from transformers import conversion_mapping, core_model_loading
    except ImportError as error:  # a transformers model without its loading code
        raise ImportError(
            "weights= for a transformers model reads keys as its from_pretrained does, with "
            f"transformers' conversion mapping, which this transformers does not have ({error}); "
            "install transformers>=5"
        ) from error

    return SimpleNamespace(
        get_model_conversion_mapping=conversion_mapping.get_model_conversion_mapping,
        rename_source_key=core_model_loading.rename_source_key,
        dot_natural_key=core_model_loading.dot_natural_key,
        WeightRenaming=core_model_loading.WeightRenaming,
        WeightConverter=core_model_loading.WeightConverter,
    )


def initializer(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """How ``model``'s modules initialize the tensors they own (conveyor.pipeline.weights):
    transformers' ``_init_weights`` of the nearest ``PreTrainedModel`` around a module (weights,
    norms, rotary tables, position ids), else the module's ``reset_parameters`` (or
    ``_reset_parameters``, as nn.MultiheadAttention names it)."""

    def initialize(name: str, module: nn.Module) -> bool:
        path = name
        while True:
            around = model.get_submodule(path)
            init_weights = getattr(around, "_init_weights", None)
            if is_transformers_model(around) and callable(init_weights):
                init_weights(module)
                return True
            if not path:
                break
            path = path.rpartition(".")[0]
        reset = getattr(module, "reset_parameters", None) or getattr(
            module, "_reset_parameters", None
        )
        if callable(reset):
            reset()
            return True
        return False

    return initialize
