"""The interpreter (conveyor.runtime.interpreter) on its own: one process holding every stage,
so local edges, split backward and recomputation run without peers; gradients equal plain
training's."""

from __future__ import annotations

import copy
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from conveyor.runtime import microbatch
from conveyor.runtime.comm import P2P
from conveyor.runtime.interpreter import Runtime, StepInputs
from conveyor.schedule import build_program
from conveyor.split import bind_inputs, split_model

CPU = torch.device("cpu")


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


# three stages on rank 0: every edge is local; I and W split one stage's backward
@pytest.mark.parametrize(
    ("schedule", "recompute"),
    [
        ("graph-gpipe", "never"),
        ("graph-1f1b", "always"),
        ("0F0 1F0 2F0 0F1 1F1 2F1 2I0 2W0 1I0 0I0 1W0 0W0 2B1 1B1 0B1", "except_last"),
    ],
)
def test_one_rank_with_every_stage_computes_plain_gradients(
    one_rank: None, tmp_path: Path, schedule: str, recompute: str
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)), nn.Dropout(0.0)
    ).double()
    plain = copy.deepcopy(model)
    graph = split_model(model, ["2", "4"], placement=[0, 0, 0])
    if " " in schedule:  # a schedule as text
        path = tmp_path / "mine.txt"
        path.write_text(schedule)
        schedule = str(path)
    program = build_program(schedule, graph.topology(), num_microbatches=2)
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    runtime = Runtime(
        graph,
        0,
        P2P(None, CPU, timedelta(seconds=5)),
        CPU,
        _loss,
        recompute,
        seed=0,
        measure_memory=False,
    )  # type: ignore[arg-type]
    chunks = microbatch.split(bind_inputs(model, x), 2)
    step = StepInputs(chunks, ["s", "s"], microbatch.split(y, 2), [0.5, 0.5], 0, True)
    state = runtime.run(program[0], step)
    loss = sum(_loss(plain(xk), yk) * 0.5 for xk, yk in zip(x.chunk(2), y.chunk(2), strict=True))
    loss.backward()  # type: ignore[union-attr]
    torch.testing.assert_close(sum(state.losses.values()), loss.detach())
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)
