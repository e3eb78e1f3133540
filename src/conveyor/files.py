"""Write files whole or not at all: into a temporary name in the same directory, then rename.

write_atomic("plan.json", text)                 # readers see the old file or the new one
with atomic_path("timeline.png") as temporary:  # for writers that want a path
    figure.savefig(temporary)
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path``, renamed to ``path`` if the body succeeds (deleted
    if it raises), so ``path`` is never half-written."""
    target = Path(path)
    # a name of our own (not mkstemp's, which makes files only the owner can read)
    temporary = target.with_name(
        f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}{target.suffix}"
    )
    try:
        yield temporary
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename; returns the path."""
    with atomic_path(path) as temporary:
        if isinstance(data, bytes):
            temporary.write_bytes(data)
        else:
            temporary.write_text(data)
    return Path(path)
