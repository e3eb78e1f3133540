"""Checkpoint directories on disk: names, the manifest (files, sizes, SHA-256, configuration)
and verification that names the checkpoint, the file and the cause of any problem."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "FORMAT",
    "MANIFEST",
    "METADATA",
    "CheckpointError",
    "FileEntry",
    "Manifest",
    "Problem",
    "check_files",
    "check_metadata",
    "file_entry",
    "fsync_dir",
    "list_checkpoints",
    "raise_problems",
    "read_manifest",
    "remove_dir",
    "sha256_file",
    "step_dir_name",
    "verify",
]


FORMAT = "conveyor-checkpoint/1"
MANIFEST = "manifest.json"
METADATA = ".metadata"
"""torch.distributed.checkpoint's index of every saved entry; written by the coordinator."""

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, read or used; names the checkpoint, file and cause."""

    def __init__(self, path: str | os.PathLike[str], file: str | None, cause: str) -> None:
        self.path = str(path)
        self.file = file
        self.cause = cause
        where = f"checkpoint {self.path}" + (f": {file}" if file else "")
        super().__init__(f"{where}: {cause}")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one file of a checkpoint."""

    file: str | None
    cause: str


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str
    rank: int | None = None
    """The rank that wrote the file (None for the coordinator's .metadata)."""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` records: the step, every file, and how the run was configured."""

    step: int
    world_size: int
    layout: dict[str, Any]
    """The split, placement, schedule and micro-batches the checkpoint was saved with."""
    files: dict[str, FileEntry]
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    format: str = FORMAT

    def to_json(self) -> str:
        data = asdict(self)
        data["files"] = {name: asdict(entry) for name, entry in sorted(self.files.items())}
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"format is {found!r}, expected {FORMAT!r}")
        files = {name: FileEntry(**entry) for name, entry in data.pop("files").items()}
        return cls(files=files, **data)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Published checkpoints (``step-*`` directories) in ``directory``, newest first.

    Raises:
        CheckpointError: ``directory`` exists but cannot be listed.
    """
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as error:
        raise CheckpointError(
            directory, None, f"cannot list the checkpoint directory: {error}"
        ) from error
    found = [
        (int(m.group(1)), directory / name)
        for name in names
        if (m := _STEP_DIR.match(name)) is not None
    ]
    return sorted(found, reverse=True)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_entry(path: Path, rank: int | None = None) -> FileEntry:
    return FileEntry(path.stat().st_size, sha256_file(path), rank)


def read_manifest(path: Path) -> Manifest:
    """The manifest of the checkpoint at ``path``.

    Raises:
        CheckpointError: the directory cannot be read, or the manifest is missing or invalid.
    """
    try:
        os.listdir(path)
    except OSError as error:
        raise CheckpointError(path, None, f"cannot read the directory: {error}") from error
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        raise CheckpointError(
            path,
            MANIFEST,
            "missing; the checkpoint was never completed "
            "(conveyor writes the manifest last) or was not written by "
            "conveyor",
        ) from None
    except OSError as error:
        raise CheckpointError(path, MANIFEST, f"cannot be read: {error}") from error
    try:
        manifest = Manifest.from_json(text)
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(
            path, MANIFEST, f"is not a valid conveyor manifest ({error}); the file is damaged"
        ) from error
    named = _STEP_DIR.match(path.name)
    if named is not None and int(named.group(1)) != manifest.step:
        # its files would fail their hashes, and read as damaged bytes: name the steps instead
        raise CheckpointError(
            path,
            MANIFEST,
            f"belongs to step {manifest.step}, but the directory {path.name} is step "
            f"{int(named.group(1))}'s: the manifest was copied from another checkpoint, or the "
            f"directory was renamed; put back the manifest saved with step "
            f"{int(named.group(1))}, or move the checkpoint to {step_dir_name(manifest.step)}",
        )
    return manifest


def _owner(name: str, entry: FileEntry) -> str:
    if name == METADATA:
        return "the coordinator's index file"
    match = _RANK_FILE.match(name)
    rank = entry.rank if entry.rank is not None else (int(match.group(1)) if match else None)
    return "a data file" if rank is None else f"rank {rank}'s data file"


def check_files(path: Path, manifest: Manifest, names: Iterable[str]) -> list[Problem]:
    """Compare the files ``names`` with their manifest entries: present, same size, same
    SHA-256. Returns the problems found (empty if none)."""
    problems = []
    for name in names:
        entry = manifest.files[name]
        owner = _owner(name, entry)
        try:
            size = (path / name).stat().st_size
            if size != entry.size:
                problems.append(
                    Problem(
                        name,
                        f"{owner} has {size} bytes but the manifest "
                        f"records {entry.size}: the file is "
                        f"{'truncated' if size < entry.size else 'damaged'}",
                    )
                )
                continue
            digest = sha256_file(path / name)
        except FileNotFoundError:
            problems.append(Problem(name, f"{owner} is missing"))
            continue
        except OSError as error:
            problems.append(Problem(name, f"{owner} cannot be read: {error}"))
            continue
        if digest != entry.sha256:
            problems.append(
                Problem(
                    name,
                    f"{owner} has changed since it was written (SHA-256 "
                    f"{digest[:12]}..., manifest {entry.sha256[:12]}...): "
                    "its bytes are damaged",
                )
            )
    return problems


def check_metadata(path: Path, manifest: Manifest) -> tuple[Metadata | None, list[Problem]]:
    """Read the checkpoint's .metadata and check that every file it points to is listed in the
    manifest. Returns the metadata (None if unreadable) and the problems found."""
    if METADATA not in manifest.files:
        return None, [
            Problem(
                METADATA,
                "is not listed in the manifest; the checkpoint was "
                "not written by this version of conveyor",
            )
        ]
    try:
        metadata = FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return None, [Problem(METADATA, "the coordinator's index file is missing")]
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
        return None, [Problem(METADATA, f"cannot be read: {type(error).__name__}: {error}")]
    problems = []
    referenced = {info.relative_path for info in (metadata.storage_data or {}).values()}
    for name in sorted(referenced - set(manifest.files)):
        problems.append(Problem(name, "is referenced by .metadata but not listed in the manifest"))
    return metadata, problems


def verify(path: str | os.PathLike[str]) -> Manifest:
    """Check everything on this process: manifest, every file's size and SHA-256, metadata.

    Raises:
        CheckpointError: naming the first problem found (and how many more there are).
    """
    path = Path(path)
    manifest = read_manifest(path)
    problems = check_files(path, manifest, sorted(manifest.files))
    if not problems:
        problems += check_metadata(path, manifest)[1]
    raise_problems(path, problems)
    return manifest


def verify_on_ranks(path: Path, group: dist.ProcessGroup | None) -> Manifest:
    """``verify``, collectively: the ranks of ``group`` share the hashing, and every rank
    raises the same CheckpointError if anything is wrong."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    problems: list[Problem] = []
    manifest = None
    try:
        manifest = read_manifest(path)
    except CheckpointError as error:
        problems.append(Problem(error.file, error.cause))
    if manifest is not None:
        problems += check_files(path, manifest, sorted(manifest.files)[rank::world_size])
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, problems, group=group)
    merged = list(dict.fromkeys(p for rank_problems in gathered for p in rank_problems))
    if not merged and manifest is not None:
        merged = check_metadata(path, manifest)[1]
    raise_problems(path, merged)
    assert manifest is not None
    return manifest


def raise_problems(path: Path, problems: list[Problem]) -> None:
    """Raise a CheckpointError for the first of ``problems``, counting the others."""
    if not problems:
        return
    first = problems[0]
    count = len(problems) - 1
    more = f" (and {count} more problem{'s' if count > 1 else ''})" if count else ""
    raise CheckpointError(path, first.file, first.cause + more)


def fsync_dir(path: Path) -> None:
    """Make a rename or new file in ``path`` durable (POSIX directories need their own fsync)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_dir(path: Path, trash_name: str) -> None:
    """Delete a directory so that no half-deleted copy is ever seen under its name: rename it
    to ``trash_name`` (in the same parent) first, then remove it."""
    trash = path.parent / trash_name
    os.rename(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)
