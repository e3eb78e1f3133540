"""The shared-memory exchange of a cp group (conveyor.parallel.shared_exchange): every rank
gets every rank's tensors, as messages over gloo give them, through growing sizes and mixed
dtypes; a lost or stopped peer is named within a bounded time; what cannot share memory is
named."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conveyor.parallel.context_parallel import exchange
from conveyor.parallel.shared_exchange import SharedExchange, shared_memory_possible
from dist import run_ranks

pytestmark = pytest.mark.skipif(
    shared_memory_possible(torch.device("cpu"), ["one host"]) is not None,
    reason="the shared-memory exchange runs on x86-64 CPUs only",
)


def _equal_to_messages(rank: int, world_size: int) -> None:
    shared = SharedExchange(None, timedelta(seconds=20), nbytes=64)  # small: it must grow
    generator = torch.Generator().manual_seed(rank)
    for step in range(60):
        dtype = (torch.float32, torch.float64, torch.bfloat16)[step % 3]
        shape = (2, 3, 1 + step)
        mine = torch.randn(shape, generator=generator).to(dtype)
        got, want = shared(mine), exchange(mine, None)
        assert len(got) == world_size
        for found, expected in zip(got, want, strict=True):
            assert found.dtype == dtype and torch.equal(found, expected), step
    unaligned = SharedExchange(None, timedelta(seconds=20), nbytes=1001)
    odd = torch.randint(0, 255, (3001,), dtype=torch.uint8, generator=generator)
    for found, expected in zip(unaligned(odd), exchange(odd, None), strict=True):
        assert torch.equal(found, expected)  # sizes of no alignment, before and after growth
    assert shared.slot_bytes >= 2 * 3 * 60 * 8
    if os.path.isdir("/dev/shm"):  # each file was unlinked once mapped
        assert not any(name.startswith("conveyor-cp-") for name in os.listdir("/dev/shm"))


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_gets_every_ranks_tensor_as_messages_give_it(
    tmp_path: Path, world_size: int
) -> None:
    run_ranks(_equal_to_messages, tmp_path, world_size, timeout_s=120)


def _lost_and_stopped(rank: int, world_size: int, out: str) -> None:
    shared = SharedExchange(None, timedelta(seconds=2))
    shared(torch.ones(4))
    if rank == 1:
        time.sleep(4)  # past rank 0's timeout
        shared(torch.ones(4))
        dist.barrier()
        os._exit(0)  # lost without a word
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(cp rank 1\) did not reach exchange 2 .* 2s"):
        shared(torch.ones(4))
    stopped_s = time.monotonic() - start
    dist.barrier()
    time.sleep(0.5)  # rank 1 has exited
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"lost rank 1 \(cp rank 1\): its process \(\d+\)"):
        shared(torch.ones(4))
    Path(out).write_text(f"{stopped_s} {time.monotonic() - start}")
    os._exit(0)  # its peer is gone: no collective teardown


@pytest.mark.dist
def test_a_stopped_peer_is_named_at_the_timeout_and_a_lost_one_at_once(tmp_path: Path) -> None:
    out = tmp_path / "seconds.txt"
    run_ranks(_lost_and_stopped, tmp_path, 2, timeout_s=60, out=str(out))
    stopped, lost = map(float, out.read_text().split())
    assert 2.0 <= stopped < 3.0 and lost < 1.0


def test_only_cpu_ranks_of_one_host_share_memory() -> None:
    cpu = torch.device("cpu")
    assert shared_memory_possible(cpu, ["a", "a"]) is None
    assert "several hosts (a, b)" in str(shared_memory_possible(cpu, ["a", "b"]))
    assert "not in host memory" in str(shared_memory_possible(torch.device("meta"), ["a"]))
