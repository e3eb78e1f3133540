"""Point-to-point transport: messages both ways at once, over a group per direction."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from conveyor.runtime.comm import P2P, Meta
from dist import run_ranks

TIMEOUT = timedelta(seconds=20)


def _exchange(p2p: P2P, peers: list[int], rounds: int) -> None:
    """Every rank sends ``rounds`` numbered messages to each peer while receiving theirs,
    all calls at about the same time; each message must arrive whole and in order."""
    me = p2p.rank
    meta = Meta.of(torch.zeros(1000))
    for k in range(rounds):
        receives = {peer: p2p.post(peer, meta, f"{peer}->{me} #{k}") for peer in peers}
        for peer in peers:
            p2p.send(torch.full((1000,), 100.0 * me + peer + k / rounds), peer, f"#{k}")
        for peer, receive in receives.items():
            expected = torch.full((1000,), 100.0 * peer + me + k / rounds)
            torch.testing.assert_close(p2p.wait(receive), expected, rtol=0, atol=0)
        p2p.wait_sends()


def _mixed(p2p: P2P, peers: list[int]) -> None:
    """A message of tensors of several dtypes and odd sizes travels as one transfer (See Note
    [one message]) and arrives whole, each tensor in its own dtype and shape."""

    def message(src: int) -> dict[str, object]:
        return {
            "bytes": torch.arange(3, dtype=torch.uint8) + src,
            "empty": torch.zeros(0),
            "ints": torch.arange(5, dtype=torch.int64).reshape(5, 1) * (src + 1),
            "flags": torch.tensor([True, False, bool(src)]),
            "value": torch.full((2, 3), 0.5 + src, dtype=torch.float64).t(),
            "constant": src,
        }

    receives = {peer: p2p.post(peer, None, f"mixed from {peer}") for peer in peers}
    for peer in peers:
        p2p.send(message(p2p.rank), peer, "mixed", header=Meta.of(message(p2p.rank)))
    for peer, receive in receives.items():
        got, expected = p2p.wait(receive), message(peer)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(got[name], value, rtol=0, atol=0)
            else:
                assert got[name] == value
    p2p.wait_sends()


def _both_ways(rank: int, world_size: int) -> None:
    p2p = P2P(None, torch.device("cpu"), TIMEOUT)
    up, down = p2p._upward, p2p._downward
    assert up is not None and down is not None
    assert len({id(up), id(down), id(dist.group.WORLD)}) == 3, "one group per direction"
    assert dist.get_rank(up) == dist.get_rank(down) == rank
    _exchange(p2p, [r for r in range(world_size) if r != rank], rounds=20)
    _mixed(p2p, [r for r in range(world_size) if r != rank])
    again = P2P(None, torch.device("cpu"), TIMEOUT)
    assert (again._upward, again._downward) == (up, down), "pipelines share them"


def test_messages_cross_both_ways_at_once(tmp_path: Path) -> None:
    run_ranks(_both_ways, tmp_path, world_size=3)


def _subgroup(rank: int, world_size: int) -> None:
    group = dist.new_group([1, 2])  # every rank takes part in making it
    if rank == 0:  # not in the pipeline
        return
    p2p = P2P(group, torch.device("cpu"), TIMEOUT)
    assert p2p.rank == rank - 1
    assert p2p._upward is None and p2p._downward is None, "part of the world: its group"
    _exchange(p2p, [1 - p2p.rank], rounds=5)


def test_a_pipeline_group_inside_a_larger_world(tmp_path: Path) -> None:
    run_ranks(_subgroup, tmp_path, world_size=3)


def _after_restart(rank: int, world_size: int, store: str) -> None:
    first = P2P(None, torch.device("cpu"), TIMEOUT)._upward
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=TIMEOUT
    )
    p2p = P2P(None, torch.device("cpu"), TIMEOUT)
    assert p2p._upward is not first, "groups of a destroyed world are made anew"
    _exchange(p2p, [1 - rank], rounds=3)


def test_groups_are_made_anew_after_the_world_restarts(tmp_path: Path) -> None:
    run_ranks(_after_restart, tmp_path, store=str(tmp_path / "second-store"))
