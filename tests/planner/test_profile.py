"""The profiler: units of a traced model, what autograd keeps, files, interpolation."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor.models.unbalanced import MLPBlock
from conveyor.planner import (
    Link,
    Overheads,
    Profile,
    UnitStats,
    Workload,
    plan,
    profile_model,
    trace_units,
)
from conveyor.split import auto_split


def _model() -> nn.Sequential:
    frozen = nn.Linear(16, 4).double()
    frozen.requires_grad_(False)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 16)), nn.Tanh(), frozen
    ).double()


def _workload(model: nn.Module) -> Workload:
    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 8, dtype=torch.float64), torch.randn(size, 4, dtype=torch.float64)

    return Workload("tiny", model, batch, lambda out, target: ((out - target) ** 2).mean())


def test_units_open_nested_sequentials_and_keep_other_modules_whole() -> None:
    _, _, units = trace_units(_model())
    assert [(u.target, u.inputs) for u in units] == [
        ("0", (-1,)),
        ("1.0", (0,)),
        ("1.1", (1,)),
        ("2", (2,)),
        ("3", (3,)),
    ]
    assert [u.param_bytes for u in units] == [
        8 * (8 * 16 + 16),
        0,
        8 * (16 * 16 + 16),
        0,
        8 * (16 * 4 + 4),
    ]
    assert units[4].trainable_bytes == 0 and units[0].trainable_bytes == units[0].param_bytes


def test_deeper_units_go_inside_custom_layers() -> None:
    model = nn.Sequential(MLPBlock(4, 8), MLPBlock(4, 8))
    assert [u.target for u in trace_units(model)[2]] == ["0", "1"]
    deeper = trace_units(model, depth=2)[2]
    assert [u.target for u in deeper] == [
        "0.norm",
        "0.fc1",
        "0.act",
        "0.fc2",
        "",
        "1.norm",
        "1.fc1",
        "1.act",
        "1.fc2",
        "",
    ]
    assert deeper[4].inputs == (-1, 3)  # the residual add takes the block input and fc2


def test_profile_records_what_autograd_keeps_as_the_meter_counts_it() -> None:
    profile = profile_model(_workload(_model()), [5], min_time_s=0.0, min_repeats=2)
    linear, relu, linear2, tanh, frozen = profile.stats[5]
    activation = 5 * 16 * 8  # 5 samples x 16 float64 values
    # nn.Linear keeps its input (the model input here) and nothing else of its own
    assert (linear.saved_bytes, linear.output_bytes, linear.saves_input, linear.saves_output) == (
        0,
        activation,
        (True,),
        False,
    )
    assert relu.saves_output and not relu.saves_input[0] and relu.saved_bytes == 0
    assert linear2.saves_input == (True,) and tanh.saves_output
    assert frozen.output_bytes == frozen.message_bytes == 5 * 4 * 8
    # a frozen layer after the last trainable one needs no weight gradient
    assert linear.weight_grad_bytes > 0 and linear.backward > 0
    assert all(s.forward > 0 for s in profile.stats[5])
    assert profile.input_bytes_per_sample == 8 * 8 and profile.depth == 1
    assert profile.loss[5][0] > 0 and profile.loss[5][1] > 0


def test_profiles_round_trip_through_json_and_check_their_model(tmp_path: Path) -> None:
    profile = profile_model(_workload(_model()), [2, 4], min_time_s=0.0, min_repeats=1)
    profile.overheads = Overheads(forward=1e-4, send=2e-5)
    profile.link = Link(latency=5e-5, bandwidth=1e9)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    profile.check(trace_units(_model())[2])
    with pytest.raises(ValueError, match=r"does not match the model.*first difference at unit 1"):
        profile.check(trace_units(nn.Sequential(nn.Linear(8, 16), nn.Tanh()).double())[2])
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a conveyor profile"):
        Profile.load(tmp_path / "bad.json")


def test_sizes_between_measured_ones_are_interpolated() -> None:
    def stats(value: float) -> tuple[UnitStats, ...]:
        return (
            UnitStats(
                value,
                2 * value,
                value,
                value,
                int(100 * value),
                int(10 * value),
                (True,),
                False,
                int(10 * value),
            ),
        )

    profile = Profile(
        "p",
        trace_units(nn.Sequential(nn.Linear(2, 2)))[2],
        {2: stats(1.0), 6: stats(3.0)},
        {2: (1.0, 2.0), 6: (3.0, 6.0)},
        8,
    )
    middle = profile.at(4)[0]
    assert (middle.forward, middle.backward, middle.saved_bytes) == (2.0, 4.0, 200)
    assert profile.at(8)[0].forward == pytest.approx(4.0)  # extrapolated along the line
    assert profile.loss_at(4) == (2.0, 4.0)
    assert profile.at(6) is profile.stats[6]


def test_profile_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="positive sample counts"):
        profile_model(_workload(_model()), [0])


class Delay(nn.Module):
    """torchgpipe's benchmark layer: sleeps; every delay has the same repr and shapes."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x * self.scale


def test_every_layer_is_timed_so_balance_by_time_sees_each_delay() -> None:
    model = nn.Sequential(*(Delay(0.002 * i) for i in range(1, 7)))
    workload = _workload_8(model)
    profile = profile_model(workload, [2], min_time_s=0.0, min_repeats=3, passes=1)
    forwards = [s.forward for s in profile.stats[2]]
    assert forwards[-1] > 3 * forwards[0], f"each Delay timed for itself: {forwards}"
    report = plan(
        workload,
        num_ranks=2,
        memory_budget=2**30,
        batch_size=4,
        profile=profile,
        schedules=["gpipe"],
        microbatches=[2],
        objectives=("time",),
        recompute=False,
    )
    assert report.best.balance == (4, 2)  # torchgpipe's balance_by_time answer


def test_the_plan_time_budget_does_not_include_profiling() -> None:
    workload = _workload_8(nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))).double())

    def slow_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.2)  # profiling takes longer than the whole time budget
        return workload.batch(size)

    slow = Workload("slow", workload.model, slow_batch, workload.loss_fn)
    report = plan(slow, 2, 2**30, 4, schedules=["1f1b"], microbatches=[2], time_budget_s=0.1)
    assert report.elapsed_s > 0.2
    assert report.plans and not any("time budget" in note for note in report.notes)


def test_a_model_input_is_no_layer_output() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))).double()
    profile = profile_model(_workload_8(model), [4], min_time_s=0.0, min_repeats=2)
    first, second, _ = profile.stats[4]
    assert first.backward_input < second.backward_input or first.backward_input == 0.0


def test_measuring_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8)
    ).double()
    model.eval()
    model[0].train()  # a mix of modes
    model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()  # .grad the user holds
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    grads = [p.grad for p in model.parameters()]
    example = torch.randn(4, 8, dtype=torch.float64)
    rng = torch.get_rng_state()
    profile_model(_workload_8(model), [4], min_time_s=0.0, min_repeats=1, passes=1)
    auto_split(model, 2, example_inputs=example)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "running stats unchanged"
    assert [m.training for m in model.modules()] == modes
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    assert torch.equal(torch.get_rng_state(), rng), "the random stream is the user's"


def _workload_8(model: nn.Module) -> Workload:
    def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 8, dtype=torch.float64), torch.randn(size, 8, dtype=torch.float64)

    return Workload("linear", model, batch, lambda out, target: ((out - target) ** 2).mean())
