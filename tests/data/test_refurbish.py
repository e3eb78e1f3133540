"""Refurbish (conveyor.data.refurbish): reuse of partially augmented samples, fresh final
augmentation per use, bounded cache, worker processes, exact resume, replicas, errors."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import conveyor
from conveyor.checkpoint import Checkpointer
from conveyor.data import Refurbish, ResumableLoader, broadcast_batches, synthetic_images
from conveyor.data.reuse import ReuseOrder
from dist import run_ranks

CALLS: Counter[int] = Counter()


def _noisy(sample: tuple[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """A partial transform that counts its calls (in this process) and draws randomness."""
    index = int(sample[0])
    CALLS[index] += 1
    return sample[0] + torch.rand(3), index


def _jitter(sample: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """A final transform: fresh randomness on every use."""
    values, index = sample
    return values * torch.rand(1) + torch.randn(3), index


def _shift(batch: list[Any]) -> list[Any]:
    """A batch_final transform: one random draw per row."""
    values, indices = batch
    return [values + torch.rand(len(values), 1), indices]


def _data(num_samples: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(num_samples).float())


def _take(loader: Refurbish | ResumableLoader, count: int) -> list[Any]:
    batches = loader.forever()
    return [next(batches) for _ in range(count)]


def _assert_same(got: list[Any], expected: list[Any]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


class _Fresh(Dataset[Any]):
    """Every sample augmented afresh when read, as a plain loader's dataset would do it."""

    def __init__(self, loader: Refurbish) -> None:
        self.loader, self.epoch = loader, 0

    def __len__(self) -> int:
        return self.loader.num_samples

    def __getitem__(self, index: int) -> Any:
        return self.loader.sample(self.epoch, index)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_reuse_1_gives_the_resumable_loaders_batches_bitwise(num_replicas: int) -> None:
    for replica in range(num_replicas):
        refurbish = Refurbish(
            _data(), 8, partial=_noisy, final=_jitter, seed=3, num_replicas=num_replicas,
            replica=replica, cache_bytes=2**12,
        )  # fmt: skip
        fresh = _Fresh(refurbish)
        plain = ResumableLoader(fresh, 8, seed=3, num_replicas=num_replicas, replica=replica)
        expected = []
        for epoch in range(2):  # each epoch's samples augmented with that epoch's seeds
            fresh.epoch = epoch
            expected += list(plain)
        assert len(refurbish) == len(plain) == 5
        _assert_same(_take(refurbish, 10), expected)
    untouched = Refurbish(_data(), 8, seed=3)  # no transforms: the samples themselves
    plain_batches = _take(ResumableLoader(_data(), 8, seed=3), 10)
    for got, want in zip(_take(untouched, 10), plain_batches, strict=True):
        assert torch.equal(got[0], want[0])


def test_partial_runs_once_per_reuse_uses_and_final_differs_per_use() -> None:
    loader = Refurbish(_data(), 4, partial=_noisy, final=_jitter, reuse=3, seed=1)
    CALLS.clear()  # the constructor measured one sample
    batches = list(loader)
    assert len(batches) == 30 and (loader.epoch, loader.batch_index) == (1, 0)
    assert Counter(range(40)) == CALLS  # every sample once, for its three uses
    uses: dict[int, list[torch.Tensor]] = {}
    for values, indices in batches:
        assert len(set(indices.tolist())) == 4  # the uses of a sample are in other batches
        for row, index in enumerate(indices.tolist()):
            uses.setdefault(index, []).append(values[row])
    assert sorted(len(u) for u in uses.values()) == [3] * 40
    for index, (first, second, third) in uses.items():
        assert not torch.equal(first, second) and not torch.equal(second, third)
        for use, value in enumerate((first, second, third)):  # drawn from the seeds alone
            assert torch.equal(loader.sample(0, index, use)[0], value)
    again = Refurbish(_data(), 4, partial=_noisy, final=_jitter, reuse=3, seed=1)
    _assert_same(list(again), batches)
    other = Refurbish(_data(), 4, partial=_noisy, final=_jitter, reuse=3, seed=2)
    assert not torch.equal(next(iter(other))[0], batches[0][0])


@pytest.mark.parametrize(("reuse", "window"), [(2, 1), (3, 2), (4, 3), (3, 5)])
def test_each_sample_is_used_reuse_times_an_epoch_never_twice_in_a_batch(
    reuse: int, window: int
) -> None:
    for num_replicas in (1, 2):
        shares = []
        for replica in range(num_replicas):
            order = ReuseOrder(44, 4, reuse, window, 7, True, num_replicas, replica)
            assert order.num_batches == reuse * 11
            uses = [order.uses(1, b) for b in range(order.num_batches)]
            for batch in uses:
                assert len({u.sample for u in batch}) == len(batch) == 4 // num_replicas
            by_sample: dict[int, list[int]] = {}
            for batch in uses:
                for use in batch:
                    by_sample.setdefault(use.sample, []).append(use.use)
            assert all(sorted(u) == list(range(reuse)) for u in by_sample.values())
            shares.append(set(by_sample))
        assert len(set().union(*shares)) == sum(len(s) for s in shares) == 44  # disjoint


def test_echo_reuses_the_finished_sample_and_refurbish_does_not() -> None:
    for batch_final in (None, _shift):
        finished: dict[bool, dict[int, list[torch.Tensor]]] = {}
        for echo in (False, True):
            loader = Refurbish(
                _data(24), 4, partial=_noisy, final=_jitter, batch_final=batch_final,
                reuse=3, echo=echo, seed=5,
            )  # fmt: skip
            uses: dict[int, list[torch.Tensor]] = {}
            for values, indices in loader:
                for row, index in enumerate(indices.tolist()):
                    uses.setdefault(index, []).append(values[row])
            finished[echo] = uses
        for index, values in finished[True].items():
            assert all(torch.equal(values[0], v) for v in values[1:])  # identical reuses
            assert torch.equal(values[0], finished[False][index][0])  # the same first use
            assert not torch.equal(finished[False][index][0], finished[False][index][1])


def test_augmenting_leaves_the_global_generators_alone() -> None:
    states = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    loader = Refurbish(_data(), 4, partial=_noisy, final=_jitter, batch_final=_shift, reuse=2)
    _take(loader, 25)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (numpy.random.get_state()[1] == states[2]).all()


def test_the_cache_holds_at_most_cache_bytes() -> None:
    loader = Refurbish(_data(), 4, partial=_noisy, reuse=3, cache_bytes=12 * 16, seed=2)
    assert loader.sample_bytes == 12 + 8 and loader.window == 1  # 3 float32, and an int
    list(loader)
    assert 0 < loader.stats.peak_bytes <= 12 * 16 and loader.stats.over_bound == 0


def _positions(loader: Refurbish) -> list[int]:
    """Stop points: mid-round-0, mid-round-1, in the last round, at a window's end."""
    windows = loader.order.windows
    first, size = windows[1]
    start = first * loader.reuse
    return [1, start + 1, start + size + 1, start + (loader.reuse - 1) * size + 1, start - 1]


@pytest.mark.parametrize("echo", [False, True])
def test_a_position_resumes_the_same_batches_bitwise(echo: bool) -> None:
    options: dict[str, Any] = {
        "partial": _noisy, "final": _jitter, "batch_final": _shift, "reuse": 3, "echo": echo,
        "cache_bytes": 20 * 12, "seed": 4,
    }  # fmt: skip
    reference = Refurbish(_data(), 4, **options)
    expected = _take(reference, 45)  # into the second epoch (30 batches an epoch)
    assert len(reference.order.windows) > 2
    for stop in [*_positions(reference), 30, 33]:
        first = Refurbish(_data(), 4, **options)
        seen = _take(first, stop)
        state = json.loads(json.dumps(first.state_dict()))  # plain data
        resumed = Refurbish(_data(), 4, **options)
        resumed.load_state_dict(state)
        _assert_same(seen + _take(resumed, 45 - stop), expected)


def test_replicas_take_disjoint_shares_and_agree_on_the_position() -> None:
    options: dict[str, Any] = {"partial": _noisy, "final": _jitter, "reuse": 2, "seed": 6}
    replicas = [Refurbish(_data(), 8, num_replicas=2, replica=r, **options) for r in (0, 1)]
    epochs = [list(replica) for replica in replicas]
    shares = [{i for _, indices in epoch for i in indices.tolist()} for epoch in epochs]
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 40
    assert replicas[0].state_dict() == replicas[1].state_dict()  # counts global batches
    whole = Refurbish(_data(), 8, **options)
    list(whole)
    assert whole.state_dict() | {"num_replicas": 2} == replicas[0].state_dict()
    with pytest.raises(ValueError, match="num_replicas 2 -> 1"):
        whole.load_state_dict(replicas[0].state_dict())


class _Unpicklable:
    pass


def _unpicklable(sample: Any) -> Any:
    return lambda: sample


def _large(sample: Any) -> torch.Tensor:
    return torch.zeros(1024)


def test_settings_that_cannot_work_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="reuse must be an integer >= 1"):
        Refurbish(_data(), 4, reuse=0)
    with pytest.raises(TypeError, match="cannot be pickled"):
        Refurbish(_data(), 4, partial=_unpicklable)
    with pytest.raises(ValueError, match="takes 4096 bytes, more than cache_bytes=1000"):
        Refurbish(_data(), 4, partial=_large, cache_bytes=1000)
    with pytest.raises(ValueError, match="fewer than one batch of 4; pass cache_bytes >= 32768"):
        Refurbish(_data(), 4, partial=_large, cache_bytes=10_000)
    with pytest.raises(ValueError, match=r"window=4 batches .*\(at most 2 batches\)"):
        Refurbish(_data(), 4, partial=_large, cache_bytes=40_000, window=4)
    with pytest.raises(ValueError, match="gives no batch of 64"):
        Refurbish(_data(), 64)
    state = Refurbish(_data(), 4, reuse=2).state_dict()
    with pytest.raises(ValueError, match="reuse 2 -> 3"):
        Refurbish(_data(), 4, reuse=3).load_state_dict(state)


@pytest.mark.dist
def test_worker_processes_give_the_same_batches_within_the_cache_bound() -> None:
    options: dict[str, Any] = {
        "partial": _noisy, "final": _jitter, "batch_final": _shift, "reuse": 3,
        "cache_bytes": 24 * 20, "seed": 8,
    }  # fmt: skip
    expected = _take(Refurbish(_data(), 4, **options), 40)
    with Refurbish(_data(), 4, num_workers=2, **options) as loader:
        got = _take(loader, 23)
        assert 0 < loader.stats.peak_bytes <= 24 * 20 and loader.stats.over_bound == 0
        assert loader.stats.partials >= 23 * 4 // 3
        state = loader.state_dict()
    with Refurbish(_data(), 4, num_workers=1, **options) as resumed:
        resumed.load_state_dict(state)  # mid-window, workers recompute the cache
        _assert_same(got + _take(resumed, 17), expected)


def _cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _pipelined(rank: int, world_size: int, directory: str) -> None:
    from conveyor.data.vision import DecodeCrop, FinalAugment

    train, _ = synthetic_images(48, 0, image_size=32, seed=0)

    def run() -> tuple[conveyor.Pipeline, Any, Refurbish]:
        pipe = conveyor.Pipeline(_cnn(), num_microbatches=2, loss_fn=nn.functional.cross_entropy)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        loader = Refurbish(
            train, 8, partial=DecodeCrop(16), batch_final=FinalAugment(), reuse=2,
            num_workers=1, cache_bytes=2**18, seed=1,
        )  # fmt: skip
        return pipe, optimizer, loader

    def train_steps(pipe: conveyor.Pipeline, optimizer: Any, batches: Any, count: int) -> list:
        seen = []
        for _ in range(count):
            inputs, targets = next(batches)
            seen.append((inputs, targets))
            loss = pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad()
            assert loss is None or torch.isfinite(loss)
        return seen

    pipe, optimizer, loader = run()
    with Checkpointer(pipe, optimizer, data=loader, directory=directory) as ckpt:
        batches = broadcast_batches(loader)  # loaded and augmented on rank 0 only
        seen = train_steps(pipe, optimizer, batches, 2)
        ckpt.save(2)
        seen += train_steps(pipe, optimizer, batches, 3)
    digests = [float(inputs.double().sum()) for inputs, _ in seen]
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, (digests, loader.state_dict()))
    assert gathered[0] == gathered[1]  # the same batches and position on both ranks
    loader.close()
    pipe, optimizer, loader = run()
    with Checkpointer(pipe, optimizer, data=loader, directory=directory) as ckpt:
        assert ckpt.resume_latest() == 2
        again = train_steps(pipe, optimizer, broadcast_batches(loader), 3)
    for (inputs, targets), (want, want_targets) in zip(again, seen[2:], strict=True):
        assert torch.equal(inputs, want) and torch.equal(targets, want_targets)
    loader.close()


@pytest.mark.dist
def test_a_pipeline_fed_by_refurbish_trains_and_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("kornia")
    run_ranks(_pipelined, tmp_path, 2, timeout_s=100, directory=str(tmp_path / "ckpt"))
