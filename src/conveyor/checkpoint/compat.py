"""Does a checkpoint fit this run: its configuration (split, schedule, micro-batches) and its
entries' names and shapes, checked before torch.distributed.checkpoint reads anything."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# the flattening torch.distributed.checkpoint applies before saving; keys must match its own
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from conveyor.checkpoint.manifest import MANIFEST, METADATA, CheckpointError, Manifest, Problem
from conveyor.checkpoint.state import LAYOUT_DEFAULTS, LAYOUT_FIELDS, NUMERICS_FIELDS
from conveyor.torch_compat import flatten_state_dict

__all__ = ["check_keys", "check_layout"]

logger = logging.getLogger(__name__)

_SHOWN = 4


def check_layout(
    path: Path,
    manifest: Manifest,
    now: dict[str, Any],
    allow_reshard: bool,
    allow_numerics_change: bool,
    log: bool = True,
) -> None:
    """Raise CheckpointError unless the layout ``now`` may load the checkpoint at ``path``:
    a change of split or placement needs ``allow_reshard``, a change of the arithmetic
    (schedule, micro-batches, data-parallel replicas, loss reduction, seed)
    ``allow_numerics_change``."""
    saved = {**LAYOUT_DEFAULTS, **manifest.layout}
    layout = [
        f"{f} {saved.get(f)!r} -> {now[f]!r}" for f in LAYOUT_FIELDS if saved.get(f) != now[f]
    ]
    numerics = [
        f"{f} {saved.get(f)!r} -> {now[f]!r}" for f in NUMERICS_FIELDS if saved.get(f) != now[f]
    ]
    if not layout and not numerics and saved.get("program_sha256") != now["program_sha256"]:
        numerics.append("the schedule's program (same name, other actions)")
    if layout and not allow_reshard:
        raise CheckpointError(
            path,
            MANIFEST,
            "configuration mismatch: this run splits or "
            f"places the model differently ({'; '.join(layout)}); pass "
            "allow_reshard=True to load it into this split (parameters, "
            "optimizer state and progress load bitwise)",
        )
    if numerics and not allow_numerics_change:
        raise CheckpointError(
            path,
            MANIFEST,
            "configuration mismatch: "
            f"{'; '.join(numerics)}; this changes the arithmetic (order of "
            "sums, loss scale or dropout streams), so later losses differ "
            "from the saved run's. Pass allow_numerics_change=True to load "
            "it anyway (the state itself loads bitwise)",
        )
    if (layout or numerics) and log:
        logger.info("loading %s into another configuration: %s", path, "; ".join(layout + numerics))


def check_keys(
    state: dict[str, Any], metadata: Metadata, group: dist.ProcessGroup | None
) -> list[Problem]:
    """Problems every rank agrees on (a collective over ``group``): entries this run needs
    that the checkpoint lacks, model entries no rank of this run takes, and shape or dtype
    differences."""
    values = {
        key: value.state_dict() if isinstance(value, Stateful) else value
        for key, value in state.items()
    }
    flat = flatten_state_dict(values)
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


def _problems(
    missing: list[str], differing: list[str], unused: list[str], saved: list[str]
) -> list[Problem]:
    problems = []
    model_missing = [k for k in missing if k.startswith("model.")]
    if model_missing:
        held = [_name(k) for k in saved if k.startswith("model.")]
        problems.append(
            Problem(
                METADATA,
                f"parameter-name mismatch: {len(model_missing)} of "
                f"this model's parameters and buffers are not in the checkpoint, "
                f"e.g. {_show(model_missing)}; it holds e.g. {held[:_SHOWN]}. It "
                "was saved from another model, or module names changed",
            )
        )
    if unused:
        problems.append(
            Problem(
                METADATA,
                f"parameter-name mismatch: the checkpoint holds "
                f"{len(unused)} parameters or buffers this model lacks, e.g. "
                f"{_show(unused)}; it was saved from another model",
            )
        )
    if differing:
        problems.append(
            Problem(
                METADATA,
                "shape mismatch: "
                + "; ".join(differing[:_SHOWN])
                + (f" (and {len(differing) - _SHOWN} more)" if len(differing) > _SHOWN else ""),
            )
        )
    other = [k for k in missing if not k.startswith("model.")]
    if other and not model_missing:  # else the optimizer misses those parameters' entries too
        problems.append(
            Problem(
                METADATA,
                f"{len(other)} entries this run restores are not in "
                f"the checkpoint, e.g. {other[:_SHOWN]}: it was saved without "
                "(or with another kind of) optimizer, scheduler or data loader",
            )
        )
    return problems


def _name(key: str) -> str:
    return key.removeprefix("model.")


def _show(keys: list[str]) -> str:
    return str([_name(k) for k in keys[:_SHOWN]]) + (" ..." if len(keys) > _SHOWN else "")


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"
