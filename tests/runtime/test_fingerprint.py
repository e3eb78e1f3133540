"""Batch fingerprints (conveyor.runtime.fingerprint): ranks given different batches, batch sizes
or modes fail together with the same message, before any activation moves."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from test_pipeline import check_step, tiny
from torch import nn

import conveyor
from conveyor.runtime.fingerprint import Fingerprint, fingerprint, initial_digest
from dist import run_ranks

CPU = torch.device("cpu")


def _of(inputs: dict[str, object], targets: object = None) -> Fingerprint:
    return fingerprint(inputs, targets, True, CPU, 4)


def test_equal_batches_agree_and_any_change_shows() -> None:
    x = torch.randn(4, 8)
    same = _of({"x": x.clone()}, x.clone())
    assert _of({"x": x}, x) == same
    assert _of({"x": x.flip(0)}, x).inputs != same.inputs, "samples reordered"
    assert _of({"x": x.roll(1, 1)}, x).inputs != same.inputs, "values moved within a sample"
    assert _of({"x": x}, x + 1).targets != same.targets
    assert _of({"x": x.double()}, x).layout != same.layout
    assert _of({"x": x, "scale": 0.5}, x).layout != same.layout
    bits = torch.tensor([[True, False]] * 4)
    assert _of({"m": bits}).inputs != _of({"m": ~bits}).inputs  # every dtype, by its bytes
    assert _of({"e": torch.empty(4, 0)}).inputs == _of({"e": torch.empty(4, 0)}).inputs
    sliced = torch.randn(33)[1:33].view(4, 8)  # 4 bytes into its storage
    assert _of({"x": sliced}) == _of({"x": sliced.clone()})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _of({"x": x}, x).mode != same.mode


class Scale(nn.Module):
    """A parameter and no reset_parameters(): nothing initializes it on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _different_batches(rank: int, world_size: int) -> None:
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    model = tiny(4, dropout=0.0)
    pipe = conveyor.Pipeline(copy.deepcopy(model), num_microbatches=2, loss_fn=F.mse_loss)
    other = 1 - rank
    cases = [  # what rank 1 is given instead, and what both ranks are told
        ((x + rank, y), "the model inputs hold different values"),
        ((x, y * (1 + rank)), "the targets hold different values"),
        ((x[: 8 - 2 * rank], y[: 8 - 2 * rank]), f"a batch of {8 - 2 * rank} samples here"),
    ]  # (a batch size that differs made gloo abort the process before)
    for (xr, yr), message in cases:
        with pytest.raises(ValueError, match=f"rank {other} was given another batch.*{message}"):
            pipe.step(xr, yr)
    what = "step 0" if rank == 0 else r"a forward\(\) call"
    with pytest.raises(ValueError, match=f"rank {rank}: rank {other} runs {what} in another"):
        pipe.step(x, y) if rank == 0 else pipe.forward(x)
    with torch.device("meta"):
        built = tiny(4, dropout=0.0)
        built[5] = Scale()  # on rank 1
    unready = conveyor.Pipeline(built, num_microbatches=2, loss_fn=F.mse_loss)
    unready.load_state_dict(model.state_dict(), strict=False)
    message = r"\[5.weight\] were built on the meta device" if rank else "rank 1 cannot run"
    with pytest.raises(RuntimeError, match=message):
        unready.step(x, y)
    check_step(pipe, model, x, y, F.mse_loss, atol=1e-12)  # nothing above left a message


@pytest.mark.dist
def test_ranks_given_different_batches_fail_together(tmp_path: Path) -> None:
    run_ranks(_different_batches, tmp_path, 2, timeout_s=60)


def _linears(seed: int, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)])


def test_the_initial_digest_tells_two_seeds_apart_and_skips_the_meta_device() -> None:
    assert initial_digest([_linears(0)]) == initial_digest([_linears(0)]) != 0
    assert initial_digest([_linears(0)]) != initial_digest([_linears(1)])
    model = _linears(0)
    assert initial_digest([model, model[0]]) == initial_digest([model])  # each tensor once
    with torch.device("meta"):
        assert initial_digest([nn.Linear(8, 8)]) == 0  # nothing to compare
    torch.manual_seed(1)
    ones = initial_digest([Scale()])
    torch.manual_seed(2)
    assert initial_digest([Scale()]) == ones  # values no seed draws are alike anyway


def _seeded_apart(rank: int, world_size: int) -> None:
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("conveyor.runtime.fingerprint").addHandler(handler)
    conveyor.Pipeline(_linears(seed=rank), num_microbatches=2, loss_fn=F.mse_loss)
    if rank == 0:  # the group's rank 0 says it, once
        (message,) = warnings
        assert "ranks [0] built one, ranks [1] another" in message
        assert "ranks seeded differently (torch.manual_seed(rank)) build different" in message
        assert "Seed every rank alike before building the model" in message
    assert len(warnings) == (1 if rank == 0 else 0)
    warnings.clear()
    conveyor.Pipeline(_linears(seed=0), num_microbatches=2, loss_fn=F.mse_loss)
    with torch.device("meta"):  # each rank materializes its own stages: nothing to compare
        built = _linears(seed=rank)
    conveyor.Pipeline(built, num_microbatches=2, loss_fn=F.mse_loss)
    assert warnings == []


@pytest.mark.dist
def test_ranks_seeded_apart_are_warned_that_their_stages_come_from_other_models(
    tmp_path: Path,
) -> None:
    run_ranks(_seeded_apart, tmp_path, 2, timeout_s=60)
