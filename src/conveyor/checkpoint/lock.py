"""One run per checkpoint directory: the coordinator holds a lock on ``DIR/.lock`` while its
Checkpointer is open, so a second run started on the same directory is refused at once.

    lock = DirectoryLock.take(directory)   # CheckpointError if another run holds it
    ...
    lock.release()

Without it, the second run swept the first one's save in progress as an interrupted save's
leftovers, and resumed from the first run's newest checkpoint as if it were its own. The lock
is ``flock``'s: the kernel drops it when the process dies (a killed rank, a restart by
torchrun), so nothing stale is ever left to clean up.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO

from conveyor.checkpoint.manifest import CheckpointError

__all__ = ["LOCK_NAME", "DirectoryLock"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"


class DirectoryLock:
    """A held lock on a checkpoint directory (or none, where the file system has no locks)."""

    def __init__(self, file: IO[str] | None) -> None:
        self._file = file

    @classmethod
    def take(cls, directory: Path) -> DirectoryLock:
        """Lock ``directory`` for this process, saying who holds it.

        Raises:
            CheckpointError: another process holds it; the message names it.
        """
        path = directory / LOCK_NAME
        try:
            file = open(path, "a+")  # noqa: SIM115  # held open until release
        except OSError:  # not writable: the Checkpointer's own check says so, for every rank
            return cls(None)
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "another process"
            file.close()
            if holder.startswith(f"pid {os.getpid()} "):
                raise CheckpointError(
                    directory,
                    LOCK_NAME,
                    "a Checkpointer of this process on the same directory is still open; "
                    "close it (or make it in a with block) before making another",
                ) from None
            raise CheckpointError(
                directory,
                LOCK_NAME,
                f"another run is using this checkpoint directory ({holder}): it would take "
                "that run's checkpoints for its own and sweep its saves in progress; give "
                "each run a directory of its own, or stop the other run first",
            ) from None
        except OSError as error:  # a file system without locks (some network mounts)
            file.close()
            logger.warning(
                "cannot lock the checkpoint directory %s (%s); make sure no other run uses it",
                directory,
                error,
            )
            return cls(None)
        file.truncate(0)
        file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n")
        file.flush()
        return cls(file)

    def release(self) -> None:
        """Give the lock up (idempotent); the file stays, holding nothing."""
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None
