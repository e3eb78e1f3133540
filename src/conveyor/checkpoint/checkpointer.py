"""Checkpointer: atomic, verified, asynchronous checkpoints of a pipelined run; resume, reshard."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save
from torch.distributed.checkpoint.state_dict_saver import save as save_state

from conveyor.checkpoint.compat import check_keys, check_layout
from conveyor.checkpoint.lock import DirectoryLock
from conveyor.checkpoint.manifest import (
    MANIFEST,
    METADATA,
    CheckpointError,
    Manifest,
    file_entry,
    fsync_dir,
    list_checkpoints,
    raise_problems,
    remove_dir,
    step_dir_name,
    verify_on_ranks,
)
from conveyor.checkpoint.state import (
    ModelState,
    OptimizerState,
    Progress,
    RandomState,
    describe_layout,
    digest,
    rank_module,
)
from conveyor.checkpoint.writer import Writer
from conveyor.config import CHECKPOINT_DIR_ENV, CheckpointConfig
from conveyor.pipeline import Pipeline, faults
from conveyor.runtime.peers import PeerLostError, close_group, remaining

__all__ = ["Checkpointer", "SaveRecord"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class SaveRecord:
    """How one save went, for logs and benchmarks."""

    step: int
    blocked_s: float
    """Time the training loop was blocked in ``save`` (the snapshot, when asynchronous)."""
    total_s: float | None = None
    """Time from the call to ``save`` until the checkpoint was published."""
    num_bytes: int = 0
    """Bytes of every file of the checkpoint (known on the coordinator)."""
    path: Path | None = None


@dataclass
class _Job:
    step: int
    temporary: Path
    writer: Writer
    state: dict[str, Any]
    check: str
    """Fingerprint of the state every rank must agree on (step, data position, scheduler)."""
    record: SaveRecord
    start: float
    upload: Future[Any] | None = None


# Note [checkpoint protocol]:
# save(step), on every rank:
#   1. wait for the previous save (at most one in flight), raising its error if it failed;
#   2. snapshot: async_save stages a copy of every tensor into reused CPU buffers and starts
#      writing in its own thread; training continues (fault point after_snapshot);
#   3. background: each rank writes __<rank>_0.distcp into .tmp-step-N-<run>-<seq>/ and hashes
#      it (after_data); the coordinator writes .metadata (after_metadata);
#   4. the coordinator gathers every rank's file sizes and SHA-256, writes manifest.json
#      (before_rename), renames the directory to step-N, fsyncs, then deletes checkpoints
#      beyond the newest `keep`; every rank learns the outcome by a broadcast.
# A directory named step-N is therefore complete; anything else is swept at start-up.
class Checkpointer:
    """Saves and restores a pipelined training run: atomic, verified, asynchronous, and
    loadable into another split.

        ckpt = Checkpointer(pipe, optimizer, scheduler=scheduler, data=loader, every=50)
        start = ckpt.resume_latest()            # 0 when there is no checkpoint yet
        for step in range(start, num_steps): ...; ckpt.maybe_save(step + 1)
        ckpt.close()                            # waits for the last save

    Create it on every rank of the pipeline, or of the whole mesh with data parallelism (one
    checkpoint per step for every replica: replicated state is written once, FSDP shards by
    DCP, and it loads at another number of replicas, with FSDP on or off). It creates a gloo
    process group of those ranks for checkpoint traffic, so background writes never
    interleave with the pipeline's messages (with several pipelines in one job, create them
    in the same order on every rank, as torch names process groups by count). ``options``
    are CheckpointConfig fields. Checkpoints are pickled objects as well as tensors: load
    only those you trust.
    """

    def __init__(
        self,
        pipe: Pipeline,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scheduler: Any | None = None,
        data: Any | None = None,
        config: CheckpointConfig | None = None,
        **options: Any,
    ) -> None:
        config = dataclasses.replace(config or CheckpointConfig(), **options)
        directory = config.directory or os.environ.get(CHECKPOINT_DIR_ENV)
        if not directory:
            raise ValueError(
                "no checkpoint directory: pass directory=... (or "
                "config=CheckpointConfig(directory=...)), or run under `conveyor "
                f"run --checkpoint-dir DIR`, which sets ${CHECKPOINT_DIR_ENV}"
            )
        self.config = config
        self.directory = Path(directory).absolute()
        self.pipe = pipe
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data = data
        _check_stateful(scheduler, "scheduler")
        _check_stateful(data, "data")
        self._module = rank_module(pipe)
        _check_optimizer(optimizer, self._module)
        self.timeout = timedelta(seconds=config.timeout_s or pipe.config.timeout_s)
        """Longest wait for the other ranks: CheckpointConfig.timeout_s, else the pipeline's."""
        # a pipeline over a group of its own saves alone (its ranks make the group, which
        # torch names by how many groups each of them knows); on a mesh every replica takes
        # part (one checkpoint for the job: DCP writes replicated state once, shards by
        # offset), and every rank makes the group, named by a count all ranks agree on
        alone = pipe.group is not None and pipe.mesh is None
        self._group = dist.new_group(
            dist.get_process_group_ranks(pipe.group) if alone else None,
            backend="gloo",
            use_local_synchronization=alone,
            timeout=self.timeout,
        )
        # a lost peer ends the waits of a save in flight at once; See Note [one deadline]
        self._close_group = functools.partial(close_group, self._group)
        pipe.peers.close_with(self._close_group, on_abandon=False)
        self._ranks = dist.get_process_group_ranks(self._group)
        self.rank = dist.get_rank(self._group)
        self.world_size = dist.get_world_size(self._group)
        self.is_coordinator = self.rank == 0
        self._model = ModelState(pipe)
        self._optimizer = None if optimizer is None else OptimizerState(self._module, optimizer)
        self._progress = Progress(pipe)
        self._random = RandomState(self.rank)
        self._stager = DefaultStager(StagingOptions(False, False, False, False))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="conveyor-checkpoint")
        self._pending: Future[SaveRecord] | None = None
        self._sequence = 0
        self._last_step: int | None = None
        self._closed = False
        self.saves: list[SaveRecord] = []
        """Every save of this Checkpointer, finished or not."""
        self.skipped: list[CheckpointError] = []
        """Invalid checkpoints that ``resume_latest`` passed over."""
        self._hooks = faults.install(pipe, optimizer)
        self._lock = DirectoryLock(None)
        """The coordinator's lock on the directory, held until close()."""
        self._run_id = self._on_coordinator(self._start, "creating the checkpoint directory")
        try:
            self._check_writable()
        except BaseException:
            self._lock.release()
            raise
        atexit.register(_report_unfinished, weakref.ref(self))

    # -- saving --------------------------------------------------------------------------

    def maybe_save(self, step: int) -> bool:
        """Save if ``step`` is a multiple of ``every`` and not the step just saved or loaded;
        returns whether it did."""
        if step % self.config.every or step == self._last_step:
            return False
        self.save(step)
        return True

    def save(self, step: int) -> None:
        """Checkpoint the state after ``step`` optimizer steps, on every rank.

        Asynchronous by default: returns once the state is copied to memory; the files are
        written in the background. Raises CheckpointError if the previous save failed.
        """
        self.wait()
        start = time.perf_counter()
        self._progress.step = self._last_step = step
        state = self._state()
        temporary = self.directory / f".tmp-{step_dir_name(step)}-{self._run_id}-{self._sequence}"
        self._sequence += 1
        record = SaveRecord(step, 0.0)
        job = _Job(
            step,
            temporary,
            Writer(temporary, self.rank, step),
            state,
            self._fingerprint(state),
            record,
            start,
        )
        self.saves.append(record)
        if self.config.async_save:
            with self._naming_lost(f"saving step {step}"):
                upload = async_save(
                    state,
                    storage_writer=job.writer,
                    process_group=self._group,
                    async_stager=self._stager,
                )
            job.upload = (
                upload.upload_completion if isinstance(upload, AsyncSaveResponse) else upload
            )
            record.blocked_s = time.perf_counter() - start
            faults.fire("checkpoint.after_snapshot", step=step)
            self._pending = self._executor.submit(self._write, job)
            return
        faults.fire("checkpoint.after_snapshot", step=step)
        self._write(job)
        record.blocked_s = time.perf_counter() - start

    def wait(self) -> SaveRecord | None:
        """Block until the save in flight (if any) is published; returns its record.

        Raises:
            CheckpointError: the save failed; earlier checkpoints are untouched.
            PeerLostError: a rank stopped answering (a CheckpointError too if the save found
                it first): within the timeout of its silence, not of the save's last wait.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None

        def done(seconds: float) -> bool:
            concurrent.futures.wait([pending], timeout=seconds)
            return pending.done()

        doing = f"saving step {self.saves[-1].step}"
        try:  # See Note [one deadline]
            self.pipe.peers.watching(done, self._ranks, doing, self.timeout)
        except PeerLostError:  # its groups are closed: the save's waits end at once
            with contextlib.suppress(Exception):
                pending.result(remaining(self.timeout).total_seconds())
            raise
        return pending.result()

    def close(self) -> None:
        """Wait for the last save and release the background thread; idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._stager.close()
            self._lock.release()
            for hook in self._hooks:
                hook.remove()
            self._release_group()

    def _release_group(self) -> None:
        """Destroy the checkpoint group and drop every reference to it: torch then joins its
        gloo threads now, not while the interpreter exits (See Note [threads at exit])."""
        self.pipe.peers.forget(self._close_group)
        group = self._group
        del self._group, self._close_group
        with contextlib.suppress(ValueError, KeyError, RuntimeError):  # the world is gone
            dist.destroy_process_group(group)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any
    ) -> None:
        if kind is None:
            self.close()
            return
        try:  # keep the training error: it is the cause; report the save's own failure
            self.close()
        except Exception as save_error:
            logger.error("[rank %d] the checkpoint in flight failed too: %s", self.rank, save_error)

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds, as Stateful objects keyed the same on every rank."""
        state: dict[str, Any] = {
            "model": self._model,
            "progress": self._progress,
            "rng": self._random,
        }
        if self._optimizer is not None:
            state["optimizer"] = self._optimizer
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler
        if self.data is not None:
            state["data"] = self.data
        return state

    def _fingerprint(self, state: dict[str, Any]) -> str:
        shared = {
            key: state[key].state_dict()
            for key in ("progress", "data", "scheduler")
            if key in state
        }
        try:
            return digest(shared)
        except Exception:  # an unpicklable scheduler state: nothing to compare
            return ""

    def _write(self, job: _Job) -> SaveRecord:
        """Steps 3 and 4 of the protocol, in the background when asynchronous.

        See Note [checkpoint protocol].
        """
        try:
            if job.upload is not None:
                job.upload.result()
            else:
                save_state(job.state, storage_writer=job.writer, process_group=self._group)
        except (Exception, CheckpointException) as error:
            self._discard(job)
            cause, lost = self._describe(error, f"saving step {job.step}")
            raise _save_error(
                job.temporary,
                f"saving step {job.step} failed: {cause}; the checkpoint was not published and "
                f"earlier ones in {self.directory} are untouched",
                lost,
            ) from None
        faults.fire("checkpoint.after_metadata", step=job.step)
        reports: list[Any] = [None] * self.world_size if self.is_coordinator else []
        try:
            dist.gather_object(
                (job.writer.files, job.check),
                reports if self.is_coordinator else None,
                group=self._group,
                group_dst=0,
            )
            if not self.is_coordinator:
                faults.fire("checkpoint.before_rename", step=job.step)
            path, num_bytes = self._on_coordinator(
                lambda: self._publish(job, reports), f"publishing step {job.step}"
            )
        except CheckpointError:
            self._discard(job)
            raise
        except RuntimeError as error:  # the backend's error for a rank that went away
            cause, lost = self._describe(error, f"publishing step {job.step}")
            raise _save_error(
                job.temporary,
                f"saving step {job.step} failed while the ranks coordinated: {cause}",
                lost,
            ) from error
        job.record.path = Path(path)
        job.record.num_bytes = num_bytes
        job.record.total_s = time.perf_counter() - job.start
        if self.is_coordinator:
            logger.info(
                "checkpoint %s: %.1f MB, training blocked %.3f s, published after %.2f s",
                path,
                num_bytes / 1e6,
                job.record.blocked_s,
                job.record.total_s,
            )
        return job.record

    def _publish(self, job: _Job, reports: list[Any]) -> tuple[str, int]:
        """The coordinator's part: manifest, rename, prune. Returns (path, bytes)."""
        files = {name: entry for rank_files, _ in reports for name, entry in rank_files.items()}
        checks = {rank: check for rank, (_, check) in enumerate(reports)}
        if len(set(checks.values())) > 1:
            raise CheckpointError(
                job.temporary,
                None,
                f"ranks disagree on the step, data "
                f"position or scheduler state (fingerprints {checks}); every "
                "rank must call save() with the same step, after the same "
                "batches",
            )
        files[METADATA] = file_entry(job.temporary / METADATA)
        unexpected = sorted(set(os.listdir(job.temporary)) - set(files))
        if unexpected:
            raise CheckpointError(
                job.temporary,
                unexpected[0],
                "was written but no rank reported it; the checkpoint library wrote an unknown file",
            )
        manifest = Manifest(
            job.step,
            self.world_size,
            describe_layout(self.pipe),
            files,
            _versions(),
            datetime.datetime.now(datetime.UTC).isoformat(),
        )
        with (job.temporary / MANIFEST).open("w") as file:
            file.write(manifest.to_json())
            file.flush()
            os.fsync(file.fileno())
        fsync_dir(job.temporary)
        faults.fire("checkpoint.before_rename", step=job.step)
        final = self.directory / step_dir_name(job.step)
        if final.exists():  # an invalid or older copy of this step: never merge into it
            remove_dir(final, f".deleting-{final.name}-{self._run_id}-{self._sequence}")
        os.rename(job.temporary, final)
        fsync_dir(self.directory)
        self._prune()
        return str(final), sum(entry.size for entry in files.values())

    def _prune(self) -> None:
        if self.config.keep == 0:
            return
        for _, path in list_checkpoints(self.directory)[self.config.keep :]:
            logger.info("deleting old checkpoint %s (keep=%d)", path, self.config.keep)
            remove_dir(path, f".deleting-{path.name}-{self._run_id}")

    def _discard(self, job: _Job) -> None:
        if self.is_coordinator and job.temporary.exists():
            try:
                remove_dir(job.temporary, f".deleting-{job.temporary.name}")
            except OSError as error:
                logger.warning("could not remove %s: %s", job.temporary, error)

    def _start(self) -> str:
        """The coordinator's start-up: create the directory, sweep what interrupted saves
        and deletions left behind, and pick this run's id for temporary names."""
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                self.directory,
                None,
                "is a file, not a directory; pass a directory for the checkpoints (it is "
                "created if missing), or move the file away",
            )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock = DirectoryLock.take(self.directory)  # before sweeping: See lock.py
            names = os.listdir(self.directory)
        except OSError as error:
            raise CheckpointError(
                self.directory, None, f"cannot create or list the checkpoint directory: {error}"
            ) from error
        for name in names:
            if name.startswith((".tmp-", ".deleting-")):
                logger.info("removing %s, left by an interrupted save or deletion", name)
                remove_dir(self.directory / name, f".deleting-{name}-swept")
            elif name.startswith(".probe-"):  # left by an interrupted _check_writable
                (self.directory / name).unlink(missing_ok=True)
        return uuid.uuid4().hex[:8]

    def _check_writable(self) -> None:
        """Every rank writes its own files into the directory, which must be the same one for
        all (a checkpoint is every rank's files): find out now, not at a save or a resume, if
        a rank cannot write (read-only, no permission, no space) or the ranks see different
        directories (each node's own disk)."""
        probe = self.directory / f".probe-{self._run_id}-{self.rank}"
        problem = None
        try:
            probe.write_bytes(b"conveyor")
        except OSError as error:
            problem = f"{type(error).__name__}: {error}"
        problems = self._gathered(problem, "checking the checkpoint directory")
        unseen = [
            r
            for r in range(self.world_size)
            if not (self.directory / f".probe-{self._run_id}-{r}").exists()
        ]
        views = self._gathered(unseen, "checking the checkpoint directory")  # all have looked
        probe.unlink(missing_ok=True)
        failed = [f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None]
        if failed:
            raise CheckpointError(
                self.directory,
                None,
                f"cannot write into the checkpoint directory ({'; '.join(failed)}); make it "
                "writable by every rank, or pass another directory",
            )
        split = [f"rank {r} sees no files of ranks {v}" for r, v in enumerate(views) if v]
        if split:
            raise CheckpointError(
                self.directory,
                None,
                f"the ranks do not share the checkpoint directory ({'; '.join(split)}): a "
                "checkpoint holds every rank's files in one directory; pass a directory on a "
                "file system every rank mounts (the same path on every node)",
            )

    def _gathered(self, value: Any, doing: str) -> list[Any]:
        values: list[Any] = [None] * self.world_size
        with self._naming_lost(doing):
            dist.all_gather_object(values, value, group=self._group)
        return values

    # -- loading -------------------------------------------------------------------------

    def resume_latest(self) -> int:
        """Load the newest valid checkpoint in the directory; returns its step (0 if none).

        Invalid checkpoints (damaged, incomplete, unreadable) are skipped with a warning
        naming each one and why. A valid checkpoint that does not fit this run (another
        configuration or model) is an error, not skipped.

        Raises:
            CheckpointError: checkpoints exist but none is valid, or the newest valid one
                does not fit this run.
        """
        self.wait()
        found = self._on_coordinator(
            lambda: [str(p) for _, p in list_checkpoints(self.directory)], "listing checkpoints"
        )
        self.skipped = []
        for path in map(Path, found):
            try:
                with self._naming_lost(f"verifying {path.name}"):
                    manifest = verify_on_ranks(path, self._group)
            except CheckpointError as error:
                if self.is_coordinator:
                    logger.warning("skipping invalid checkpoint: %s", error)
                self.skipped.append(error)
                continue
            return self._load(
                path, manifest, self.config.allow_reshard, self.config.allow_numerics_change
            )
        if self.skipped:
            raise CheckpointError(
                self.directory,
                None,
                f"none of the {len(found)} checkpoints "
                "is valid: "
                + "; ".join(map(str, self.skipped))
                + ". Move the damaged ones away to start from step 0",
            )
        if self.is_coordinator:
            logger.info("no checkpoint in %s; starting from step 0", self.directory)
        return 0

    def load(
        self,
        path: str | os.PathLike[str],
        *,
        allow_reshard: bool | None = None,
        allow_numerics_change: bool | None = None,
    ) -> int:
        """Load the checkpoint at ``path`` (a ``step-N`` directory); returns its step.

        ``allow_reshard`` and ``allow_numerics_change`` default to the config's.

        Raises:
            CheckpointError: the checkpoint is invalid, or was saved with another
                configuration or model, naming the file and the difference.
        """
        self.wait()
        checkpoint = Path(path).absolute()
        with self._naming_lost(f"verifying {checkpoint.name}"):
            manifest = verify_on_ranks(checkpoint, self._group)
        return self._load(
            checkpoint,
            manifest,
            self.config.allow_reshard if allow_reshard is None else allow_reshard,
            self.config.allow_numerics_change
            if allow_numerics_change is None
            else allow_numerics_change,
        )

    def _load(
        self, path: Path, manifest: Manifest, allow_reshard: bool, allow_numerics_change: bool
    ) -> int:
        metadata = FileSystemReader(path).read_metadata()
        state = self._state_to_load(metadata)
        with self._naming_lost(f"loading {path.name}"):
            problems = check_keys(state, metadata, self._group)
        raise_problems(path, problems)  # another model first: no flag would make it fit
        check_layout(
            path,
            manifest,
            describe_layout(self.pipe),
            allow_reshard,
            allow_numerics_change,
            log=self.is_coordinator,
        )
        try:
            load(state, storage_reader=FileSystemReader(path), process_group=self._group)
        except (Exception, CheckpointException) as error:
            cause, _ = self._describe(error, f"loading {path.name}")
            raise CheckpointError(path, None, f"loading failed: {cause}") from None
        finally:
            self._random.source_rank, self._random.keys = self.rank, None
            if self._optimizer is not None:
                self._optimizer.load_with_state = self._optimizer.saved = None
        if self.is_coordinator:
            logger.info("resumed from %s (step %d)", path, manifest.step)
        self._last_step = manifest.step
        return manifest.step

    def _state_to_load(self, metadata: Metadata) -> dict[str, Any]:
        """The Stateful objects to load into, shaped like what the checkpoint holds."""
        keys = metadata.state_dict_metadata
        if self._optimizer is not None:
            saved = {k.removeprefix("optimizer.") for k in keys if k.startswith("optimizer.state.")}
            self._optimizer.load_with_state, self._optimizer.saved = bool(saved), saved
        own = f"rng.rank{self.rank}."
        source = self.rank if any(k.startswith(own) for k in keys) else 0
        if source != self.rank:
            logger.info(
                "[rank %d] the checkpoint has no random state for this rank (it was "
                "saved on fewer ranks); restoring rank 0's",
                self.rank,
            )
        prefix = f"rng.rank{source}."
        self._random.source_rank = source
        self._random.keys = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
        return self._state()

    @contextmanager
    def _naming_lost(self, doing: str) -> Iterator[None]:
        """Turn the backend's error for a lost rank into a PeerLostError that names it."""
        try:
            yield
        except (CheckpointError, PeerLostError):
            raise
        except RuntimeError as error:
            raise self.pipe.peers.lost_in(self._ranks, doing, error, self.timeout) from error

    def _describe(self, error: BaseException, doing: str) -> tuple[str, PeerLostError | None]:
        """A save's or load's error on one line: DCP's own, one line per failed rank; the
        backend's, naming the lost rank (and that PeerLostError)."""
        if isinstance(error, PeerLostError):
            return str(error), error
        if isinstance(error, CheckpointException) or not isinstance(error, RuntimeError):
            return _summary(error), None
        lost = self.pipe.peers.lost_in(self._ranks, doing, error, self.timeout)
        return str(lost), lost

    def _on_coordinator(self, fn: Callable[[], _T], doing: str) -> _T:
        """Run ``fn`` on the coordinator and hand every rank its result (or its error)."""
        box: list[Any] = [None]
        error: BaseException | None = None
        if self.is_coordinator:
            try:
                box[0] = ("ok", fn())
            except Exception as raised:
                error = raised
                box[0] = ("error", _as_checkpoint_error(raised, self.directory))
        with self._naming_lost(doing):
            dist.broadcast_object_list(box, group=self._group, group_src=0)
        kind, value = box[0]
        if kind == "ok":
            return value  # type: ignore[no-any-return]
        if error is not None:
            raise error
        raise CheckpointError(*value)


class _SavePeerLostError(CheckpointError, PeerLostError):
    """A save failed because a rank stopped answering: caught as either error."""


def _save_error(path: Path, cause: str, lost: PeerLostError | None) -> CheckpointError:
    """The error of a failed save: a PeerLostError too when a rank was lost."""
    if lost is None:
        return CheckpointError(path, None, cause)
    error = _SavePeerLostError(path, None, cause)
    error.lost = lost.lost
    return error


def _as_checkpoint_error(error: BaseException, directory: Path) -> tuple[str, str | None, str]:
    if isinstance(error, CheckpointError):
        return error.path, error.file, error.cause
    return str(directory), None, f"{type(error).__name__}: {error}"


def _summary(error: BaseException) -> str:
    """One line per failed rank, instead of torch's tracebacks."""
    if isinstance(error, CheckpointException):
        parts = []
        for rank, failure in sorted(error.failures.items()):
            cause = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(cause).__name__}: {cause}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"


def _versions() -> dict[str, str]:
    try:
        conveyor = importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:
        conveyor = "unknown"
    return {"torch": torch.__version__, "conveyor": conveyor}


def _check_stateful(value: Any, name: str) -> None:
    if value is not None and not (
        callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    ):
        raise TypeError(
            f"{name} must have state_dict() and load_state_dict() (a Stateful), "
            f"got {type(value).__name__}"
        )


def _check_optimizer(optimizer: torch.optim.Optimizer | None, module: torch.nn.Module) -> None:
    if optimizer is None:
        return
    known = {id(p) for p in module.parameters()}
    foreign = [
        i
        for i, group in enumerate(optimizer.param_groups)
        for p in group["params"]
        if id(p) not in known
    ]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameters that are not this "
            "rank's pipeline parameters (param_groups "
            f"{sorted(set(foreign))}); build it over pipe.parameters()"
        )


def _report_unfinished(reference: weakref.ref[Checkpointer]) -> None:
    """At exit: close a Checkpointer left open, so its group's threads are joined before the
    interpreter finalizes (See Note [threads at exit] in conveyor.runtime.peers), and say so
    if its last save failed (its error would go unseen)."""
    checkpointer = reference()
    if checkpointer is None or checkpointer._closed:
        return
    try:
        checkpointer.close()
    except Exception as error:
        logger.error(
            "the last checkpoint failed (call Checkpointer.close() to see this as "
            "an exception): %s",
            error,
        )
