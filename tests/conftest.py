from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo world of this one process (every stage local), ended after the test."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'one-rank-store'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=20),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
