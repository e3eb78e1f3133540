"""Checkpoints of a dp x pp mesh: one per step for every replica, replicated state written once,
FSDP shards by DCP; resumed bitwise at the same degree, and at another degree, FSDP on or off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import conveyor
from conveyor.checkpoint import Checkpointer
from dist import run_ranks

pytestmark = pytest.mark.dist

WIDTH = 64


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1),
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
    ).double()  # fmt: skip


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def full_state(
    pipe: conveyor.Pipeline, optimizer: torch.optim.Optimizer, group: Any
) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment of the whole model, on every rank of ``group``."""
    mine: dict[str, torch.Tensor] = {}
    for name, param in pipe.named_parameters():
        mine[name] = whole(param)
        for key, value in optimizer.state[param].items():
            mine[f"{name}.{key}"] = whole(value)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return {k: v for part in parts for k, v in part.items()}


def run(directory: Path, steps: int, save_at: int | None = None, **mesh: Any) -> dict[str, Any]:
    """Resume a pipeline on ``mesh`` from ``directory`` and train ``steps`` steps: the step it
    resumed at, the state it loaded, the losses, and the state it saved at ``save_at``."""
    group = mesh.pop("group", None)
    pretrained = mesh.pop("pretrained", None)
    m = mesh.pop("num_microbatches", 2)
    pipe = conveyor.Pipeline(
        model(), group=group, num_microbatches=m, loss_fn=F.mse_loss, broadcast_loss=True, **mesh
    )
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(64, WIDTH).double(), torch.randn(64, WIDTH).double())
    loader = conveyor.ResumableLoader(
        data, 16, num_replicas=pipe.num_replicas, replica=pipe.replica
    )
    result: dict[str, Any] = {"losses": []}
    with Checkpointer(
        pipe, optimizer, data=loader, directory=directory, async_save=False,
        allow_reshard=True, allow_numerics_change=True,
    ) as checkpointer:  # fmt: skip
        result["start"] = start = checkpointer.resume_latest()
        result["loaded"] = full_state(pipe, optimizer, group)
        batches = loader.forever()
        for step in range(start + 1, start + steps + 1):
            x, y = next(batches)
            result["losses"].append(float(pipe.step(x, y)))  # broadcast_loss: every rank
            optimizer.step()
            optimizer.zero_grad()
            if step == save_at:
                checkpointer.save(step)
                result["saved"] = full_state(pipe, optimizer, group)
                if pretrained is not None:
                    pipe.save_pretrained(pretrained)
    return result


def assert_equal(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def distcp_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


def _degrees(rank: int, world_size: int, directory: str) -> None:
    root = Path(directory)
    # dp=2 with FSDP: 3 steps, saved after 2; resumed at dp=2 the third step is bitwise the same
    first = run(root, 3, save_at=2, dp=2, fsdp=True, pretrained=root / "pretrained")
    # save_pretrained on the mesh: the sharded parameters gathered whole, written once
    files = sorted((root / "pretrained").glob("*.safetensors"))
    assert len(files) == 2, files  # one shard per pipeline rank, not per replica
    written = {k: v for f in files for k, v in load_file(f).items()}
    assert_equal(
        written, {k: v for k, v in first["saved"].items() if k in dict(model().named_parameters())}
    )
    again = run(root, 1, dp=2, fsdp=True)
    assert again["start"] == 2 and again["losses"] == first["losses"][2:]
    assert_equal(again["loaded"], first["saved"])
    # ranks 0 and 1 alone: dp=1, a pipeline over a group of its own, with twice the
    # micro-batches (the same global micro-batches): the state loads bitwise, the third loss
    # is the same up to the order of the sums; saved after step 3
    pair = dist.new_group([0, 1])
    shared: list[Any] = [None] * world_size
    single: dict[str, Any] = {}
    if rank < 2:
        single = run(root, 1, save_at=3, group=pair, num_microbatches=4)
        assert single["start"] == 2
        assert_equal(single["loaded"], first["saved"])
        torch.testing.assert_close(single["losses"], first["losses"][2:], rtol=0, atol=1e-12)
    dist.all_gather_object(shared, single.get("saved"))
    # back to dp=2 with FSDP off: the state saved at dp=1 loads bitwise; saved after step 4
    back = run(root, 1, save_at=4, dp=2)
    assert back["start"] == 3
    assert_equal(back["loaded"], shared[0])
    # one checkpoint for the job, replicated state written once: 4 ranks write about what 2 do
    # (4 ranks' random states more; twice the model and optimizer state if it were written
    # by every replica)
    if rank == 0:
        state_bytes = sum(t.numel() * t.element_size() for t in shared[0].values())
        extra = distcp_bytes(root / "step-00000004") - distcp_bytes(root / "step-00000003")
        assert extra < state_bytes / 4, (extra, state_bytes)


def test_a_mesh_checkpoint_resumes_at_another_degree_and_fsdp_setting(tmp_path: Path) -> None:
    run_ranks(_degrees, tmp_path, 4, timeout_s=300, directory=str(tmp_path / "ckpt"))
