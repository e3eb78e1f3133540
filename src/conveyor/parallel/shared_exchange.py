"""Exchange of small tensors among the ranks of one host through shared memory.

    exchange = SharedExchange(group, timeout)        # collective: every rank of the group
    parts = exchange(tensor)                         # every rank's tensor, in rank order

Context-parallel decode exchanges a few hundred values per layer per token between ranks that
have just computed (conveyor.parallel.context_parallel). Through gloo such a message costs
milliseconds on CPU ranks; through memory the ranks share, a store and a spin. See Note
[exchanging through shared memory].
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["SharedExchange", "shared_memory_possible"]


# Note [exchanging through shared memory]:
# Measured on 2 CPU ranks that each read 64 MB and then exchange 2 KB: through gloo
# (batch_isend_irecv) the exchange took 3.1-3.7 ms on average and a step 7.0 ms; through
# shared memory 0.1 ms and 4.0 ms. The ranks share one file mapped in each: per rank a sequence
# number and two slots. A rank writes its tensor in slot ``seq % 2`` and then its number, and
# spins until every peer's number reaches ``seq`` before reading their slots. Two slots suffice:
# a rank can write exchange seq + 2 only after every peer posted seq + 1, that is, after the
# peer read exchange seq. The number is written after the data, and x86-64 keeps stores in
# program order (and loads too), so a peer that sees the number sees the data; on other
# processors that order needs fences Python cannot issue, so only x86-64 uses this path. A rank
# that waits checks its peers' processes and the timeout, so a lost peer is named, not waited for.
_SLOTS = 2
_HEADER = 64
"""Bytes before each rank's slots: its sequence number (int64) and its process id."""
_SPIN = 2000
"""Checks of a peer's number before yielding the processor between checks."""


def shared_memory_possible(device: torch.device, hosts: list[str]) -> str | None:
    """Why a cp group on ``hosts`` computing on ``device`` cannot exchange through shared
    memory, or None if it can."""
    if device.type != "cpu":
        return f"its tensors are on {device}, not in host memory"
    if len(set(hosts)) > 1:
        return f"its ranks run on several hosts ({', '.join(sorted(set(hosts)))})"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"this processor ({platform.machine()}) may reorder stores to shared memory"
    return None


class SharedExchange:
    """Every rank of ``group`` (all on one host, CPU tensors) gets every rank's tensor;
    See Note [exchanging through shared memory]."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: timedelta, nbytes: int = 1 << 16):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.timeout_s = timeout.total_seconds()
        self.seq = 0
        self._map(nbytes)

    def _map(self, slot_bytes: int) -> None:
        """Map a new file of ``slot_bytes`` per slot, made by the group's first rank and
        unlinked once every rank has mapped it (collective)."""
        self.slot_bytes = slot_bytes = -(-slot_bytes // 64) * 64  # rows stay 8-byte aligned
        stride = _HEADER + _SLOTS * slot_bytes
        path: list[str | None] = [None]
        if self.rank == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            handle, path[0] = tempfile.mkstemp(prefix="conveyor-cp-", dir=folder)
            os.ftruncate(handle, stride * self.size)
            os.close(handle)
        source = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(path, source, group=self.group)
        try:
            memory = torch.from_file(
                str(path[0]), shared=True, size=stride * self.size, dtype=torch.uint8
            )
            dist.barrier(group=self.group)
        finally:  # the mappings stay; nothing is left behind, whatever happens
            if self.rank == 0:
                os.unlink(str(path[0]))
        self.memory = memory  # keeps the mapping
        rows = memory.view(self.size, stride)
        self.header: np.ndarray = rows[:, :_HEADER].view(torch.int64).numpy()
        """Per rank: the last exchange it posted, its process id (numpy: read in a spin)."""
        self.slots = rows[:, _HEADER:].view(self.size, _SLOTS, slot_bytes)
        self.header[self.rank, 1] = os.getpid()
        self.seq = 0
        dist.barrier(group=self.group)

    def __call__(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank order."""
        data = tensor.detach().contiguous().flatten().view(torch.uint8)
        if data.numel() > self.slot_bytes:  # every rank sees the same size: all remap
            self._map(max(data.numel(), 2 * self.slot_bytes))
        self.seq += 1
        slot = self.seq % _SLOTS
        self.slots[self.rank, slot, : data.numel()].copy_(data)
        self.header[self.rank, 0] = self.seq
        out = []
        for peer in range(self.size):
            if peer == self.rank:
                out.append(tensor)
                continue
            self._wait(peer)
            found = self.slots[peer, slot, : data.numel()].clone()
            out.append(found.view(tensor.dtype).view(tensor.shape))
        return out

    def _wait(self, peer: int) -> None:
        """Spin until ``peer`` has posted this exchange; raise naming it if its process is
        gone or the timeout passes."""
        header, seq = self.header, self.seq
        for _ in range(_SPIN):
            if header[peer, 0] >= seq:
                return
        deadline = time.monotonic() + self.timeout_s
        checked = time.monotonic()
        while header[peer, 0] < seq:
            os.sched_yield()
            now = time.monotonic()
            if now - checked > 0.1:
                checked = now
                self._check_alive(peer, now > deadline)

    def _check_alive(self, peer: int, late: bool) -> None:
        name = self._name(peer)
        pid = int(self.header[peer, 1])
        if not _alive(pid):
            raise RuntimeError(
                f"lost {name}: its process ({pid}) exited before exchange {self.seq} of "
                "context-parallel decode; restart the job (conveyor run restarts it)"
            )
        if late:
            raise RuntimeError(
                f"{name} did not reach exchange {self.seq} of context-parallel decode within "
                f"{self.timeout_s:.0f}s; it is stopped or stuck (raise timeout_s if it is slow)"
            )

    def _name(self, peer: int) -> str:
        rank = dist.get_global_rank(self.group, peer) if self.group is not None else peer
        return f"rank {rank} (cp rank {peer})"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one that its parent has not reaped does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: kill's answer stands
        return True
