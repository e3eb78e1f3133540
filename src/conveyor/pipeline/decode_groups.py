"""DecodePipeline's default number of groups in flight, chosen at run time: every rank
measures its own stages, the fits are gathered, and the group's first rank simulates each
candidate (conveyor.inference.groups) and broadcasts its choice, so every rank runs the same
Program.

    chooser = GroupChooser(lm, graph, units, rank, group, p2p, device)
    choice = chooser.choose(batch_size=8, prompt_length=128, config=config)  # collective

See Note [choosing groups at run time].
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.graph import StageGraph
from conveyor.inference.config import GenerationConfig
from conveyor.inference.cost import StageFit, decode_point, profile_generation
from conveyor.inference.groups import GroupChoice, choose_groups, measured_rows
from conveyor.inference.lm import CausalLM
from conveyor.runtime.comm import P2P, Meta
from conveyor.simulator import Overheads

__all__ = ["GroupChooser", "Measured"]

logger = logging.getLogger(__name__)

# Note [choosing groups at run time]:
# Groups in flight keep every rank busy but run each forward on fewer rows, which is not
# proportionally faster, and add forwards and messages: on a quiet 2-core machine 2 groups
# decoded 1.46x one group, on a loaded one 0.87-0.95x. So a generation without num_groups
# measures before it chooses, once per batch size and length (to the next power of two):
# 1. every rank profiles its own stages at the group sizes the candidates run, all ranks at
#    once (conveyor.inference.cost.profile_generation, after a barrier), so that ranks
#    competing for cores and memory bandwidth, as they do with groups in flight, compete
#    while measured;
# 2. the ranks take turns timing one group's shape alone, as one group runs (one rank busy
#    at a time): on a shared machine a stage alone runs faster, and one group is predicted
#    with its fits scaled by that (never slower than measured together);
# 3. ranks 0 and 1 time a round trip of a decode message: each message is charged its one-way
#    time on the sender's clock (as if all of it were work, which is what groups pay more of);
# 4. the fits are gathered on every rank; the first rank simulates every candidate and
#    broadcasts the choice: more than one group only if predicted 5% faster than one
#    (conveyor.inference.groups.MARGIN).
# Choices are kept per shape, fits per batch size and length, both on every rank alike (the
# ranks have agreed on every generation's prompts and settings), so a later call of the same
# shape runs no collective at all.


@dataclass(frozen=True)
class Measured:
    """What step 1-3 of Note [choosing groups at run time] found, every stage's."""

    fits: tuple[StageFit, ...]
    """Each stage's costs measured with every rank busy."""
    alone: tuple[float, ...]
    """Each stage's time for one group's shape measured alone, as a share of its fit (<= 1)."""
    message_s: float
    """One decode message's one-way time between two ranks."""
    seconds: float
    """Wall time measuring took on this rank."""


class GroupChooser:
    """Chooses and remembers the number of groups of each generation shape; collective over
    the pipeline's ``group`` on a new shape."""

    def __init__(
        self,
        lm: CausalLM,
        graph: StageGraph,
        units: Mapping[int, range],
        rank: int,
        group: dist.ProcessGroup | None,
        p2p: P2P,
        device: torch.device,
    ) -> None:
        self.lm, self.graph, self.units = lm, graph.topology(), units
        self.rank, self.group, self.p2p, self.device = rank, group, p2p, device
        self.measured: dict[tuple[Any, ...], Measured] = {}
        """Per (batch size, length to the next power of two, dtype, cache kind)."""
        self.choices: dict[tuple[Any, ...], GroupChoice] = {}
        """Per (batch size, prompt length, max_new_tokens, prefill_chunk, ...)."""

    def choose(self, batch_size: int, prompt_length: int, config: GenerationConfig) -> GroupChoice:
        """The number of groups to run this generation in; measures first (every rank must
        call this alike) unless a generation of the same shape chose before."""
        cache_kind = config.cache or self.lm.default_cache
        length = prompt_length + config.max_new_tokens
        fits_key = (batch_size, 1 << math.ceil(math.log2(length)), self.lm.dtype, cache_kind)
        key = (*fits_key, prompt_length, config.max_new_tokens, config.prefill_chunk)
        if key in self.choices:
            return self.choices[key]
        measured = self.measured.get(fits_key)
        is_new = measured is None
        if measured is None:
            measured = self.measured[fits_key] = self._measure(batch_size, prompt_length, config)
        box: list[Any] = [None]
        if self.rank == 0:
            box[0] = self._simulate(measured, batch_size, prompt_length, config)
        self._barrier()
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        choice: GroupChoice = box[0]
        self.choices[key] = choice
        if self.rank == 0:
            _log(choice, measured, is_new, batch_size, prompt_length, config)
        return choice

    def _simulate(
        self, measured: Measured, batch_size: int, prompt_length: int, config: GenerationConfig
    ) -> GroupChoice:
        alone = [fit * share for fit, share in zip(measured.fits, measured.alone, strict=True)]
        return choose_groups(
            measured.fits,
            self.graph,
            batch_size=batch_size,
            prompt_length=prompt_length,
            max_new_tokens=config.max_new_tokens,
            hidden_bytes=self.lm.hidden_size * self.lm.dtype.itemsize,
            prefill_chunk=config.prefill_chunk,
            one_group_fits=alone,
            overheads=Overheads(send=measured.message_s),
        )

    def _measure(self, batch_size: int, prompt_length: int, config: GenerationConfig) -> Measured:
        """Steps 1-3 of Note [choosing groups at run time], then every stage's results
        gathered on every rank."""
        start = time.perf_counter()
        num_ranks = self.graph.num_ranks
        local = self.graph.stages_on(self.rank)
        stages = [self.units[s] for s in local]
        fits = profile_generation(
            self.lm,
            stages,
            measured_rows(batch_size, num_ranks),
            prompt_length,
            config.max_new_tokens,
            config=config,
            device=self.device,
            sync=self._barrier,
        )
        alone = []
        for turn in range(num_ranks):  # one rank at a time: the others wait in the barrier
            self._barrier()
            if turn == self.rank:
                for units, fit in zip(stages, fits, strict=True):
                    rows, length, begin, seconds = decode_point(
                        self.lm, units, batch_size, config=config, device=self.device
                    )
                    together = fit.decode.time(rows, length, begin)
                    alone.append(min(1.0, seconds / together) if together > 0 else 1.0)
        self._barrier()
        message_s = self._round_trip(batch_size) / 2
        mine = (dict(zip(local, zip(fits, alone, strict=True), strict=True)), message_s)
        self._barrier()
        gathered: list[Any] = [None] * num_ranks
        dist.all_gather_object(gathered, mine, group=self.group)
        by_stage = {s: found for stages_of, _ in gathered for s, found in stages_of.items()}
        ordered = [by_stage[s] for s in range(self.graph.num_stages)]
        return Measured(
            tuple(fit for fit, _ in ordered),
            tuple(share for _, share in ordered),
            gathered[0][1],
            time.perf_counter() - start,
        )

    def _barrier(self) -> None:
        """Every rank here, or within the pipeline's timeout the PeerLostError naming the
        rank missing (a stopped peer must not hold the others longer than a step would):
        before every collective of choosing."""
        work = dist.barrier(group=self.group, async_op=True)
        assert work is not None
        try:
            work.wait(self.p2p.timeout)
        except RuntimeError as error:
            peers, doing = self.p2p.peers, "choosing the number of groups"
            raise peers.lost_in(peers.job.ranks, doing, error, self.p2p.timeout) from error

    def _round_trip(self, rows: int, trips: int = 8) -> float:
        """Median seconds of a decode message from rank 0 to rank 1 and back, on rank 0 (0.0
        on the other ranks, which take no part beyond rank 1)."""
        if self.rank > 1:
            return 0.0
        hidden = torch.empty((rows, 1, self.lm.hidden_size), dtype=self.lm.dtype, device="meta")
        meta = Meta.of({"value": hidden, "done": torch.empty((), dtype=torch.bool, device="meta")})
        message = {
            "value": torch.zeros(hidden.shape, dtype=hidden.dtype, device=self.device),
            "done": torch.tensor(False, device=self.device),
        }
        peer = 1 - self.rank
        times = []
        with _unrecorded(self.p2p):
            for _ in range(trips + 1):  # the first one is a warm-up
                begin = time.perf_counter()
                if self.rank == 0:
                    self.p2p.send(message, peer, "a timed message")
                    self.p2p.wait(self.p2p.post(peer, meta, "a timed message"))
                else:
                    echo = self.p2p.wait(self.p2p.post(peer, meta, "a timed message"))
                    self.p2p.send(echo, peer, "a timed message")
                times.append(time.perf_counter() - begin)
            self.p2p.wait_sends()
        return statistics.median(times[1:])


@contextlib.contextmanager
def _unrecorded(p2p: P2P) -> Iterator[None]:
    """Messages left out of the trace: they are no generation's."""
    recorder, p2p.recorder = p2p.recorder, None
    try:
        yield
    finally:
        p2p.recorder = recorder


def _log(
    choice: GroupChoice,
    measured: Measured,
    is_new: bool,
    batch_size: int,
    prompt_length: int,
    config: GenerationConfig,
) -> None:
    predicted = ", ".join(f"{t * 1e3:.0f}" for t in choice.predicted)
    logger.info(
        "generate: %d group%s in flight for %d sequences, prompt %d, %d new tokens: predicted "
        "%.0f ms vs %.0f ms with one group (%.2fx; 1..%d groups: %s ms); stages measured in "
        "%.2f s%s; pass num_groups= to choose yourself",
        choice.num_groups,
        "" if choice.num_groups == 1 else "s",
        batch_size,
        prompt_length,
        config.max_new_tokens,
        choice.seconds * 1e3,
        choice.one_group_seconds * 1e3,
        choice.speedup,
        len(choice.predicted),
        predicted,
        measured.seconds,
        "" if is_new else " (by an earlier generation of this batch size)",
    )
