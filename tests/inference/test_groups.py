"""Choosing the number of groups in flight from stage costs, as plain data: more than one group
only when predicted clearly faster (conveyor.inference.groups), and the short profile it is
chosen by (conveyor.inference.cost.profile_generation)."""

from __future__ import annotations

import pytest
import torch

from conveyor.graph import chain
from conveyor.inference import GenerationConfig, decode_items, decode_program
from conveyor.inference.cost import DecodeCost, Fit, StageFit, profile_generation
from conveyor.inference.groups import (
    MARGIN,
    candidate_groups,
    choose_groups,
    measured_rows,
    predict_seconds,
)
from conveyor.inference.prompts import groups_of
from conveyor.models import gpt
from conveyor.pipeline.decode import as_causal_lm
from conveyor.simulator import Overheads, simulate

SHAPE = {"batch_size": 8, "prompt_length": 16, "max_new_tokens": 12, "hidden_bytes": 64 * 4}

COMPUTE = StageFit(decode=Fit(1e-5, 1e-3, 0.0), prefill=Fit(1e-5, 1e-4, 0.0))
"""A stage whose time is its rows' compute: half the rows, half the time."""
PER_CALL = StageFit(decode=Fit(1e-2, 1e-5, 0.0), prefill=Fit(1e-2, 1e-6, 0.0))
"""A stage whose time is a fixed cost per call (as a CPU streaming the weights at every
token): more groups, more calls, hardly less work per call."""


def test_the_candidates_are_one_group_to_two_per_rank_and_the_profile_spans_their_rows() -> None:
    assert list(candidate_groups(8, 2)) == [1, 2, 3, 4]
    assert list(candidate_groups(3, 2)) == [1, 2, 3]  # at most one group per sequence
    assert list(candidate_groups(1, 4)) == [1]
    assert measured_rows(8, 2) == [8, 4, 2]  # one group, one per rank, the smallest
    assert measured_rows(7, 2) == [7, 4, 1]  # 4 groups of 7: 2, 2, 2, 1
    assert measured_rows(16, 4) == [16, 4, 2]


def test_groups_are_chosen_when_compute_dominates() -> None:
    choice = choose_groups([COMPUTE, COMPUTE], chain(2), **SHAPE)
    assert choice.num_groups > 1  # the ranks overlap, and smaller prompt items pipeline
    assert len(choice.predicted) == 4 and choice.predicted[0] == choice.one_group_seconds
    assert choice.seconds == min(choice.predicted) < choice.one_group_seconds * (1 - MARGIN)
    assert choice.speedup > 1.8  # at most 2 on 2 ranks
    four = choose_groups([COMPUTE] * 4, chain(4), **SHAPE)
    assert four.num_groups >= 4 and len(four.predicted) == 8 and four.speedup > 3


def test_one_group_is_kept_when_groups_only_add_calls() -> None:
    choice = choose_groups([PER_CALL, PER_CALL], chain(2), **SHAPE)
    assert choice.num_groups == 1 and choice.speedup == 1.0
    assert all(t > choice.one_group_seconds for t in choice.predicted[1:])


def test_one_group_is_kept_unless_groups_win_by_the_margin() -> None:
    fits = [COMPUTE + PER_CALL * 0.05, COMPUTE + PER_CALL * 0.05]
    best = choose_groups(fits, chain(2), **SHAPE, margin=0.0)
    gain = 1 - best.seconds / best.one_group_seconds
    assert best.num_groups > 1 and gain > 0
    assert choose_groups(fits, chain(2), **SHAPE, margin=gain - 0.01).num_groups > 1
    doubtful = choose_groups(fits, chain(2), **SHAPE, margin=gain + 0.01)
    assert doubtful.num_groups == 1 and doubtful.seconds == doubtful.one_group_seconds


def test_one_group_is_kept_when_its_stages_run_faster_alone() -> None:
    # one group's ranks take turns: on a loaded machine each runs faster alone than while
    # the other computes too, which groups in flight make it do
    together = [COMPUTE, COMPUTE]
    alone = choose_groups(together, chain(2), **SHAPE, one_group_fits=[COMPUTE * 0.45] * 2)
    assert alone.num_groups == 1
    assert alone.one_group_seconds < choose_groups(together, chain(2), **SHAPE).one_group_seconds


def test_every_message_is_charged() -> None:
    free = predict_seconds([COMPUTE, COMPUTE], chain(2), num_groups=2, **SHAPE)
    sent = predict_seconds(
        [COMPUTE, COMPUTE], chain(2), num_groups=2, **SHAPE, overheads=Overheads(send=1e-3)
    )
    # 2 groups x 12 tokens: 24 hidden states to rank 1, 22 tokens back to rank 0; each rank
    # sends one message per item it runs, on its own clock
    assert sent == pytest.approx(free + 24 * 1e-3)


@pytest.mark.parametrize("prefill_chunk", [None, 6])
def test_a_long_generation_is_predicted_as_its_whole_simulation(prefill_chunk: int | None) -> None:
    # two short simulations at the average position stand for the long one (See Note [short
    # simulations]): exact while a token's cost is linear in its position
    fit = StageFit(decode=Fit(2e-3, 5e-4, 2e-6), prefill=Fit(2e-3, 1e-4, 3e-6))
    graph = chain(2)
    for num_groups in (1, 2, 3):
        shape = {**SHAPE, "max_new_tokens": 40, "prefill_chunk": prefill_chunk}
        quick = predict_seconds([fit, fit], graph, num_groups=num_groups, **shape)
        items = decode_items(num_groups, 16, 40, prefill_chunk)
        groups = groups_of(8, num_groups)
        cost = DecodeCost([fit, fit], graph, items, groups, SHAPE["hidden_bytes"])
        whole = simulate(decode_program(graph, items), graph, cost).step_time
        assert quick == pytest.approx(whole, rel=1e-3), num_groups


def test_the_short_profile_fits_every_stage_and_leaves_the_random_stream_alone() -> None:
    torch.manual_seed(0)
    lm = as_causal_lm(gpt(vocab_size=61, seq_len=48, dim=32, num_layers=4).eval())
    state = torch.get_rng_state()
    syncs = []
    fits = profile_generation(
        lm,
        [range(0, 3), range(3, 6)],
        measured_rows(8, 2),
        prompt_length=12,
        max_new_tokens=8,
        config=GenerationConfig(do_sample=True, top_k=5),
        sync=lambda: syncs.append(1),
    )
    assert len(fits) == 2 and len(syncs) == 2  # before filling, before the rounds
    for fit in fits:
        for part in (fit.decode, fit.prefill):
            assert min(part.fixed, part.per_token, part.per_pair) >= 0
            assert part.time(4, 1, 16) > 0
    assert torch.equal(torch.get_rng_state(), state)
