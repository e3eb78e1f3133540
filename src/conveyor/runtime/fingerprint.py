"""Every rank must be given the same batch: a fingerprint of it, compared by all ranks at once.

    mine = fingerprint(bound_inputs, targets, True, device, batch_size)
    agree(p2p, mine, "step 3")   # on every rank before the step's first message; raises if
                                 # any rank's fingerprint differs
    warn_other_initializations(p2p, initial_digest([model]))   # the same model, at construction

A pipeline is not data parallel: the first stage's rank reads the inputs and the last stage's
rank the targets, so ranks given different batches (code ported from data-parallel training,
where each rank reads its own shard) would train on one rank's inputs with another rank's
targets and never notice; a different batch size would make a receive of the wrong size, which
gloo answers by aborting the process. See Note [batch fingerprint].
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import UninitializedParameter

from conveyor.runtime.comm import P2P, Meta
from conveyor.runtime.peers import StepRefused
from conveyor.torch_compat import pytree

__all__ = [
    "BatchMismatchError",
    "CannotRunError",
    "Fingerprint",
    "StepRefused",
    "agree",
    "autocast_state",
    "digest",
    "exchange",
    "exchange_settings",
    "fingerprint",
    "initial_digest",
    "settings_difference",
    "warn_other_initializations",
]

logger = logging.getLogger(__name__)


class BatchMismatchError(ValueError, StepRefused):
    """Another rank's batch or mode differs from this rank's."""


class CannotRunError(RuntimeError, StepRefused):
    """A rank cannot run the step (uninitialized weights)."""


# Note [batch fingerprint]:
# At the start of every step (and every inference call) each rank sends a fingerprint of its batch
# to every other rank and compares what it receives with its own, before any activation moves: a
# difference fails every rank at once with the same message, and a batch size that differs never
# reaches a receive of the wrong size. The fingerprint is eight int64s: the batch size, digests of
# the structure (shapes, dtypes, constants), of the inputs' values, of the targets' values, of the
# mode (step or forward, autocast), a flag for a rank that cannot run (its stages hold parameters
# nothing initialized), a digest of the pipeline it runs (Program, split, checkpointing: ranks
# constructed with other arguments would deadlock or exchange messages of the wrong size), and a
# digest of which of the rank's parameters require gradients. That last one is not compared but
# kept: it decides which activations carry gradients, so a stage frozen or unfrozen between steps
# makes the senders exchange their layouts again (the interpreter keys each channel's layout by it).
# Values are digested exactly: each tensor's bytes as 64-bit integers, summed (wrapping) plainly and
# weighted by position along the batch and across a sample. Integer sums do not depend on the order
# of reduction, so equal batches give equal digests on any rank and device, and a batch reordered or
# shifted gives another. One exchange costs each rank p - 1 small messages each way, and the sums
# about one read of the batch (measured in docs/benchmarks.md, batch check).
@dataclass(frozen=True)
class Fingerprint:
    """What every rank must agree on before a step: its batch and how the step runs."""

    batch_size: int
    layout: int
    """Digest of the structure: argument names, shapes, dtypes, non-tensor values."""
    inputs: int
    """Digest of the model inputs' values."""
    targets: int
    """Digest of the targets' values (0 without targets)."""
    mode: int
    """Digest of step or forward and the autocast state."""
    not_ready: int = 0
    """1 if this rank cannot run the step; ``problem`` says why."""
    pipeline: int = 0
    """Digest of the pipeline this rank runs: its Program (schedule, micro-batches,
    placement) and split, so ranks constructed with other arguments are told so."""
    trainable: int = field(default=0, compare=False)
    """Digest of which of this rank's parameters require gradients: not compared (ranks hold
    other stages) but shared, since it decides which activations carry gradients."""
    problem: str = field(default="", compare=False)
    """Why this rank cannot run (local: peers learn only ``not_ready``)."""

    def tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, name) for name in _SENT], dtype=torch.int64)

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor) -> Fingerprint:
        batch_size, layout, inputs, targets, mode, not_ready, pipeline, trainable = map(
            int, tensor.tolist()
        )
        return cls(batch_size, layout, inputs, targets, mode, not_ready, pipeline, trainable)


_SENT = ("batch_size", "layout", "inputs", "targets", "mode", "not_ready", "pipeline", "trainable")


def autocast_state(device: torch.device) -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Whether autocast is on, and to which dtype, for ``device``'s type and the CPU: it
    changes the dtypes a stage sends, so it is part of a micro-batch's signature."""
    return tuple(
        (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        for kind in dict.fromkeys((device.type, "cpu"))
    )


def fingerprint(
    inputs: dict[str, Any],
    targets: Any,
    is_training: bool,
    device: torch.device,
    batch_size: int | None,
    problem: str = "",
    trainable: Any = (),
    pipeline: Any = (),
) -> Fingerprint:
    """The fingerprint of one step's batch (``inputs`` bound to forward's parameters);
    ``problem`` says why this rank cannot run the step, if it cannot; ``trainable`` is what
    of this rank's model requires gradients and ``pipeline`` what it runs (both digested).

    Raises:
        ValueError: a tensor of the batch is on the meta device (it holds no values).
    """
    _refuse_meta(inputs, "model inputs")
    _refuse_meta(targets, "targets")
    layout = [_layout(inputs), _layout(targets)]
    return Fingerprint(
        -1 if batch_size is None else batch_size,
        digest(layout),
        digest(_values(inputs)),
        0 if targets is None else digest(_values(targets)),
        digest([is_training, autocast_state(device)]),
        1 if problem else 0,
        digest(pipeline),
        digest(trainable),
        problem,
    )


def agree(
    p2p: P2P, mine: Fingerprint, describe: str, settings: Mapping[str, str] | None = None
) -> tuple[int, ...]:
    """Exchange fingerprints with every other rank of ``p2p``'s group; raise if any differs.
    Returns every rank's ``trainable`` digest, by rank: the same on every rank.

    ``settings`` are the named values this rank was given besides the batch (generate's
    ``max_new_tokens``, ``seed``, ...; already in ``mine.layout``): when the fingerprints
    differ, every rank sends them too, so that the error names each setting that differs and
    every rank's value. Every rank passes settings, or none does.

    Collective: every rank calls it with its own fingerprint before the step's first message.

    Raises:
        BatchMismatchError: another rank's batch, settings or mode differs from this rank's.
        CannotRunError: a rank cannot run (its ``problem``, or on the others, its name).
        PeerLostError: a peer did not answer within the timeout.
    """
    received = exchange(p2p, mine.tensor(), f"the batch fingerprint of {describe}")
    theirs = {peer: Fingerprint.of_tensor(message) for peer, message in received.items()}
    # every rank refuses, or none does (if two fingerprints differ, each rank's differs from
    # one of them), so every rank takes part in the exchange of settings, or none does
    refusal = _refusal(p2p.rank, mine, theirs, describe)
    if refusal is not None and settings is not None:
        others = exchange_settings(p2p, settings, f"the settings of {describe}")
        if isinstance(refusal, BatchMismatchError):
            named = settings_difference(p2p.rank, settings, others, describe)
            refusal = refusal if named is None else BatchMismatchError(named)
    if refusal is not None:
        raise refusal
    theirs[p2p.rank] = mine
    return tuple(theirs[rank].trainable for rank in sorted(theirs))


def _refusal(
    rank: int, mine: Fingerprint, theirs: Mapping[int, Fingerprint], describe: str
) -> StepRefused | None:
    """Why this rank must not run the step, given every peer's fingerprint; None if all agree."""
    if mine.problem:
        return CannotRunError(mine.problem)
    for peer, other in theirs.items():
        if other.not_ready:
            return CannotRunError(
                f"rank {rank}: rank {peer} cannot run {describe} (its own error says "
                "why); every rank stops before any activation moves"
            )
        if other != mine:
            return BatchMismatchError(_difference(rank, peer, mine, other, describe))
    return None


def exchange_settings(
    p2p: P2P, settings: Mapping[str, str], what: str
) -> dict[int, dict[str, str]]:
    """Every other rank's ``settings`` (names to the repr of their values), by rank: they
    travel in the messages' headers, whatever their lengths.

    Collective: every rank calls it.
    """
    mine = dict(settings)
    peers = [r for r in range(dist.get_world_size(p2p.group)) if r != p2p.rank]
    for peer in peers:
        p2p.send(mine, peer, what, header=Meta.of(mine))
    posted = [(peer, p2p.post(peer, None, what)) for peer in peers]
    theirs = {peer: dict(p2p.wait(receive)) for peer, receive in posted}
    p2p.wait_sends()
    return theirs


def settings_difference(
    rank: int, mine: Mapping[str, str], theirs: Mapping[int, Mapping[str, str]], what: str
) -> str | None:
    """The settings in which other ranks differ from this one, each rank's value named
    ('rank 1 passed max_new_tokens=8, rank 0 passed 4'); None if they are the same (a rank
    that passed none, having failed to read its own, is left out)."""
    found = [
        f"rank {peer} passed {name}={value}, rank {rank} passed {mine.get(name)}"
        for peer, other in sorted(theirs.items())
        if other
        for name, value in other.items()
        if mine.get(name) != value
    ]
    if not found or not mine:
        return None
    return (
        f"rank {rank}: ranks were given other settings for {what}: {'; '.join(found)}. Every "
        "rank of a pipeline runs the same generation: pass the same settings (and prompts) "
        "on every rank"
    )


def exchange(p2p: P2P, message: torch.Tensor, what: str) -> dict[int, torch.Tensor]:
    """Send ``message`` to every other rank of ``p2p``'s group and return theirs, by rank.

    Collective: every rank calls it with a message of the same shape and dtype.
    """
    peers = [r for r in range(dist.get_world_size(p2p.group)) if r != p2p.rank]
    for peer in peers:
        p2p.send(message, peer, what)
    posted = [(peer, p2p.post(peer, Meta.of(message), what)) for peer in peers]
    theirs = {peer: p2p.wait(receive) for peer, receive in posted}
    p2p.wait_sends()
    return theirs


# Note [one initialization]:
# Every rank builds the whole model and keeps its own stages, so the stages are those of one
# model only if every rank built the same one. Ranks seeded apart (torch.manual_seed(rank), as
# data-parallel scripts do for their data) or weights loaded on one rank only give each stage
# its own rank's model, and nothing fails: training runs, from an initialization no single
# model has, unlike the same script on one process. The whole model is at hand on every rank
# at construction, so the ranks compare a digest of its parameters there: a few values of each
# at fixed places, which any two random initializations differ in (a cost of microseconds per
# parameter, and one small message each way). Tensors on the meta device are left out: each
# rank materializes its own stages from them, which no digest of the model can compare. A
# warning, not an error: weights loaded into every stage after construction make it moot.
_SAMPLES = 8
"""Values of each parameter in the digest, at evenly spaced places."""


def initial_digest(modules: Iterable[nn.Module]) -> int:
    """A digest of the parameters of ``modules`` (a few values of each); 0 when there are
    none to compare (all on the meta device). See Note [one initialization]."""
    hasher = hashlib.blake2b(digest_size=8)
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if id(param) in seen or param.is_meta or isinstance(param, UninitializedParameter):
                continue
            seen.add(id(param))
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // _SAMPLES)][:_SAMPLES]
            hasher.update(sample.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    if not seen:
        return 0
    return (int.from_bytes(hasher.digest(), "little") >> 1) or 1


def warn_other_initializations(p2p: P2P, mine: int) -> None:
    """Exchange every rank's ``initial_digest`` over ``p2p``'s group; the group's rank 0 warns
    when ranks built the model with other initial parameters. Collective: every rank calls it
    (with 0 when it has nothing to compare). See Note [one initialization]."""
    message = torch.tensor([mine], dtype=torch.int64)
    received = exchange(p2p, message, "the digest of the model's initial parameters")
    if p2p.rank != 0:
        return
    digests = {p2p.rank: mine} | {peer: int(t[0]) for peer, t in received.items()}
    models: dict[int, list[int]] = {}
    for rank, value in sorted(digests.items()):
        if value:
            models.setdefault(value, []).append(rank)
    if len(models) < 2:
        return
    first, *others = models.values()
    built = f"ranks {first} built one, " + ", ".join(f"ranks {ranks} another" for ranks in others)
    logger.warning(
        "rank %d: the ranks built the model with other initial parameters (%s), so each "
        "stage starts from its own rank's model, not from one model's initialization: "
        "ranks seeded differently (torch.manual_seed(rank)) build different "
        "models. Seed every rank alike before building the model, or load the same weights "
        "on every rank (weights=...; after construction, pipe.load_state_dict or a "
        "checkpoint, and then ignore this)",
        p2p.rank,
        built,
    )


def _difference(rank: int, peer: int, mine: Fingerprint, other: Fingerprint, what: str) -> str:
    if mine.pipeline != other.pipeline:
        return (
            f"rank {rank}: rank {peer} runs another pipeline for {what}: its schedule, "
            "micro-batches, split, placement or checkpointing differ from this rank's; "
            "construct the Pipeline with the same model and arguments on every rank"
        )
    if mine.mode != other.mode:
        return (
            f"rank {rank}: rank {peer} runs {what} in another mode: one rank calls step() "
            "and the other forward(), or autocast is on for one and not the other (or casts "
            "to another dtype); call the same method on every rank, under the same autocast"
        )
    if mine.batch_size != other.batch_size:
        found = f"a batch of {mine.batch_size} samples here, {other.batch_size} on rank {peer}"
    elif mine.layout != other.layout:
        found = "the batches differ in structure, shapes or dtypes, or in a non-tensor value"
    elif mine.inputs != other.inputs:
        found = "the model inputs hold different values"
    else:
        found = "the targets hold different values"
    return (
        f"rank {rank}: rank {peer} was given another batch for {what}: {found}. Every rank "
        "must pass the same batch to step(), forward() and generate() (a pipeline is not data "
        "parallel: the first stage's rank reads the inputs, the last stage's rank the "
        "targets); load the same data on every rank of the pipeline (same seed, no "
        "DistributedSampler over the pipeline's ranks)"
    )


def _refuse_meta(value: Any, what: str) -> None:
    leaves, _ = pytree.tree_flatten_with_path(value)
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise ValueError(
                f"{what}{pytree.keystr(path)} of shape {tuple(leaf.shape)} is on the meta "
                "device: it has no values to compute with; pass tensors with data (on the "
                "CPU or the pipeline's device)"
            )


def _layout(value: Any) -> Any:
    leaves, spec = pytree.tree_flatten(value)
    return [
        str(spec),
        [
            (tuple(t.shape), str(t.dtype), t.requires_grad)
            if isinstance(t, torch.Tensor)
            else repr(t)
            for t in leaves
        ],
    ]


def _values(value: Any) -> list[tuple[int, int, int]]:
    return [_checksum(t) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _checksum(tensor: torch.Tensor) -> tuple[int, int, int]:
    """Exact integer sums of a tensor's bytes: plain, weighted by position along the first
    dimension, and weighted by position within a sample. See Note [batch fingerprint]."""
    data = tensor.detach()
    if data.numel() == 0:
        return 0, 0, 0
    if data.is_complex():
        data = torch.view_as_real(data)
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    rows = raw.reshape(data.shape[0] if data.dim() > 0 else 1, -1)
    # sums of int64 words run as fast as float sums; other integer sums are far slower
    if rows.shape[1] % 8 == 0:
        words = (rows if rows.storage_offset() % 8 == 0 else rows.clone()).view(torch.int64)
    else:
        words = rows.to(torch.int64)
    by_row, by_column = words.sum(1), words.sum(0)
    weigh = torch.arange(1, max(len(by_row), len(by_column)) + 1, device=words.device)
    sums = torch.stack(
        [
            by_row.sum(),
            (by_row * weigh[: len(by_row)]).sum(),
            (by_column * weigh[: len(by_column)]).sum(),
        ]
    )
    total, along, across = sums.tolist()
    return total, along, across


def digest(value: Any) -> int:
    """A signed 63-bit digest of ``value``'s repr (stable across processes, unlike hash())."""
    data = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(data, "little") >> 1
