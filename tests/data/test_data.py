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


def test_replicas_share_each_global_batch_and_resume_at_another_count() -> None:
    data = TensorDataset(torch.arange(40))
    whole = ResumableLoader(data, batch_size=8, seed=2)
    expected = [b[0].tolist() for b, _ in zip(whole.forever(), range(8), strict=False)]
    shards = [ResumableLoader(data, 8, seed=2, num_replicas=2, replica=r) for r in (0, 1)]
    streams = [s.forever() for s in shards]
    seen = []
    for _ in range(3):  # replica 0's half, then replica 1's: the global batch, in order
        seen.append(next(streams[0])[0].tolist() + next(streams[1])[0].tolist())
    assert seen == expected[:3]
    state = shards[0].state_dict()
    assert state == shards[1].state_dict()  # the position counts global batches
    quarters = [ResumableLoader(data, 8, seed=2, num_replicas=4, replica=r) for r in range(4)]
    for quarter in quarters:  # resume at 4 replicas: the next global batches, split in four
        quarter.load_state_dict(state)
    rest = [q.forever() for q in quarters]
    for batch in expected[3:8]:  # into the second epoch: every sample once per epoch
        assert [i for r in rest for i in next(r)[0].tolist()] == batch
    with pytest.raises(ValueError, match="divisible by num_replicas"):
        ResumableLoader(data, 6, num_replicas=4, replica=0)
