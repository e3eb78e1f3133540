"""Balance by measured cost: the min-max split against the planner's, a heavy head alone, the
model untouched, costs kept (memory and disk), ranks agreeing, Hugging Face split points."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

import conveyor
from conveyor.planner import Workload, profile_model
from conveyor.planner.partition import StageCosts, bottleneck_split
from conveyor.split import balance as module
from conveyor.split.balance import (
    BalanceChoice,
    UnitCosts,
    balance_by_cost,
    min_max_balance,
    split_points_by_cost,
)
from dist import run_ranks

BUDGET_S = 0.3  # passes enough for a median that a preempted pass does not move
CLASSES = 8192


def heavy_head() -> nn.Sequential:
    """Six small layers and a wide output layer that costs more than all of them."""
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, CLASSES))


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def batch(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 32), torch.randint(0, CLASSES, (size,))


@pytest.fixture(autouse=True)
def _fresh_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "_MEMORY", {})


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # as a rank runs: two threads on a shared 2-core machine wait milliseconds for a core
    # between operations, which drowns the small layers' times
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def count_measures(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls: list[int] = []
    measure = module.measure_unit_costs

    def counted(*args: Any, **kwargs: Any) -> UnitCosts:
        calls.append(1)
        return measure(*args, **kwargs)

    monkeypatch.setattr(module, "measure_unit_costs", counted)
    yield calls


def _planner_bottleneck(costs: list[float], num_stages: int) -> float:
    """The worst stage of the planner's optimal split (conveyor.planner.partition)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    a, b = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    matrix = np.where(b > a, prefix[b] - prefix[a], np.inf)
    can_start = np.array([True] * n + [False])
    starts = bottleneck_split(lambda j: matrix, can_start, num_stages, [0] * num_stages)
    assert starts is not None
    return float(max(matrix[s, e] for s, e in itertools.pairwise([*starts, n])))


@pytest.mark.parametrize("seed", range(12))
def test_min_max_balance_matches_the_planners_bottleneck_and_is_most_even(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, num_stages = int(rng.integers(2, 10)), int(rng.integers(1, 5))
    num_stages = min(num_stages, n)
    costs = [float(c) for c in rng.exponential(size=n)]
    balance = min_max_balance(costs, num_stages)
    assert len(balance) == num_stages and sum(balance) == n and min(balance) >= 1
    times = UnitCosts(("",) * (n - 1), tuple(costs), (0.0,) * n).stage_times(balance)
    assert max(times) == pytest.approx(_planner_bottleneck(costs, num_stages))
    for cuts in itertools.combinations(range(1, n), num_stages - 1):  # brute force
        other = [b - a for a, b in itertools.pairwise([0, *cuts, n])]
        stages = UnitCosts(("",) * (n - 1), tuple(costs), (0.0,) * n).stage_times(other)
        if max(stages) <= max(times):
            assert sum(t * t for t in times) <= sum(t * t for t in stages) + 1e-12


def test_min_max_balance_leaves_a_heavy_head_alone_and_evens_the_rest() -> None:
    assert min_max_balance([1, 1, 1, 1, 1, 1, 9], 2) == [6, 1]
    assert min_max_balance([1, 1, 1, 1, 1, 1, 9], 3) == [3, 3, 1]
    assert min_max_balance([1, 1, 1, 1, 1, 1, 1, 1, 1, 12], 4) == [3, 3, 3, 1]


def test_with_stages_sharing_ranks_the_busiest_rank_is_balanced() -> None:
    # V placement: rank 0 holds stages 0 and 3, so stage 0 takes as little as it can
    costs = [2, 1, 1, 1, 1, 1, 1, 1, 1, 12]
    assert min_max_balance(costs, 4, placement=[0, 1, 1, 0]) == [1, 4, 4, 1]
    with pytest.raises(ValueError, match="give the rank of each stage"):
        min_max_balance(costs, 4, placement=[0, 1, 0])


def test_too_few_units_for_the_stages_is_refused() -> None:
    with pytest.raises(ValueError, match="every stage needs at least one layer"):
        min_max_balance([1.0, 2.0], 3)


def test_a_heavy_layer_gets_a_stage_of_its_own_as_the_planner_splits_it() -> None:
    model = heavy_head()
    x, y = batch()
    choice = balance_by_cost(
        model, 2, x, loss_fn=loss_fn, targets=y, num_microbatches=1, time_budget_s=BUDGET_S
    )
    assert choice.balance == (6, 1)
    assert choice.split_points == ("6",)
    assert choice.even == (4, 3)
    assert max(choice.stage_times) < max(choice.even_times)
    # the planner's own profile and optimal partition by time cut the same place
    profile = profile_model(
        Workload("heavy head", model, lambda n: (x[:n], y[:n]), loss_fn), [32], passes=1,
        min_time_s=0.005, min_repeats=2,
    )  # fmt: skip
    stage_costs = StageCosts(profile, 32, num_microbatches=1, batch_size=32)
    can_start = np.array([True] * profile.num_units + [False])
    starts = bottleneck_split(lambda j: stage_costs.time("never"), can_start, 2, [0, 0])
    assert starts == [0, 6]
    # three stages: the head still alone, the small layers evened out before it
    three = balance_by_cost(model, 3, x, loss_fn=loss_fn, targets=y, time_budget_s=BUDGET_S)
    assert three.balance[-1] == 1
    assert max(three.stage_times) == pytest.approx(_planner_bottleneck(list(three.costs.total), 3))
    assert not three.measured  # the same micro-batch: costs from memory


def test_the_log_line_states_the_choice_and_the_even_split() -> None:
    costs = UnitCosts(("1", "2"), (0.010, 0.010, 0.030), (0.010, 0.010, 0.0112))
    choice = BalanceChoice(
        (2, 1), ("2",), (0.04, 0.0412), (2, 1), (0.04, 0.0412), costs, measured=True
    )
    assert str(choice) == (
        "balance by measured cost: [2, 1] (predicted per-stage ms [40.0, 41.2]; "
        "even [2, 1]: [40.0, 41.2])"
    )


def test_measuring_leaves_the_model_as_it_was() -> None:
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Linear(16, 4)
    )
    model.eval()
    model[1].train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    before = copy.deepcopy(model.state_dict())
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    modes = [m.training for m in model.modules()]
    x = torch.randn(16, 8)
    rng = torch.get_rng_state()
    balance_by_cost(model, 2, x, time_budget_s=BUDGET_S)
    assert [m.training for m in model.modules()] == modes
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)  # running stats too
    for p, grad in zip(model.parameters(), grads, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, grad)
    assert torch.equal(torch.get_rng_state(), rng)


def test_costs_are_measured_once_per_process_and_kept_on_disk(
    count_measures: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = heavy_head()
    x, y = batch()
    options: dict[str, Any] = {
        "loss_fn": loss_fn, "targets": y, "num_microbatches": 2, "cache_dir": tmp_path,
        "time_budget_s": BUDGET_S,
    }  # fmt: skip
    first = balance_by_cost(model, 2, x, **options)
    second = balance_by_cost(copy.deepcopy(model), 2, x, **options)  # a second Pipeline
    assert count_measures == [1]
    assert first.measured and not second.measured
    assert second.balance == first.balance and second.costs == first.costs
    files = list(tmp_path.glob("unit-costs-*.json"))
    assert len(files) == 1 and not list(tmp_path.glob(".*"))  # renamed into place whole
    monkeypatch.setattr(module, "_MEMORY", {})  # a new process, the same cache directory
    third = balance_by_cost(model, 2, x, **options)
    assert count_measures == [1] and third.costs == first.costs
    # another micro-batch shape is another key; an unreadable file is measured again
    balance_by_cost(model, 2, x, **{**options, "num_microbatches": 4})
    assert count_measures == [1, 1]
    monkeypatch.setattr(module, "_MEMORY", {})
    files[0].write_text("{not json")
    balance_by_cost(model, 2, x, **options)
    assert count_measures == [1, 1, 1]
    assert json.loads(files[0].read_text())["starts"] == [str(i) for i in range(1, 7)]


def test_a_model_on_the_meta_device_is_refused() -> None:
    with torch.device("meta"):
        model = heavy_head()
    with pytest.raises(ValueError, match="on the meta device"):
        balance_by_cost(model, 2, torch.randn(4, 32, device="meta"))


def test_candidates_forward_does_not_call_in_that_order_are_refused() -> None:
    model = heavy_head()
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="in the order forward calls them"):
        split_points_by_cost(model, 2, x, candidates=["4", "2"], time_budget_s=0.0)
    with pytest.raises(ValueError, match="is not a submodule"):
        split_points_by_cost(model, 2, x, candidates=["2", "layers.9"], time_budget_s=0.0)
    with pytest.raises(ValueError, match="give at least 3 candidates"):
        split_points_by_cost(model, 3, x, candidates=["2", "4"], time_budget_s=0.0)


def test_hugging_face_split_points_by_cost_leave_the_head_alone() -> None:
    transformers = pytest.importorskip("transformers")
    from conveyor.hf.loss import model_loss

    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32768, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 32768, (4, 16))
    inputs = {"input_ids": ids, "labels": ids}
    before = copy.deepcopy(model.state_dict())
    choice = split_points_by_cost(
        model, 2, inputs, loss_fn=model_loss, num_microbatches=2, time_budget_s=BUDGET_S
    )
    assert choice.costs.starts == tuple(f"model.layers.{i}" for i in range(4))
    assert choice.split_points == ("model.layers.3",)  # the last layer, the norm, the head
    assert choice.balance == (4, 1)
    assert str(choice).startswith("split points by measured cost: ['model.layers.3']")
    assert "even ['model.layers.2']" in str(choice)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], msg=name)
    assert all(p.grad is None for p in model.parameters())


def _agree(rank: int, world_size: int, cache_dir: str) -> None:
    model = heavy_head()  # the same weights on every rank: the harness seeds 0
    x, y = batch()
    measure = module.measure_unit_costs

    def skewed(*args: Any, **kwargs: Any) -> UnitCosts:
        # rank 1 measures layer 0 as slower than the head; alone it would cut [1, 6]
        costs = measure(*args, **kwargs)
        if rank == 0:
            return costs
        forward = (10 * sum(costs.total), *costs.forward[1:])
        return UnitCosts(costs.starts, forward, costs.backward)

    module.measure_unit_costs = skewed  # type: ignore[assignment]
    group = dist.group.WORLD
    assert group is not None
    alone = balance_by_cost(model, 2, x, loss_fn=loss_fn, targets=y, time_budget_s=BUDGET_S)
    module._MEMORY.clear()
    choice = balance_by_cost(
        model, 2, x, loss_fn=loss_fn, targets=y, num_microbatches=2, group=group,
        cache_dir=cache_dir, time_budget_s=BUDGET_S,
    )  # fmt: skip
    choices: list[Any] = [None] * world_size
    dist.all_gather_object(choices, (alone.balance, choice.balance, choice.costs))
    assert choices[0][0] != choices[1][0], "the skew should make lone choices differ"
    assert choices[0][1:] == choices[1][1:], choices
    assert list(choice.balance) == min_max_balance(choice.costs.total, 2)
    again = balance_by_cost(
        model, 2, x, loss_fn=loss_fn, targets=y, num_microbatches=2, group=group,
        cache_dir=cache_dir, time_budget_s=BUDGET_S,
    )  # fmt: skip
    assert not again.measured and again.balance == choice.balance
    # a Pipeline given only its ranks (no group=: the world) agrees as well, skew and all
    module._MEMORY.clear()
    pipe = conveyor.Pipeline(model, example_inputs=x, num_microbatches=2, loss_fn=loss_fn)
    splits: list[Any] = [None] * world_size
    dist.all_gather_object(splits, pipe.split_points)
    assert splits[0] == splits[1], splits
    pipe.step(x, y)


@pytest.mark.dist
def test_ranks_agree_on_one_balance(tmp_path: Path) -> None:
    run_ranks(_agree, tmp_path, cache_dir=str(tmp_path / "costs"))


def _pipeline_default(rank: int, world_size: int) -> None:
    """Given only the ranks, a Pipeline with example inputs cuts by measured cost (here
    measured costs made up alike on every rank, so the choice is certain), and by count
    with balance='even' or without example inputs."""
    heavy = UnitCosts(
        tuple(str(i) for i in range(1, 7)),
        (0.001,) * 6 + (0.050,),
        (0.001,) * 6 + (0.050,),
    )
    module.measure_unit_costs = lambda *args, **kwargs: heavy  # type: ignore[assignment]
    x, y = batch()
    chosen = conveyor.Pipeline(heavy_head(), example_inputs=x, loss_fn=loss_fn)
    assert chosen.split_points == ("6",), chosen.split_points
    even = conveyor.Pipeline(heavy_head(), example_inputs=x, loss_fn=loss_fn, balance="even")
    assert even.split_points == ("4",)
    assert conveyor.Pipeline(heavy_head(), loss_fn=loss_fn).split_points == ("4",)
    torch.manual_seed(0)
    model = heavy_head()
    plain = copy.deepcopy(model)
    loss = conveyor.Pipeline(model, example_inputs=x, loss_fn=loss_fn).step(x, y)
    if loss is not None:
        torch.testing.assert_close(loss, loss_fn(plain(x), y))


@pytest.mark.dist
def test_a_pipeline_given_only_its_ranks_cuts_by_measured_cost(tmp_path: Path) -> None:
    run_ranks(_pipeline_default, tmp_path, 2, timeout_s=120)


def _choice(costs: tuple[float, ...], num_stages: int) -> BalanceChoice:
    units = UnitCosts(tuple(str(i) for i in range(1, len(costs))), costs, costs)
    balance = tuple(min_max_balance(units.total, num_stages))
    return BalanceChoice(
        balance, units.split_points(balance), units.stage_times(balance), balance,
        units.stage_times(balance), units, measured=True,
    )  # fmt: skip


def test_a_last_layer_heavier_than_a_balanced_stage_gets_advice() -> None:
    """A head outweighing half the model bounds every step whatever the cut: the choice says
    so and points at the vocabulary chunks; a lighter one gets no advice."""
    advice = _choice((1.0,) * 6 + (10.0,), 2).heavy_last_unit()
    assert advice is not None
    assert "takes 20000.0 ms" in advice and "(16000.0 ms)" in advice, advice
    assert "ChunkedCausalLM" in advice
    assert _choice((1.0,) * 6 + (6.0,), 2).heavy_last_unit() is None
