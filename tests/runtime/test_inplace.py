"""In-place stage inputs (conveyor.runtime.inplace): a stage whose code writes an input in place
(nn.ReLU(inplace=True) right after a cut) gets copies, and trains as the unsplit model does."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import conveyor
from conveyor.runtime.inplace import modified_inputs
from conveyor.split import split_model


class Writes(nn.Module):
    """Writes its first input in place through a view, and only reads the second."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.view(-1).mul_(2)
        return x + y


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.writes = Writes()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.writes.forward(self.a(x), self.b(x))  # traced into: not a leaf module


def test_inputs_written_in_place_are_found_in_the_traced_stage() -> None:
    graph = split_model(Pair(), ["b"])
    assert graph.stages[1].inputs == ("x", "a")
    assert modified_inputs(graph.stages[1].module) == (1,)  # a, written through a view
    relu = split_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)), ["1"])
    assert modified_inputs(relu.stages[1].module) == (0,)
    plain = split_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), ["1"])
    assert modified_inputs(plain.stages[1].module) == ()


@pytest.mark.parametrize(
    ("schedule", "recompute"),
    [("graph-gpipe", "never"), ("graph-1f1b", "always"), ("0F0 1F0 1I0 0I0 1W0 0W0", "never")],
)
def test_a_stage_starting_with_an_in_place_layer_trains_like_the_whole_model(
    one_rank: None, tmp_path: Path, schedule: str, recompute: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.LeakyReLU(inplace=True)
    ).double()
    plain = copy.deepcopy(model)
    if " " in schedule:
        (tmp_path / "mine.txt").write_text(schedule)
        schedule = str(tmp_path / "mine.txt")
    pipe = conveyor.Pipeline(
        model,
        balance=(1, 3),
        placement=(0, 0),
        schedule=schedule,
        recompute=recompute,
        num_microbatches=1,
        loss_fn=F.mse_loss,
    )
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss = pipe.step(x, y)
    expected = F.mse_loss(plain(x), y)
    expected.backward()
    assert loss is not None
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    grads = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=1e-12, msg=name)
