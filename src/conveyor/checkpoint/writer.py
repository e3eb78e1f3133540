"""The storage writer: torch.distributed.checkpoint's file writer, plus a SHA-256 of each file
it writes, clear errors naming the file, and the checkpoint-write fault points."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from conveyor.checkpoint.manifest import FileEntry, file_entry
from conveyor.pipeline import faults

__all__ = ["Writer"]


class Writer(FileSystemWriter):
    """Writes one rank's part of a checkpoint into a fresh directory and hashes its files.

    After ``write_data`` returns, ``files`` holds the size and SHA-256 of every file this rank
    wrote, for the manifest; hashing here spreads that work over the ranks.
    """

    def __init__(self, path: Path, rank: int, step: int) -> None:
        super().__init__(
            path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False
        )
        self.files_fs = _FileSystem(step)
        self.fs = self.files_fs
        self.conveyor_rank = rank
        self.step = step
        self.files: dict[str, FileEntry] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            future = super().write_data(plan, planner)
            results = future.wait()
        except Exception as error:
            current = self.files_fs.current
            doing = f"writing {current}" if current else "writing its data"
            raise RuntimeError(
                f"rank {self.conveyor_rank}: {doing} in {self.path}: "
                f"{type(error).__name__}: {error}"
            ) from error
        names = sorted({result.storage_data.relative_path for result in results})
        root = Path(self.path)
        self.files = {name: file_entry(root / name, self.conveyor_rank) for name in names}
        faults.fire("checkpoint.after_data", step=self.step)
        return future


class _FileSystem(FileSystem):
    """Remembers which file is being written (for error messages) and, when a
    ``checkpoint.write`` fault is armed, interrupts the first write to a data file halfway."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.current: str | None = None
        self.inject = any(f.point == "checkpoint.write" for f in faults.configured())

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        self.current = Path(path).name
        with super().create_stream(path, mode) as stream:
            if self.inject and "w" in mode and self.current.endswith(".distcp"):
                yield cast(io.IOBase, _HalfWrite(stream, self.step))
            else:
                yield stream


class _HalfWrite:
    """A stream whose first write stops halfway at the ``checkpoint.write`` injection point."""

    def __init__(self, stream: io.IOBase, step: int) -> None:
        self._stream = stream
        self._step = step
        self._armed = True

    def write(self, data: Any) -> int:
        if not self._armed:
            return int(self._stream.write(data))
        self._armed = False
        view = memoryview(data).cast("B")
        half = len(view) // 2
        self._stream.write(view[:half])
        self._stream.flush()
        faults.fire("checkpoint.write", step=self._step)
        return half + int(self._stream.write(view[half:]))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
