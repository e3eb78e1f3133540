"""Checkpoints: what is saved, atomic publication, bitwise resume, resharding, bad checkpoints."""

from __future__ import annotations

import copy
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_graph_pipeline import small_two_tower
from torch import nn
from torch.utils.data import TensorDataset

import conveyor
from conveyor.checkpoint import (
    Checkpointer,
    CheckpointError,
    list_checkpoints,
    load_model,
    model_state_dict,
    read_checkpoint,
    verify,
)
from conveyor.checkpoint.manifest import FileEntry, Manifest
from conveyor.checkpoint.writer import Writer
from conveyor.config import CheckpointConfig
from conveyor.data import ResumableLoader
from conveyor.models import (
    char_ids,
    classification_loss,
    gpt,
    gpt_loss,
    multimodal_batches,
)
from dist import run_ranks

SEQ = 16


def small_gpt(num_layers: int = 2, dim: int = 16, dropout: float = 0.1) -> nn.Sequential:
    """4 layers (embedding, 2 blocks, head) with dropout, so resumes must restore its seeds."""
    torch.manual_seed(0)
    return gpt(seq_len=SEQ, dim=dim, num_layers=num_layers, num_heads=2, dropout=dropout)


def windows() -> TensorDataset:
    ids = char_ids()
    count = (len(ids) - 1) // SEQ
    starts = torch.arange(count) * SEQ
    rows = torch.stack([ids[s : s + SEQ + 1] for s in starts.tolist()])
    return TensorDataset(rows[:, :-1], rows[:, 1:])


class Run:
    """One rank's part of a training run with a Checkpointer (every=2)."""

    def __init__(
        self,
        directory: Path,
        *,
        model: nn.Module | None = None,
        group: dist.ProcessGroup | None = None,
        with_optimizer: bool = True,
        pipeline: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self.pipe = conveyor.Pipeline(
            model or small_gpt(), loss_fn=gpt_loss, group=group, **(pipeline or {})
        )
        self.optimizer = torch.optim.AdamW(self.pipe.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=3, gamma=0.5)
        self.loader = ResumableLoader(windows(), batch_size=8, seed=0)
        self.ckpt = Checkpointer(
            self.pipe,
            self.optimizer if with_optimizer else None,
            scheduler=self.scheduler if with_optimizer else None,
            data=self.loader,
            directory=str(directory),
            every=2,
            **options,
        )
        self.batches = self.loader.forever()

    def train(self, first: int, last: int) -> list[float]:
        """Steps first+1 .. last; every rank gets the losses (from the last stage's rank)."""
        losses = []
        for step in range(first + 1, last + 1):
            inputs, targets = next(self.batches)
            loss = self.pipe.step(inputs, targets)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
            if loss is not None:
                losses.append(loss.item())
            self.ckpt.maybe_save(step)
        gathered: list[Any] = [None] * self.pipe.num_ranks
        dist.all_gather_object(gathered, losses, group=self.pipe.group)
        return max(gathered, key=len)

    def state(self) -> dict[str, Any]:
        """Everything a resume must restore, for bitwise comparison."""
        return {
            "model": {k: v.clone() for k, v in self.pipe.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "data": self.loader.state_dict(),
            "step_index": self.pipe.step_index,
        }


VIRTUAL = {"interleaved-1f1b": (0, 1, 0, 1), "zb-v": (0, 1, 1, 0)}
"""Placements of the schedules that run two stages per rank (4 stages of one layer each)."""


def layout(schedule: str) -> dict[str, Any]:
    """Pipeline options that run ``schedule`` on 2 ranks, virtual stages where it needs them."""
    if schedule in VIRTUAL:
        return {"schedule": schedule, "balance": (1, 1, 1, 1), "placement": VIRTUAL[schedule]}
    return {"schedule": schedule}


def assert_same(actual: Any, expected: Any) -> None:
    """Bitwise equality of nested tensors and values."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    elif type(expected).__module__ == "numpy":  # numpy's generator state
        assert type(actual) is type(expected) and actual.shape == expected.shape
        assert (actual == expected).all()
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    else:
        assert actual == expected


# -- pure parts ---------------------------------------------------------------------------


def test_manifest_round_trips_through_json() -> None:
    manifest = Manifest(
        4, 2, {"num_stages": 2}, {"__0_0.distcp": FileEntry(10, "ab", 0)}, {"torch": "x"}, "now"
    )
    assert Manifest.from_json(manifest.to_json()) == manifest


def test_list_checkpoints_is_newest_first_and_ignores_temporaries(tmp_path: Path) -> None:
    for name in ("step-00000002", "step-00000010", ".tmp-step-00000012-ab-0", "notes"):
        (tmp_path / name).mkdir()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10, 2]
    assert list_checkpoints(tmp_path / "absent") == []
    assert list_checkpoints(str(tmp_path)) == list_checkpoints(tmp_path)  # a str path too


def test_checkpoint_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        CheckpointConfig(every=0)
    with pytest.raises(ValueError, match="keep must be >= 0"):
        CheckpointConfig(keep=-1)


# -- one real checkpoint, then damaged copies of it -----------------------------------------


def _save_two(rank: int, world_size: int, directory: str, out: str) -> None:
    run = Run(Path(directory), keep=0)
    run.train(0, 4)
    run.ckpt.close()
    torch.save(run.pipe.state_dict(), Path(out) / f"model-rank{rank}.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's directory with checkpoints of steps 2 and 4, and each rank's model at step 4."""
    root = tmp_path_factory.mktemp("saved")
    run_ranks(_save_two, root, 2, timeout_s=180, directory=str(root / "ckpt"), out=str(root))
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt", target)
    return target / "step-00000004"


def _flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


DAMAGE = {
    "truncated rank file": (
        lambda c: _truncate(c / "__1_0.distcp"),
        r"__1_0\.distcp: rank 1's data file has \d+ bytes but the manifest "
        r"records \d+: the file is truncated",
    ),
    "flipped byte": (
        lambda c: _flip_byte(c / "__0_0.distcp"),
        r"__0_0\.distcp: rank 0's data file has changed since it was written",
    ),
    "flipped byte in metadata": (
        lambda c: _flip_byte(c / ".metadata", 50),
        r"\.metadata: the coordinator's index file has changed",
    ),
    "missing manifest": (
        lambda c: (c / "manifest.json").unlink(),
        r"manifest\.json: missing; the checkpoint was never completed",
    ),
    "damaged manifest": (
        lambda c: (c / "manifest.json").write_text('{"format": 1'),
        r"manifest\.json: is not a valid conveyor manifest",
    ),
    "manifest of another step": (
        lambda c: shutil.copy(c.parent / "step-00000002" / "manifest.json", c),
        r"manifest\.json: belongs to step 2, but the directory step-00000004 is step 4's: the "
        r"manifest was copied from another checkpoint, or the directory was renamed",
    ),
    "missing metadata": (
        lambda c: (c / ".metadata").unlink(),
        r"\.metadata: the coordinator's index file is missing",
    ),
    "missing rank file": (
        lambda c: (c / "__1_0.distcp").unlink(),
        r"__1_0\.distcp: rank 1's data file is missing",
    ),
    "not a directory": (
        lambda c: (shutil.rmtree(c), c.write_text("x")),
        r"cannot read the directory: .*Not a directory",
    ),
}


@pytest.mark.dist
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_checkpoint_is_named_with_its_file_and_cause(
    saved: Path, tmp_path: Path, kind: str
) -> None:
    checkpoint = _copy(saved, tmp_path)
    verify(checkpoint), verify(str(checkpoint))  # intact before the damage; a str path too
    damage, message = DAMAGE[kind]
    damage(checkpoint)
    pattern = f"checkpoint {re.escape(str(checkpoint))}: {message}"
    with pytest.raises(CheckpointError, match=pattern):
        verify(checkpoint)
    with pytest.raises(CheckpointError, match=pattern):  # never a bare library assertion
        read_checkpoint(checkpoint)


@pytest.mark.dist
@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_checkpoint_directory_is_named(saved: Path, tmp_path: Path) -> None:
    checkpoint = _copy(saved, tmp_path)
    checkpoint.chmod(0)
    try:
        with pytest.raises(CheckpointError, match=r"cannot read the directory: .*Permission"):
            verify(checkpoint)
    finally:
        checkpoint.chmod(0o755)


@pytest.mark.dist
def test_checkpoint_loads_into_the_plain_model(saved: Path) -> None:
    checkpoint = saved / "ckpt" / "step-00000004"
    expected = {**torch.load(saved / "model-rank0.pt"), **torch.load(saved / "model-rank1.pt")}
    plain = small_gpt()
    manifest = load_model(checkpoint, plain)
    assert manifest.step == 4
    assert_same(plain.state_dict(), expected)
    assert_same(model_state_dict(checkpoint), expected)
    progress = read_checkpoint(checkpoint, "progress.")
    assert progress == {"step": 4, "step_index": 4}
    with pytest.raises(
        CheckpointError,
        match=r"parameter-name mismatch with Sequential: "
        r"missing \['3.mlp.0.bias'",
    ):
        load_model(checkpoint, small_gpt(num_layers=3))


@pytest.mark.dist
def test_manifest_records_every_file_and_the_configuration(saved: Path) -> None:
    checkpoint = saved / "ckpt" / "step-00000004"
    manifest = verify(checkpoint)
    assert set(manifest.files) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert set(os.listdir(checkpoint)) == set(manifest.files) | {"manifest.json"}
    assert {name: entry.rank for name, entry in manifest.files.items()} == {
        ".metadata": None,
        "__0_0.distcp": 0,
        "__1_0.distcp": 1,
    }
    assert all(
        entry.size == (checkpoint / name).stat().st_size for name, entry in manifest.files.items()
    )
    layout = manifest.layout
    assert (layout["num_stages"], layout["num_ranks"], layout["placement"]) == (2, 2, [0, 1])
    assert (layout["schedule"], layout["num_microbatches"]) == ("1f1b", 4)
    assert manifest.step == 4 and manifest.world_size == 2
    assert sorted(p.name for p in (saved / "ckpt").iterdir()) == [
        ".lock",  # the run's lock on the directory: held by no one now
        "step-00000002",
        "step-00000004",
    ]  # nothing temporary left


# -- resume ---------------------------------------------------------------------------------


def _resume(rank: int, world_size: int, root: str) -> None:
    for index, schedule in enumerate(sorted(conveyor.SCHEDULES)):
        async_save = index % 2 == 0  # each way on half the schedules: saving is the same
        directory = Path(root) / f"{schedule}-{async_save}"
        options: dict[str, Any] = {"pipeline": layout(schedule), "async_save": async_save}
        reference = Run(directory / "reference", **options)
        expected = reference.train(0, 8)
        expected_state = reference.state()
        reference.ckpt.close()
        published = [step for step, _ in list_checkpoints(directory / "reference")]
        assert published == [8, 6, 4]  # every=2, keep=3: older ones deleted
        leftovers = [p.name for p in (directory / "reference").iterdir()]
        assert all(name.startswith("step-") or name == ".lock" for name in leftovers)

        first = Run(directory / "run", **options)
        assert first.train(0, 5) == expected[:5]  # saved at 2 and 4, lost after 5
        first.ckpt.close()  # the process is lost: its lock on the directory with it
        saved_rng = (torch.get_rng_state(), random.getstate())
        torch.manual_seed(123)  # a restarted process starts elsewhere
        random.seed(123)

        second = Run(directory / "run", **options)
        assert second.ckpt.resume_latest() == 4, schedule
        assert torch.equal(torch.get_rng_state(), saved_rng[0])
        assert random.getstate() == saved_rng[1]
        assert second.train(4, 8) == expected[4:], f"{schedule}: resumed losses differ"
        assert_same(second.state(), expected_state)
        second.ckpt.close()


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_resume_continues_bitwise_for_every_schedule(tmp_path: Path) -> None:
    run_ranks(_resume, tmp_path, 2, timeout_s=560, root=str(tmp_path))


def _asynchronous(rank: int, world_size: int, root: str) -> None:
    release = threading.Event()
    write_data = Writer.write_data

    def held(self: Writer, plan: Any, planner: Any) -> Any:
        assert release.wait(60), "the test never released the writer"
        return write_data(self, plan, planner)

    Writer.write_data = held  # type: ignore[method-assign]
    try:
        run = Run(Path(root), keep=0)
        run.train(0, 1)
        snapshot = {k: v.clone() for k, v in run.pipe.state_dict().items()}
        run.ckpt.save(2)  # returns after the snapshot, while the writer is held
        assert list_checkpoints(Path(root)) == []
        run.train(2, 3)  # the next update mutates every parameter meanwhile
        assert all(not torch.equal(snapshot[k], v) for k, v in run.pipe.named_parameters())
        threading.Timer(0.5, release.set).start()
        run.ckpt.save(4)  # at most one save in flight: waits until step 2 is published
        assert 2 in [step for step, _ in list_checkpoints(Path(root))]
        run.ckpt.close()
    finally:
        Writer.write_data = write_data  # type: ignore[method-assign]
    assert [step for step, _ in list_checkpoints(Path(root))] == [4, 2]
    saved = model_state_dict(Path(root) / "step-00000002")
    assert_same({k: saved[k] for k in snapshot}, snapshot)  # what the model was at save()


@pytest.mark.dist
def test_save_snapshots_and_writes_in_the_background(tmp_path: Path) -> None:
    run_ranks(_asynchronous, tmp_path, 2, timeout_s=180, root=str(tmp_path))


# -- resharding -----------------------------------------------------------------------------


def _reshard(rank: int, world_size: int, root: str) -> None:
    base_dir = Path(root) / "base"
    base = Run(base_dir, keep=0)
    expected = base.train(0, 8)  # 1f1b, 4 micro-batches, stages [0 1 | 2 3]
    base.ckpt.close()
    checkpoint = base_dir / "step-00000004"
    saved = model_state_dict(checkpoint)

    def resumed(
        name: str,
        *,
        group: dist.ProcessGroup | None = None,
        numerics: bool = False,
        model: nn.Module | None = None,
        **pipeline: Any,
    ) -> list[float]:
        run = Run(
            Path(root) / name,
            group=group,
            pipeline=pipeline,
            allow_reshard=True,
            allow_numerics_change=numerics,
            model=model,
        )
        assert run.ckpt.load(checkpoint) == 4
        assert_same(dict(run.pipe.state_dict()), {k: saved[k] for k in run.pipe.state_dict()})
        assert run.pipe.step_index == 4 and run.loader.state_dict()["batch_index"] == 4
        losses = run.train(4, 8)
        run.ckpt.close()
        return losses

    # another balance computes the same thing: the losses go on bit for bit
    assert resumed("balance", balance=(1, 3)) == expected[4:]
    with pytest.raises(
        CheckpointError,
        match=r"manifest\.json: configuration mismatch: .*"
        r"split_points \['2'\] -> \['1'\].*allow_reshard=True",
    ):
        Run(Path(root) / "refused-split", pipeline={"balance": (1, 3)}).ckpt.load(checkpoint)
    with pytest.raises(
        CheckpointError,
        match=r"num_microbatches 4 -> 8.*"
        r"allow_numerics_change=True",
    ):
        Run(Path(root) / "refused", pipeline={"num_microbatches": 8}, allow_reshard=True).ckpt.load(
            checkpoint
        )
    # other schedules (virtual stages included) may add micro-batch gradients in another order
    for schedule in sorted(set(conveyor.SCHEDULES) - {"1f1b"}):
        losses = resumed(schedule, numerics=True, **layout(schedule))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected[4:]))
    # more micro-batches: another summation order (and, with dropout, other random streams:
    # micro-batch k holds other samples), so compare without dropout
    no_dropout = Run(Path(root) / "no-dropout", model=small_gpt(dropout=0.0), keep=0)
    plain_expected = no_dropout.train(0, 8)
    no_dropout.ckpt.close()
    checkpoint = Path(root) / "no-dropout" / "step-00000004"
    saved = model_state_dict(checkpoint)
    losses = resumed(
        "microbatches", numerics=True, model=small_gpt(dropout=0.0), num_microbatches=8
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_expected[4:]))
    checkpoint = base_dir / "step-00000004"
    saved = model_state_dict(checkpoint)

    # fewer ranks: the whole model on one rank (each rank runs its own copy, so both create
    # the same process groups); then back onto two ranks from that checkpoint
    alone = [dist.new_group([r]) for r in range(world_size)]
    assert resumed(f"one-rank-{rank}", group=alone[rank]) == expected[4:]
    dist.barrier()
    again = Run(Path(root) / "two-again", allow_reshard=True)
    assert again.ckpt.load(Path(root) / "one-rank-0" / "step-00000006") == 6
    assert again.train(6, 8) == expected[6:]
    again.ckpt.close()


@pytest.mark.dist
@pytest.mark.timeout(600)
def test_checkpoint_loads_into_another_split(tmp_path: Path) -> None:
    run_ranks(_reshard, tmp_path, 2, timeout_s=560, root=str(tmp_path))


def _reference_loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_microbatches: int
) -> torch.Tensor:
    """Plain training's loss, micro-batch k seeded as conveyor seeds it (step 0)."""
    total = torch.zeros((), dtype=torch.float64)
    for k, (xk, yk) in enumerate(
        zip(
            torch.tensor_split(x, num_microbatches),
            torch.tensor_split(y, num_microbatches),
            strict=True,
        )
    ):
        torch.manual_seed(conveyor.microbatch_seed(0, 0, k))
        total = total + gpt_loss(model(xk), yk) * (len(xk) / len(x))
    return total


def _seeded(rank: int, world_size: int) -> None:
    torch.manual_seed(7)  # another initialization than the pipeline's own
    plain = gpt(seq_len=SEQ, dim=16, num_layers=2, num_heads=2, dropout=0.1).double()
    pipe = conveyor.Pipeline(small_gpt().double(), loss_fn=gpt_loss, num_microbatches=4)
    pipe.load_state_dict(plain.state_dict())
    assert_same(dict(pipe.state_dict()), {k: plain.state_dict()[k] for k in pipe.state_dict()})
    x, y = windows()[:8]
    loss = pipe.step(x, y)
    expected = _reference_loss(plain, x, y, 4)
    if loss is not None:
        torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)


@pytest.mark.dist
def test_plain_state_dict_seeds_a_pipelined_run(tmp_path: Path) -> None:
    run_ranks(_seeded, tmp_path, 2, timeout_s=120)


# -- bad checkpoints in a run -----------------------------------------------------------------


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _bad(rank: int, world_size: int, root: str, source: str) -> None:
    directory = Path(root) / "ckpt"
    if rank == 0:
        shutil.copytree(source, directory)
        _truncate(directory / "step-00000004" / "__1_0.distcp")
    dist.barrier()
    warnings = _Collect()
    logging.getLogger("conveyor.checkpoint").addHandler(warnings)
    run = Run(directory)
    assert run.ckpt.resume_latest() == 2  # the newest is damaged: the one before it is used
    assert [str(e) for e in run.ckpt.skipped] == [
        f"checkpoint {directory / 'step-00000004'}: __1_0.distcp: rank 1's data file has "
        f"{(directory / 'step-00000004' / '__1_0.distcp').stat().st_size} bytes but the manifest "
        f"records {(Path(source) / 'step-00000004' / '__1_0.distcp').stat().st_size}: the file "
        "is truncated"
    ]
    if rank == 0:
        assert [m for m in warnings.messages if "skipping invalid checkpoint" in m] == [
            f"skipping invalid checkpoint: {run.ckpt.skipped[0]}"
        ]
    with pytest.raises(CheckpointError, match=r"step-00000004: __1_0\.distcp: rank 1's data"):
        run.ckpt.load(directory / "step-00000004")
    run.ckpt.close()
    dist.barrier()
    if rank == 0:
        (directory / "step-00000002" / "manifest.json").unlink()
    dist.barrier()
    with pytest.raises(
        CheckpointError,
        match=r"none of the 2 checkpoints is valid: .*"
        r"step-00000004: __1_0\.distcp: .*step-00000002: manifest\.json: missing",
    ):
        Run(directory).ckpt.resume_latest()

    good = Path(source) / "step-00000004"
    with pytest.raises(
        CheckpointError,
        match=r"step-00000004: manifest\.json: configuration "
        r"mismatch: this run splits or places the model differently",
    ):
        Run(Path(root) / "split", pipeline={"balance": (1, 3)}).ckpt.load(good)
    with pytest.raises(
        CheckpointError,
        match=r"step-00000004: \.metadata: parameter-name "
        r"mismatch: \d+ of this model's parameters and buffers are not in the "
        r"checkpoint, e\.g\. \['3\.mlp\.0\.bias'.*\(and 1 more problem\)",
    ):
        Run(Path(root) / "names", model=small_gpt(num_layers=3)).ckpt.load(good)  # not a split
    with pytest.raises(
        CheckpointError,
        match=r"\.metadata: shape mismatch: .*\[16, 16\] float32 "
        r"in the checkpoint but \[16, 32\] float32 here",
    ):
        Run(Path(root) / "shapes", model=small_gpt(dim=32)).ckpt.load(good)
    bare = Run(Path(root) / "bare", with_optimizer=False)
    bare.train(0, 2)
    bare.ckpt.close()
    with pytest.raises(
        CheckpointError,
        match=r"entries this run restores are not in the "
        r"checkpoint, e\.g\. \['optimizer\.param_groups\..*it was saved without",
    ):
        Run(Path(root) / "with-optimizer").ckpt.load(Path(root) / "bare" / "step-00000002")
    own = Path(root) / f"own-{rank}"  # a directory per node: no checkpoint would be whole
    own.mkdir()
    with pytest.raises(CheckpointError, match=r"do not share the checkpoint directory \(rank 0 "):
        Run(own)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_resume_skips_damaged_checkpoints_and_names_mismatches(saved: Path, tmp_path: Path) -> None:
    run_ranks(_bad, tmp_path, 2, timeout_s=240, root=str(tmp_path), source=str(saved / "ckpt"))


def test_loader_leaves_the_global_generator_alone() -> None:
    state = torch.get_rng_state()
    loader = ResumableLoader(TensorDataset(torch.arange(20)), batch_size=4, seed=1)
    batches = loader.forever()
    for _ in range(7):
        next(batches)
    assert torch.equal(torch.get_rng_state(), state)


def tied_gpt() -> nn.Sequential:
    """Embedding and output projection share one weight; on 2 ranks the tie spans them."""
    torch.manual_seed(0)
    return gpt(seq_len=SEQ, dim=16, num_layers=2, num_heads=2, dropout=0.1, tie_embeddings=True)


def _tied(rank: int, world_size: int, root: str) -> None:
    base = Run(Path(root) / "base", model=tied_gpt(), keep=0)
    expected = base.train(0, 6)
    base.ckpt.close()
    checkpoint = Path(root) / "base" / "step-00000004"
    saved = model_state_dict(checkpoint)
    assert torch.equal(saved["0.tokens.weight"], saved["3.out.weight"])  # both names, equal
    alone = [dist.new_group([r]) for r in range(world_size)]  # one rank holds both users
    one = Run(Path(root) / f"one-{rank}", model=tied_gpt(), group=alone[rank], allow_reshard=True)
    assert one.ckpt.load(checkpoint) == 4
    assert_same(dict(one.pipe.state_dict()), saved)
    # the tied gradient is now one sum over both users, not two sums added: close, not equal
    torch.testing.assert_close(torch.tensor(one.train(4, 6)), torch.tensor(expected[4:]))
    one.ckpt.close()
    dist.barrier()
    two = Run(Path(root) / "two", model=tied_gpt(), allow_reshard=True)
    assert two.ckpt.load(Path(root) / "one-0" / "step-00000006") == 6  # split apart again
    resplit = model_state_dict(Path(root) / "one-0" / "step-00000006")
    assert_same(dict(two.pipe.state_dict()), {k: resplit[k] for k in two.pipe.state_dict()})
    plain = tied_gpt()
    load_model(checkpoint, plain)
    assert_same(plain.state_dict(), saved)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_tied_weights_reshard_across_ranks(tmp_path: Path) -> None:
    run_ranks(_tied, tmp_path, 2, timeout_s=240, root=str(tmp_path))


# -- a graph pipeline (DAG): two towers joined by a head ----------------------------------


def _towers(directory: Path, schedule: str) -> tuple[conveyor.Pipeline, Any, Checkpointer]:
    model = small_two_tower(dropout=0.1)
    pipe = conveyor.Pipeline(
        model,
        stage_modules=("text", "image", "head"),
        placement=(0, 1, 1),
        schedule=schedule,
        num_microbatches=3,
        loss_fn=classification_loss,
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    return pipe, optimizer, Checkpointer(pipe, optimizer, directory=str(directory), every=2)


def _dag_resume(rank: int, world_size: int, root: str) -> None:
    batches = multimodal_batches(6, 8, vocab_size=16, seq_len=6, num_patches=4, patch_dim=6)

    def train(
        run: tuple[conveyor.Pipeline, Any, Checkpointer], first: int, last: int
    ) -> list[float]:
        pipe, optimizer, ckpt = run
        losses = []
        for step in range(first + 1, last + 1):
            loss = pipe.step(*batches[step - 1])
            optimizer.step()
            optimizer.zero_grad()
            losses.append(None if loss is None else loss.item())
            ckpt.maybe_save(step)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, losses)
        return [value for rank_losses in gathered for value in rank_losses if value is not None]

    for schedule in ("gpipe", "graph-gpipe", "graph-1f1b"):  # tower B and the head: rank 1
        reference = _towers(Path(root) / schedule / "reference", schedule)
        expected = train(reference, 0, 6)
        first = _towers(Path(root) / schedule / "run", schedule)
        assert train(first, 0, 5) == expected[:5]
        first[2].close()
        second = _towers(Path(root) / schedule / "run", schedule)
        assert second[2].resume_latest() == 4
        assert train(second, 4, 6) == expected[4:], schedule
        assert_same(dict(second[0].state_dict()), dict(reference[0].state_dict()))
        for run in (reference, second):
            run[2].close()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_graph_pipeline_resumes_bitwise(tmp_path: Path) -> None:
    run_ranks(_dag_resume, tmp_path, 2, timeout_s=240, root=str(tmp_path))


class WithAuxiliaryHead(nn.Module):
    """A GPT whose auxiliary head the forward never calls: its parameters never get a
    gradient, so the optimizer never holds state for them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = small_gpt()
        self.aux = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def _unused_head(rank: int, world_size: int, root: str) -> None:
    options: dict[str, Any] = {"pipeline": {"split_points": ["body.2"]}}
    torch.manual_seed(0)
    reference = Run(Path(root) / "reference", model=WithAuxiliaryHead(), **options)
    expected = reference.train(0, 6)
    expected_state = reference.state()
    reference.ckpt.close()
    torch.manual_seed(0)
    first = Run(Path(root) / "run", model=WithAuxiliaryHead(), **options)
    assert first.train(0, 5) == expected[:5]
    first.ckpt.close()  # the process is lost: its lock on the directory with it
    torch.manual_seed(0)
    second = Run(Path(root) / "run", model=WithAuxiliaryHead(), **options)
    assert second.ckpt.resume_latest() == 4
    assert second.train(4, 6) == expected[4:]
    assert_same(second.state(), expected_state)  # the head: its weights, and no optimizer state
    if rank == 0:
        assert "aux.weight" in second.pipe.state_dict()
    second.ckpt.close()


@pytest.mark.dist
def test_a_head_the_forward_never_calls_is_saved_and_resumed(tmp_path: Path) -> None:
    run_ranks(_unused_head, tmp_path, 2, timeout_s=200, root=str(tmp_path))


@pytest.mark.dist  # a process of its own, or seconds of measuring
def test_a_second_run_on_the_same_directory_is_refused_naming_the_first(
    one_rank: None, tmp_path: Path
) -> None:
    """Two runs on one directory would take each other's checkpoints and sweep each other's
    saves in progress: the coordinator locks the directory while its Checkpointer is open."""
    pipe = conveyor.Pipeline(nn.Sequential(nn.Linear(4, 4)), loss_fn=nn.functional.mse_loss)
    directory = tmp_path / "ckpt"
    first = Checkpointer(pipe, directory=directory)
    other_process = subprocess.run(
        [sys.executable, "-c", _TAKE_LOCK, str(directory)], capture_output=True, text=True
    )
    assert f"another run is using this checkpoint directory (pid {os.getpid()} on" in (
        other_process.stderr
    )
    with pytest.raises(CheckpointError, match="a Checkpointer of this process on the same"):
        Checkpointer(pipe, directory=directory)
    first.close()  # the lock goes with it (or with the process, if it dies)
    Checkpointer(pipe, directory=directory).close()


_TAKE_LOCK = """
import sys
from pathlib import Path
from conveyor.checkpoint.lock import DirectoryLock
DirectoryLock.take(Path(sys.argv[1]))
"""
