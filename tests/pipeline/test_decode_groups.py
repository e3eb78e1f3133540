"""DecodePipeline's default number of groups on 2 ranks: measured and chosen once per shape,
said in the log, the same on every rank, the tokens the unsplit model's; an explicit
num_groups measures nothing (conveyor.pipeline.decode_groups)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_generate import prompts, small_gpt

from conveyor.inference.groups import GroupChoice
from conveyor.pipeline import decode_groups
from conveyor.pipeline.decode import DecodePipeline, generate
from dist import run_ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _defaults(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    records = _Records()
    logger = logging.getLogger(decode_groups.__name__)
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    profiles: list[int] = []
    profile = decode_groups.profile_generation

    def counted(*args: Any, **kwargs: Any) -> Any:
        profiles.append(rank)
        return profile(*args, **kwargs)

    decode_groups.profile_generation = counted  # this rank's process only
    model = small_gpt()
    decoder = DecodePipeline(model)
    ids, mask = prompts(8, seed=4)

    def check(tokens: torch.Tensor | None, max_new_tokens: int) -> None:
        want = generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens)
        assert tokens is not None and torch.equal(tokens, want)

    check(decoder.generate(ids, attention_mask=mask, max_new_tokens=6), 6)
    choice, stats = decoder.choice, decoder.stats
    assert choice is not None and stats is not None and profiles == [rank]
    assert stats.num_groups == choice.num_groups and len(choice.predicted) == 4
    assert choice.seconds <= choice.one_group_seconds and stats.choosing_seconds > 0
    said = records.messages
    if rank == 0:  # the first rank says what it chose, how fast, and how to choose otherwise
        assert len(said) == 1, said
        plural = "" if choice.num_groups == 1 else "s"
        assert f"generate: {choice.num_groups} group{plural} in flight for 8 sequences" in said[0]
        assert "with one group" in said[0] and "pass num_groups= to choose yourself" in said[0]
    else:
        assert said == []
    # the same shape again: nothing measured, nothing said
    check(decoder.generate(ids, attention_mask=mask, max_new_tokens=6), 6)
    assert profiles == [rank] and len(said) == (rank == 0) and decoder.choice == choice
    # given num_groups: nothing measured or chosen
    check(decoder.generate(ids, attention_mask=mask, max_new_tokens=6, num_groups=3), 6)
    assert profiles == [rank] and decoder.choice is None and decoder.stats.num_groups == 3
    # another shape of the same batch size and length: the measured costs are reused, and
    # the first rank's choice (forced to 3 groups there) is every rank's
    forced = GroupChoice(3, 1.0, 2.0, (2.0, 1.5, 1.0, 1.2))
    if rank == 0:
        decode_groups.choose_groups = lambda *args, **kwargs: forced
    check(decoder.generate(ids, attention_mask=mask, max_new_tokens=5), 5)
    assert profiles == [rank] and decoder.choice == forced and decoder.stats.num_groups == 3
    if rank == 0:
        assert len(said) == 2 and "by an earlier generation of this batch size" in said[1]


@pytest.mark.dist
def test_the_default_groups_are_chosen_once_per_shape_and_said(tmp_path: Path) -> None:
    run_ranks(_defaults, tmp_path, world_size=2)
