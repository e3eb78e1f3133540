"""Tied parameters: found by identity or declared by name; on real ranks, their gradients
summed over every holder (accumulating, identical bits), and no memory kept per step."""

from __future__ import annotations

import copy
import ctypes
import gc
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import conveyor
from conveyor.graph import place
from conveyor.models import gpt
from conveyor.runtime.tied import Tie, find_ties
from conveyor.split import balance_to_split_points, split_model
from dist import run_ranks


def split(model: nn.Sequential, balance: list[int], num_ranks: int = 2):  # type: ignore[no-untyped-def]
    return split_model(
        model, balance_to_split_points(model, balance), place(len(balance), num_ranks)
    )


def test_the_same_parameter_in_two_stages_is_a_tie() -> None:
    graph = split(gpt(num_layers=2, tie_embeddings=True), [2, 2])
    ties = find_ties(graph)
    assert ties == [Tie(((0, "0.tokens.weight"), (1, "3.out.weight")))]
    assert ties[0].ranks(graph) == [0, 1] and ties[0].name == "0.tokens.weight"
    assert find_ties(split(gpt(num_layers=2), [2, 2])) == []
    assert find_ties(split(gpt(num_layers=2, tie_embeddings=True), [4], 1)) == []  # one stage


def test_declared_ties_merge_with_found_ones() -> None:
    graph = split(gpt(num_layers=2), [1, 1, 1, 1])
    ties = find_ties(graph, ["0.tokens.weight, 3.out.weight"])
    assert ties == [Tie(((0, "0.tokens.weight"), (3, "3.out.weight")))]
    assert ties[0].ranks(graph) == [0, 1]
    with pytest.raises(ValueError, match="which no stage holds"):
        find_ties(graph, ["0.tokens.weight,3.nothing"])
    with pytest.raises(ValueError, match="mixes shapes"):
        find_ties(graph, ["0.tokens.weight,3.norm.weight"])


# -- on real ranks ---------------------------------------------------------------------------


def three_way_tie() -> nn.Sequential:
    """Three Linear layers of one weight (float64): a tie across three ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    return model.double()


def _three_ranks(rank: int, world_size: int, warmup: int, steps: int) -> None:
    model = three_way_tie()
    plain = copy.deepcopy(model)
    plain[2].weight = plain[4].weight = plain[0].weight  # what the declaration means
    with torch.no_grad():  # different starting copies: the first stage's value wins
        model[2 * rank].weight.add_(rank)
    pipe = conveyor.Pipeline(
        model,
        balance=[2, 2, 1],
        tie_weights=("0.weight,2.weight,4.weight",),
        loss_fn=F.mse_loss,
        num_microbatches=3,
        schedule="1f1b",
    )
    assert pipe.ties.max_difference() == 0.0
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    for _ in range(2):  # without zero_grad: the second step adds to the first's gradients
        pipe.step(x, y)
        F.mse_loss(plain(x), y).backward()
        expected = dict(plain.named_parameters(remove_duplicate=False))
        for name, param in pipe.named_parameters():
            torch.testing.assert_close(param.grad, expected[name].grad, rtol=0, atol=1e-12)
    (tied,) = pipe.ties.params
    assert tied.ranks == (0, 1, 2) and tied.peers(rank) == [r for r in range(3) if r != rank]
    grad = tied.param.grad
    with pytest.raises(RuntimeError, match="lost in the step"), pipe.ties.summing_gradients():
        raise RuntimeError("lost in the step")
    assert tied.param.grad is grad  # put back, nothing exchanged
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    optimizer.step()
    assert pipe.ties.max_difference() == 0.0  # every rank summed to the same bits
    growth = _heap_growth(pipe, optimizer, x, y, warmup, steps)
    # an all_reduce per step kept 550-1,700 bytes (the flight recorder's entries); sent as
    # messages, under 20 (60 steps, measured): See Note [no collective per step]
    assert growth < 200, f"rank {rank}: the native heap grew {growth:.0f} bytes per step"
    _frozen_on_one_rank(pipe, rank, x, y)


def _frozen_on_one_rank(
    pipe: conveyor.Pipeline, rank: int, x: torch.Tensor, y: torch.Tensor
) -> None:
    """A tie frozen on rank 1 only is refused on every rank, before the step; frozen on
    every rank, it trains no more and its copies stay equal."""
    (tied,) = pipe.ties.params
    tied.param.requires_grad_(rank != 1)
    with pytest.raises(
        ValueError, match=r"frozen on rank\(s\) \[1\] and requires gradients on rank\(s\) \[0, 2\]"
    ):
        pipe.step(x, y)
    tied.param.requires_grad_(False)
    before = tied.param.detach().clone()
    pipe.step(x, y)  # the pipeline is still usable: the refusal came before any message
    torch.optim.SGD(pipe.parameters(), lr=0.01).step()
    assert torch.equal(tied.param, before) and pipe.ties.max_difference() == 0.0


def _heap_growth(
    pipe: conveyor.Pipeline,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    warmup: int,
    steps: int,
) -> float:
    """Native heap bytes in use kept per training step, after ``warmup`` steps."""
    readings = []
    for step in range(warmup + steps + 1):
        if step in (warmup, warmup + steps):
            gc.collect()
            readings.append(heap_in_use())
        pipe.step(x, y)
        optimizer.step()
        optimizer.zero_grad()
    return (readings[1] - readings[0]) / steps


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2.split()]


def heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (the native heap in use)."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


@pytest.mark.dist
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
def test_a_tie_over_three_ranks_sums_accumulates_and_keeps_no_memory(tmp_path: Path) -> None:
    run_ranks(_three_ranks, tmp_path, world_size=3, timeout_s=90, warmup=20, steps=60)
