"""Resumable data order (conveyor.data): seeded epochs, mid-epoch resume, each sample once."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from conveyor.data import ResumableLoader, epoch_order


def test_loader_resumes_mid_epoch_with_the_same_batches() -> None:
    data = TensorDataset(torch.arange(50))
    reference = ResumableLoader(data, batch_size=4, seed=3)
    expected = [b[0].tolist() for b, _ in zip(reference.forever(), range(30), strict=False)]
    first = ResumableLoader(data, batch_size=4, seed=3)
    batches = first.forever()
    seen = [next(batches)[0].tolist() for _ in range(17)]  # into the second epoch (12 a epoch)
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    assert (state["epoch"], state["batch_index"]) == (1, 5)
    resumed = ResumableLoader(data, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    rest = resumed.forever()
    seen += [next(rest)[0].tolist() for _ in range(13)]
    assert seen == expected


def test_loader_uses_each_sample_once_per_epoch_across_a_resume() -> None:
    data = TensorDataset(torch.arange(20))
    loader = ResumableLoader(data, batch_size=3, seed=1)  # 6 batches, 2 samples dropped
    first = [next(iter(loader))[0] for _ in range(1)]
    state = loader.state_dict()
    resumed = ResumableLoader(data, batch_size=3, seed=1)
    resumed.load_state_dict(state)
    used = torch.cat(first + [b[0] for b in resumed]).tolist()
    assert len(used) == len(set(used)) == 18
    assert used == epoch_order(20, 0, seed=1)[:18]
    assert (resumed.epoch, resumed.batch_index) == (1, 0)
    assert epoch_order(20, 1, seed=1) != epoch_order(20, 0, seed=1)


def test_loader_refuses_a_position_from_other_batching() -> None:
    data = TensorDataset(torch.arange(20))
    state = ResumableLoader(data, batch_size=4).state_dict()
    with pytest.raises(ValueError, match="batch_size 4 -> 5"):
        ResumableLoader(data, batch_size=5).load_state_dict(state)
    with pytest.raises(ValueError, match="gives no batch"):
        ResumableLoader(data, batch_size=64)
