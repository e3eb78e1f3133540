"""Input gradients (conveyor.runtime.input_grads): a model input that stages on several ranks
read gets its whole gradient on the rank where it enters the model, as plain training gives."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from test_pipeline import reference
from torch import nn

import conveyor
from dist import run_ranks

pytestmark = pytest.mark.dist


class Around(nn.Module):
    """A residual around the cut before ``b``, and a bias input every stage reads whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) + bias)
        return self.b(h) * bias + x


def _gathered(rank: int, world_size: int) -> None:
    for schedule, recompute in (("1f1b", "never"), ("zb-h1", "always")):
        torch.manual_seed(0)
        model = Around().double()
        pipe = conveyor.Pipeline(
            copy.deepcopy(model),
            split_points=["b"],
            schedule=schedule,
            recompute=recompute,
            num_microbatches=2,
            loss_fn=F.mse_loss,
        )
        x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(8, dtype=torch.float64, requires_grad=True)  # not split: whole
        y = torch.randn(6, 8, dtype=torch.float64)
        pipe.step((x, bias), y)
        plain_x, plain_bias = x.detach().requires_grad_(), bias.detach().requires_grad_()
        reference(functools.partial(model, bias=plain_bias), plain_x, y, 2, F.mse_loss)
        if rank == 0:  # where x and bias enter the model: every stage's share
            torch.testing.assert_close(x.grad, plain_x.grad, rtol=0, atol=1e-12)
            torch.testing.assert_close(bias.grad, plain_bias.grad, rtol=0, atol=1e-12)
        else:  # the other rank's copies are left alone
            assert x.grad is None and bias.grad is None
        grads = dict(model.named_parameters())
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=1e-12, msg=name)


def test_input_gradients_gather_where_the_input_enters(tmp_path: Path) -> None:
    run_ranks(_gathered, tmp_path, 2, timeout_s=90)
