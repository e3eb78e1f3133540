"""Decode Programs as plain data: items, fed-back tokens, group order, the validator's rules,
the simulator on them, and decode costs (conveyor.inference.schedule, .cost)."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.graph import chain
from conveyor.inference import decode_items, decode_program
from conveyor.inference.cost import DecodeCost, Fit, StageFit, pairs
from conveyor.planner.parallelism import (
    LayerCosts,
    compare,
    estimate,
    measured_overhead,
    pipeline_chunk,
)
from conveyor.program import Action, Kind, Program
from conveyor.schedule import ProgramError, validate
from conveyor.simulator import Link, Overheads, simulate
from conveyor.trace import render_grid


def test_items_run_prompt_chunks_then_one_token_per_round() -> None:
    items = decode_items(num_groups=2, prompt_length=8, max_new_tokens=3, prefill_chunk=5)
    rows = [(i.group, i.start, i.length, i.source, i.samples) for i in items]
    assert rows == [
        (0, 0, 5, None, False),  # first chunk of each group's prompt
        (1, 0, 5, None, False),
        (0, 5, 3, None, True),  # last chunk: samples the first new token
        (1, 5, 3, None, True),
        (0, 8, 1, 2, True),  # second token: takes the token item 2 sampled
        (1, 8, 1, 3, True),
        (0, 9, 1, 4, True),
        (1, 9, 1, 5, True),
    ]


def test_groups_in_flight_keep_every_rank_busy() -> None:
    graph = chain(2)
    naive = simulate(decode_program(graph, decode_items(1, 4, 4)), graph)
    grouped = simulate(decode_program(graph, decode_items(2, 4, 4)), graph)
    assert render_grid(naive).splitlines() == [
        "rank 0 | 0F0  .  0F1  .  0F2  .  0F3  . ",
        "rank 1 |  .  1F0  .  1F1  .  1F2  .  1F3",
    ]
    assert render_grid(grouped).splitlines() == [  # the grid drawn in conveyor.inference.schedule
        "rank 0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7  . ",
        "rank 1 |  .  1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7",
    ]
    assert naive.bubble_fraction == 0.5 and grouped.bubble_fraction == pytest.approx(1 / 9)


def test_the_sampled_token_travels_back_as_a_send_and_a_receive() -> None:
    graph = chain(2)
    program = decode_program(graph, decode_items(1, 4, 3))
    assert str(program).splitlines() == [  # the last item's token feeds nothing
        "0RF0<1 0RF1<1 0F0 0SF0>1 0F1 0SF1>1 0F2 0SF2>1",
        "1RF0<0 1RF1<0 1RF2<0 1F0 1SF0>0 1F1 1SF1>0 1F2",
    ]
    assert program.feedback is not None and program.feedback.sources == (None, 0, 1)


@pytest.mark.parametrize(
    ("placement", "groups"), [([0, 1, 1, 0], 2), ([0, 1, 0, 1], 3), ([0, 1, 2], 2)]
)
def test_any_placement_gives_a_valid_program(placement: list[int], groups: int) -> None:
    graph = chain(len(placement), placement=placement)
    program = decode_program(graph, decode_items(groups, 6, 5, prefill_chunk=2))
    validate(program, graph)  # decode_program validated it too; this checks the contract
    if placement[-1] == placement[0]:  # the last stage is on the first one's rank: no messages
        assert not any(a.peer == 0 and a.stage == 3 for a in program[0])
    timeline = simulate(program, graph)
    assert sum(e.is_compute for e in timeline.events) == len(placement) * groups * 7


def _swap(program: Program, rank: int, a: str, b: str) -> Program:
    actions = list(program[rank])
    i, j = actions.index(Action.parse(a)), actions.index(Action.parse(b))
    actions[i], actions[j] = actions[j], actions[i]
    ranks = list(program.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(program, ranks=tuple(ranks))


def test_the_validator_keeps_a_groups_items_in_order_on_every_stage() -> None:
    graph = chain(2, placement=[0, 0])
    program = decode_program(graph, decode_items(2, 4, 3, prefill_chunk=2))
    with pytest.raises(ProgramError, match="runs after 0F2 of the same group 0"):
        validate(_swap(program, 0, "0F0", "0F2"), graph)


def test_the_validator_checks_the_feedback() -> None:
    graph = chain(2)
    program = decode_program(graph, decode_items(2, 4, 3))
    assert program.feedback is not None
    other_group = dataclasses.replace(program.feedback, sources=(None, None, 1, 3, 2, 3))
    with pytest.raises(ProgramError, match="micro-batch 2 \\(group 0\\) is fed by 1"):
        validate(dataclasses.replace(program, feedback=other_group), graph)
    without = tuple(a for a in program[0] if str(a) != "0RF2<1")
    with pytest.raises(ProgramError, match="0F4: comes before 0RF2<1, which it depends on"):
        validate(dataclasses.replace(program, ranks=(without, program[1])), graph)
    local = chain(2, placement=[0, 0])
    program = decode_program(local, decode_items(1, 4, 2))
    with pytest.raises(ProgramError, match="0F1: comes before 1F0"):  # the token it takes
        validate(_swap(program, 0, "0F1", "1F0"), local)


def test_fits_recover_their_coefficients() -> None:
    truth = Fit(1e-3, 2e-5, 3e-8)
    points = [
        (r, n, s, truth.time(r, n, s)) for r in (1, 4) for n, s in [(1, 10), (1, 900), (64, 0)]
    ]
    fitted = Fit.of(points)
    assert fitted.fixed == pytest.approx(1e-3) and fitted.per_token == pytest.approx(2e-5)
    assert fitted.per_pair == pytest.approx(3e-8)
    assert pairs(2, 3, 4) == 2 * (3 * 4 + 6)  # positions 5, 6, 7 see 5 + 6 + 7 keys


def test_a_fit_leaves_out_what_its_points_cannot_tell_apart() -> None:
    truth = Fit(1e-3, 2e-5, 0.0)
    points = [(r, 16, 0, truth.time(r, 16, 0)) for r in (2, 4, 8)]  # pairs: 8.5 x tokens
    fitted = Fit.of(points)  # not an arbitrary share of the pairs, which would not extrapolate
    assert fitted.per_pair == 0 and fitted.fixed == pytest.approx(1e-3)
    assert fitted.per_token == pytest.approx(2e-5)
    assert Fit.of([(4, 1, 7, 0.5)]) == Fit(0.5, 0.0, 0.0)  # one point: a constant
    # one sequence, one token, several cache lengths: per_token is fixed's copy, and the cost
    # of attending over the cache (per_pair) is what the points tell
    decode = Fit(2e-3, 0.0, 3e-8)
    fitted = Fit.of([(1, 1, s, decode.time(1, 1, s)) for s in (1024, 8192, 65536)])
    assert fitted.per_token == 0 and fitted.per_pair == pytest.approx(3e-8)
    assert fitted.fixed == pytest.approx(2e-3)


def test_chunks_after_a_cached_prefix_are_priced_by_their_own_fit() -> None:
    first, later = Fit(1.0, 0.01, 1e-4), Fit(2.0, 0.02, 2e-4)
    fit = StageFit(decode=Fit(0.5, 0.0, 1e-5), prefill=first, resumed=later)
    assert fit.time(1, 8, 0) == first.time(1, 8, 0)  # the first chunk
    assert fit.time(1, 8, 8) == later.time(1, 8, 8)  # one after cached tokens
    assert fit.time(1, 1, 16) == fit.decode.time(1, 1, 16)
    assert StageFit(fit.decode, first).time(1, 8, 8) == first.time(1, 8, 8)  # default: prefill
    # stages of several units: a unit without its own resumed fit adds its prefill fit
    plain = StageFit(Fit(0.1, 0.0, 0.0), Fit(0.3, 0.0, 0.0))
    both = fit + plain
    assert both.time(1, 8, 8) == pytest.approx(later.time(1, 8, 8) + 0.3)
    assert both.time(1, 8, 0) == pytest.approx(first.time(1, 8, 0) + 0.3)
    assert (fit * 3).time(1, 8, 8) == pytest.approx(3 * later.time(1, 8, 8))
    assert (plain + plain).resumed is None and (plain * 2).resumed is None


def test_a_profile_measures_chunks_after_cached_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.inference import cost
    from conveyor.models import gpt
    from conveyor.pipeline.decode import as_causal_lm

    runs: list[tuple[int, int]] = []  # (start, length) of every step measured
    step = cost._Runner.step

    def recorded(runner: cost._Runner, length: int) -> float:
        runs.append((runner.start, length))
        return step(runner, length)

    monkeypatch.setattr(cost._Runner, "step", recorded)
    lm = as_causal_lm(gpt(vocab_size=61, seq_len=256, dim=32, num_layers=2).eval())
    fit = cost.profile_stage(lm, range(1, 2), [1], [16], [16, 32], resumed=2, repeats=1)
    chunks = {(start, length) for start, length in runs if length > 1 and start > 0}
    assert chunks == {(16, 16), (32, 16), (32, 32), (64, 32)}  # two after each first chunk
    assert fit.resumed is not None and fit.resumed != fit.prefill
    runs.clear()
    plain = cost.profile_stage(lm, range(1, 2), [1], [16], [16, 32], repeats=1)
    assert plain.resumed is None
    assert not {(start, length) for start, length in runs if length > 1 and start > 0}


def test_decode_costs_charge_items_messages_and_overheads() -> None:
    graph = chain(2)
    items = decode_items(2, 8, 2)
    groups = [range(0, 3), range(3, 5)]
    fit = StageFit(decode=Fit(1.0, 0.1, 0.0), prefill=Fit(2.0, 0.01, 0.0))
    cost = DecodeCost(
        [fit, fit],
        graph,
        items,
        groups,
        16 * 8,  # width 16, float64
        link=Link(latency=0.5, bandwidth=1e3),
        overheads=Overheads(send=0.25, recv=0.125, wait=0.0625),
        forward_overhead=0.03125,
    )
    assert cost.compute(Action(0, Kind.F, 1)) == pytest.approx(2.0 + 0.01 * 2 * 8 + 0.03125)
    assert cost.compute(Action(1, Kind.F, 2)) == pytest.approx(1.0 + 0.1 * 3 + 0.03125)
    hidden = Action(0, Kind.SEND_F, 2, 1)  # 3 rows x 1 token x 16 float64 + the done flag
    assert cost.message_bytes(hidden) == 3 * 16 * 8 + 1
    feedback = Action(0, Kind.RECV_F, 1, 1)  # group 1's two tokens
    assert cost.message_bytes(feedback) == 2 * 8 + 1
    assert cost.transfer(hidden) == pytest.approx(0.5 + (3 * 16 * 8 + 1) / 1e3)
    assert cost.overhead(hidden) == 0.25 and cost.overhead(feedback) == 0.125
    timeline = simulate(decode_program(graph, items), graph, cost)
    assert timeline.step_time > 4 * 2.0  # two prefills per rank, then decode steps


def test_parallelisms_on_paper_agree_on_one_device_and_split_memory() -> None:
    block = StageFit(decode=Fit(1e-4, 1e-3, 1e-8), prefill=Fit(1e-4, 1e-4, 1e-8))
    tiny = StageFit(decode=Fit(1e-5, 0.0, 0.0), prefill=Fit(1e-5, 0.0, 0.0))
    costs = LayerCosts(
        tiny,
        block,
        tiny,
        hidden_size=64,
        num_heads=4,
        dtype_bytes=4,
        block_params=1000,
        head_params=500,
    )
    link = Link(latency=1e-5, bandwidth=1e9)
    alone = {e.strategy: e for e in compare(costs, 8, link, [1], [256], new_tokens=5)}
    plain = 8 * block.prefill.time(1, 256, 0) + 2 * tiny.prefill.time(1, 256, 0)
    for result in alone.values():  # one device: nothing to split, nothing to send
        assert result.time_to_first_token == pytest.approx(plain, rel=0.05)
    found = compare(costs, 8, link, [2, 8], [256, 4096])
    assert {(e.strategy, e.devices) for e in found} == {
        (s, p) for s in ("pipeline", "context") for p in (2, 8)
    } | {("tensor", 2), ("pipeline x context", 8)}  # 4 heads: at most 4 devices of tensor
    for e in found:
        assert e.kv_bytes_per_device == 2 * 8 * (e.prompt + 16) * 64 * 4 / e.devices
        copies = {"context": e.devices, "pipeline x context": 2}.get(e.strategy, 1)
        assert e.weight_bytes_per_device == (8 * 1000 + 500) * 4 * copies / e.devices
    by = {(e.strategy, e.devices, e.prompt): e for e in found}
    # a long prompt: context parallelism divides the quadratic attention, as pipelines with
    # chunks do, and both beat tensor parallelism's two all-reduces per layer at 2 devices
    long = [by[(s, 8, 4096)].time_to_first_token for s in ("pipeline", "context")]
    assert max(long) < by[("pipeline", 2, 4096)].time_to_first_token


def test_all_reduces_and_exchanges_cost_what_their_own_links_say() -> None:
    block = StageFit(decode=Fit(1e-4, 1e-5, 1e-8), prefill=Fit(1e-4, 1e-5, 1e-8))
    tiny = StageFit(decode=Fit(1e-5, 0.0, 0.0), prefill=Fit(1e-5, 0.0, 0.0))
    costs = LayerCosts(tiny, block, tiny, 64, 4, 4, block_params=0, head_params=0)
    fast, slow = Link(latency=1e-6, bandwidth=1e10), Link(latency=1e-3, bandwidth=1e10)

    def per_token(strategy: str, links: list[tuple[Link, Link | None]]) -> list[float]:
        found = [
            estimate(strategy, costs, 8, p2p, 2, 1024, 9, collective=c)  # type: ignore[arg-type]
            for p2p, c in links
        ]
        return [1 / f.decode_tokens_per_s for f in found if f is not None]

    fast_tp, slow_tp, tp_slow_p2p = per_token("tensor", [(fast, fast), (fast, slow), (slow, fast)])
    # 2 all-reduces of 2 steps a layer, 1 after the head; no point-to-point message
    assert slow_tp - fast_tp == pytest.approx((8 * 2 + 1) * 2 * (1e-3 - 1e-6), rel=1e-3)
    assert tp_slow_p2p == pytest.approx(fast_tp)
    fast_cp, cp_slow_collective, slow_cp = per_token(
        "context", [(fast, fast), (fast, slow), (slow, fast)]
    )
    assert slow_cp - fast_cp == pytest.approx(8 * (1e-3 - 1e-6), rel=1e-3)  # an exchange a layer
    assert cp_slow_collective == pytest.approx(fast_cp)
    fast_pp, pp_slow_collective = per_token("pipeline", [(fast, fast), (fast, slow)])
    assert pp_slow_collective == pytest.approx(fast_pp)  # messages only
    assert pipeline_chunk(4096, 2) == 512 and pipeline_chunk(10, 3) == 1
    assert pipeline_chunk(4096, 1) is None  # one stage: nothing to overlap, the whole prompt


def test_tensor_overhead_costs_every_split_layer_and_is_recovered_from_a_split_profile() -> None:
    block = StageFit(decode=Fit(1e-3, 0.0, 1e-8), prefill=Fit(1e-4, 1e-5, 1e-8))
    tiny = StageFit(decode=Fit(1e-5, 0.0, 0.0), prefill=Fit(1e-5, 0.0, 0.0))
    costs = LayerCosts(tiny, block, tiny, 64, 4, 4, block_params=0, head_params=0)
    link = Link(latency=1e-4, bandwidth=1e9)
    # one layer split over 2 devices, as a profile would find it: the whole fixed cost, half
    # the attention, two all-reduces of 2 steps (64 float32 each) and 3 ms of dispatch
    reduce = 2 * (1e-4 + 64 * 4 / 2 / 1e9)
    split = Fit(1e-3 + 2 * reduce + 3e-3, 0.0, 0.5e-8)
    overhead = measured_overhead("tensor", costs, split, link, 2, [256, 1024, 4096])
    assert overhead == pytest.approx(3e-3)
    dearer = dataclasses.replace(costs, tensor_overhead=overhead)

    def per_token(strategy: str, layer_costs: LayerCosts) -> float:
        found = estimate(strategy, layer_costs, 8, link, 2, 1024, 9)  # type: ignore[arg-type]
        assert found is not None
        return 1 / found.decode_tokens_per_s

    assert per_token("tensor", dearer) - per_token("tensor", costs) == pytest.approx(8 * 3e-3)
    for strategy in ("pipeline", "context"):  # nothing is split by tensor parallelism there
        assert per_token(strategy, dearer) == pytest.approx(per_token(strategy, costs))
    faster = Fit(1e-3, 0.0, 0.5e-8)  # a split layer faster than the model: no negative cost
    assert measured_overhead("tensor", costs, faster, link, 2, [256]) == 0.0


def test_context_overhead_costs_every_cp_layer_at_decode_and_is_recovered_from_a_profile() -> None:
    block = StageFit(decode=Fit(1e-3, 0.0, 1e-8), prefill=Fit(1e-4, 1e-5, 1e-8))
    tiny = StageFit(decode=Fit(1e-5, 0.0, 0.0), prefill=Fit(1e-5, 0.0, 0.0))
    costs = LayerCosts(tiny, block, tiny, 64, 4, 4, block_params=0, head_params=0)
    link = Link(latency=1e-4, bandwidth=1e9)
    # one layer at cp = 2, as a profile would find it: the whole fixed cost, half the
    # attention, one exchange of a hidden vector (64 float32) and 0.4 ms of masking and merging
    split = Fit(1e-3 + (1e-4 + 64 * 4 / 1e9) + 4e-4, 0.0, 0.5e-8)
    overhead = measured_overhead("context", costs, split, link, 2, [256, 1024, 4096])
    assert overhead == pytest.approx(4e-4)
    dearer = dataclasses.replace(costs, context_overhead=overhead)

    def run(strategy: str, layer_costs: LayerCosts, devices: int = 2) -> tuple[float, float]:
        found = estimate(strategy, layer_costs, 8, link, devices, 1024, 9)  # type: ignore[arg-type]
        assert found is not None
        return found.time_to_first_token, 1 / found.decode_tokens_per_s

    assert run("context", dearer)[1] - run("context", costs)[1] == pytest.approx(8 * 4e-4)
    assert run("context", dearer)[0] == pytest.approx(run("context", costs)[0])  # decode only
    staged = run("pipeline x context", dearer, 4)[1] - run("pipeline x context", costs, 4)[1]
    assert staged == pytest.approx(8 * 4e-4)  # each stage's cp group pays it for its layers
    for strategy in ("pipeline", "tensor"):  # nothing is split along the sequence there
        assert run(strategy, dearer) == pytest.approx(run(strategy, costs))
    faster = Fit(1e-3, 0.0, 0.5e-8)
    assert measured_overhead("context", costs, faster, link, 2, [256]) == 0.0
