"""DeferredBatchNorm: running statistics of the whole mini-batch, counted once under
recomputation, same parameters, buffers and state_dict keys as the BatchNorm it replaces."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conveyor.runtime.batchnorm import DeferredBatchNorm, recompute_context


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("recompute", [False, True])
def test_running_statistics_are_the_mini_batchs(momentum: float | None, recompute: bool) -> None:
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum)).double()
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain), num_microbatches=3)
    assert isinstance(deferred[1], DeferredBatchNorm)
    for _ in range(3):
        x = torch.randn(10, 3, dtype=torch.float64)  # micro-batches of 4, 3 and 3 samples
        plain(x)
        for chunk in torch.tensor_split(x, 3):
            out = (
                checkpoint(deferred, chunk, use_reentrant=False, context_fn=recompute_context)
                if recompute
                else deferred(chunk)
            )
            out.sum().backward()  # recomputes the forward when checkpointed
    for name, value in plain[1].state_dict().items():
        torch.testing.assert_close(deferred[1].state_dict()[name], value, rtol=0, atol=1e-12)
    assert plain.state_dict().keys() == deferred.state_dict().keys()


def test_normalizes_each_micro_batch_by_its_own_statistics() -> None:
    bn = nn.BatchNorm2d(4).double()
    deferred = DeferredBatchNorm.convert(copy.deepcopy(bn), num_microbatches=2)
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    for chunk in x.chunk(2):
        torch.testing.assert_close(deferred(chunk), copy.deepcopy(bn)(chunk))
    bn(x)
    torch.testing.assert_close(deferred.running_var, bn.running_var)
    deferred.eval()
    bn.eval()
    torch.testing.assert_close(deferred(x), bn(x))  # eval: the running statistics


def test_shares_parameters_and_buffers() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))
    weight, mean = model[1].weight, model[1].running_mean
    converted = DeferredBatchNorm.convert(model, num_microbatches=4)
    assert converted is model and model[1].weight is weight and model[1].running_mean is mean
    assert (
        DeferredBatchNorm.convert(nn.BatchNorm1d(3, track_running_stats=False), 2).__class__
        is nn.BatchNorm1d
    )
    with pytest.raises(ValueError, match=r"expects \(N, 2, ...\)"):
        model[1](torch.randn(2, 3, 4, 4))
