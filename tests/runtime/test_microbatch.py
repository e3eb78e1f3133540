"""Micro-batch split and merge: uneven chunks, pytrees, non-tensor leaves."""

from __future__ import annotations

import pytest
import torch

from conveyor.runtime import microbatch


def test_uneven_split_covers_every_sample_and_merges_back() -> None:
    batch = {
        "x": torch.arange(10).view(5, 2),
        "mask": torch.ones(5, dtype=torch.bool),
        "scale": 0.5,
        "table": torch.zeros(3, 3),
    }
    chunks = microbatch.split(batch, 4)
    assert [c["x"].shape[0] for c in chunks] == [2, 1, 1, 1]
    assert all(c["scale"] == 0.5 and c["table"].shape == (3, 3) for c in chunks)
    merged = microbatch.merge([{"x": c["x"], "n": 7} for c in chunks])
    torch.testing.assert_close(merged["x"], batch["x"])
    assert merged["n"] == 7


def test_batch_smaller_than_microbatch_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 4 samples"):
        microbatch.split(torch.zeros(3, 2), 4)


def test_no_tensor_means_every_microbatch_gets_the_value() -> None:
    assert microbatch.split((1, "a"), 3) == [(1, "a")] * 3


def test_scalars_merge_as_the_steps_loss_and_the_rest_must_agree() -> None:
    losses = [torch.tensor(1.0), torch.tensor(float("nan")), torch.tensor(4.0)]
    chunks = [{"loss": loss, "n": 7, "scale": torch.tensor(2.0)} for loss in losses]
    merged = microbatch.merge(chunks, [0.25, 0.0, 0.75])  # the NaN one counts nothing
    assert merged["loss"].item() == 0.25 + 3.0 and merged["n"] == 7
    assert merged["scale"].item() == 2.0  # the same in every micro-batch: kept
    assert microbatch.merge(chunks[::2])["loss"].item() == 2.5  # no weights: the mean
    with pytest.raises(ValueError, match=r"output leaf 1 \(int\) differs between micro-batches"):
        microbatch.merge([{"loss": torch.tensor(1.0), "n": n} for n in (1, 2)])


def test_only_tensors_of_their_micro_batchs_size_are_concatenated() -> None:
    gram = torch.eye(4)  # no batch dimension: (4, 4) for micro-batches of 2 and 3 samples
    chunks = [{"y": torch.ones(n, 4), "gram": gram} for n in (2, 3)]
    merged = microbatch.merge(chunks, sizes=[2, 3])
    assert merged["y"].shape == (5, 4) and torch.equal(merged["gram"], gram)
    per_microbatch = [{"mean": torch.full((4,), float(n))} for n in (2, 3)]
    with pytest.raises(ValueError, match=r"output leaf 0 \(Tensor\) differs"):
        microbatch.merge(per_microbatch, sizes=[2, 3])
