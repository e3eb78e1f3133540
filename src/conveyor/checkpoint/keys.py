"""Compare what the ranks are about to load with what a checkpoint holds: names and shapes,
so a mismatch is a clear error before torch.distributed.checkpoint reads anything."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

# the flattening torch.distributed.checkpoint applies before saving; keys must match its own
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from conveyor.checkpoint.manifest import METADATA, Problem

__all__ = ["check_keys"]

logger = logging.getLogger(__name__)

_SHOWN = 4


def check_keys(state: dict[str, Any], metadata: Metadata,
               group: dist.ProcessGroup | None) -> list[Problem]:
    """Problems every rank agrees on (a collective over ``group``): entries this run needs
    that the checkpoint lacks, model entries no rank of this run takes, and shape or dtype
    differences."""
    values = {key: value.state_dict() if isinstance(value, Stateful) else value
              for key, value in state.items()}
    flat, _ = flatten_state_dict(values)
    saved = metadata.state_dict_metadata
    missing = sorted(key for key in flat if key not in saved)
    differing = []
    for key, value in flat.items():
        entry = saved.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(entry, TensorStorageMetadata)):
            continue
        before = _describe(tuple(entry.size), entry.properties.dtype)
        now = _describe(tuple(value.shape), value.dtype)
        if before != now:
            differing.append(f"{_name(key)} is {before} in the checkpoint but {now} here")
    requested = sorted(key for key in flat if key.startswith("model."))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (missing, differing, requested), group=group)
    all_missing = sorted({key for rank_missing, _, _ in gathered for key in rank_missing})
    all_differing = sorted({text for _, rank_differing, _ in gathered for text in rank_differing})
    taken = {key for _, _, rank_requested in gathered for key in rank_requested}
    unused = sorted(key for key in saved if key.startswith("model.") and key not in taken)
    return _problems(all_missing, all_differing, unused, sorted(saved))


def _problems(missing: list[str], differing: list[str], unused: list[str],
              saved: list[str]) -> list[Problem]:
    problems = []
    model_missing = [k for k in missing if k.startswith("model.")]
    if model_missing:
        held = [_name(k) for k in saved if k.startswith("model.")]
        problems.append(Problem(METADATA, f"parameter-name mismatch: {len(model_missing)} of "
                                f"this model's parameters and buffers are not in the checkpoint, "
                                f"e.g. {_show(model_missing)}; it holds e.g. {held[:_SHOWN]}. It "
                                "was saved from another model, or module names changed"))
    if unused:
        problems.append(Problem(METADATA, f"parameter-name mismatch: the checkpoint holds "
                                f"{len(unused)} parameters or buffers this model lacks, e.g. "
                                f"{_show(unused)}; it was saved from another model"))
    if differing:
        problems.append(Problem(METADATA, "shape mismatch: " + "; ".join(differing[:_SHOWN]) +
                                (f" (and {len(differing) - _SHOWN} more)"
                                 if len(differing) > _SHOWN else "")))
    other = [k for k in missing if not k.startswith("model.")]
    if other and not model_missing:  # else the optimizer misses those parameters' entries too
        problems.append(Problem(METADATA, f"{len(other)} entries this run restores are not in "
                                f"the checkpoint, e.g. {other[:_SHOWN]}: it was saved without "
                                "(or with another kind of) optimizer, scheduler or data loader"))
    return problems


def _name(key: str) -> str:
    return key.removeprefix("model.")


def _show(keys: list[str]) -> str:
    return str([_name(k) for k in keys[:_SHOWN]]) + (" ..." if len(keys) > _SHOWN else "")


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"
