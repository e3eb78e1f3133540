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
