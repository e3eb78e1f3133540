"""The pipeline mesh (conveyor.parallel.mesh): sizes, names and layout checked before any
message; the rank -> (replica, stage) layout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel

import conveyor
from conveyor.parallel import MeshShape, mesh_shape
from dist import run_ranks


@pytest.mark.parametrize(
    ("world", "sizes", "shape"),
    [
        (8, {"dp": 2}, MeshShape(2, 4, 1)),
        (8, {"pp": 2}, MeshShape(4, 2, 1)),
        (8, {"dp": 2, "tp": 2}, MeshShape(2, 2, 2)),
        (4, {}, MeshShape(1, 4, 1)),
    ],
)
def test_missing_sizes_are_what_the_world_leaves(
    world: int, sizes: dict[str, int], shape: MeshShape
) -> None:
    found = mesh_shape(world, sizes.get("dp"), sizes.get("pp"), sizes.get("tp"))
    assert found == shape and found.size == world


def test_sizes_that_do_not_factor_the_world_are_named() -> None:
    with pytest.raises(ValueError, match=r"world of 6 ranks does not factor into dp=4 x tp=1"):
        mesh_shape(6, 4, None, None)
    with pytest.raises(ValueError, match=r"mesh dp=2 x pp=3 has 6 ranks but the world has 4"):
        mesh_shape(4, 2, 3, None)
    assert str(MeshShape(2, 2, 2)) == "dp=2 x pp=2 x tp=2"


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())


def _errors_and_layout(rank: int, world_size: int) -> None:
    def fails(message: str, **options: object) -> None:
        with pytest.raises(ValueError, match=message):
            conveyor.Pipeline(model(), loss_fn=F.mse_loss, **options)  # type: ignore[arg-type]

    fails(r"world of 2 ranks does not factor into dp=3", dp=3)
    fails(r"mesh dp=2 x pp=2 has 4 ranks but the world has 2", dp=2, pp=2)
    fails(r"tp=2 splits every stage over 2 ranks, which needs a plan", tp=2)
    fails(r"tp_plan is given but there is no tensor parallelism", tp_plan={"0": ColwiseParallel()})
    fails(r"tp_plan entries \['9'\] name no submodule", tp=2, tp_plan={"9": ColwiseParallel()})
    unnamed = init_device_mesh("cpu", (2,))
    fails(r"the mesh has no dimension names", mesh=unnamed)
    other = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "xp"))
    fails(r"expected 'pp' and optionally 'dp' and 'tp' \(unknown: \['xp'\]\)", mesh=other)
    served = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "cp"))
    fails(r"context parallelism \('cp'\) serves generation.*DecodePipeline", mesh=served)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "pp"))
    fails(r"dp=2 but the mesh's is 1", mesh=mesh, dp=2)
    fails(r"pass group= .* or a mesh .*, not both", mesh=mesh, group=mesh["pp"].get_group())
    pipe = conveyor.Pipeline(model(), mesh=mesh, loss_fn=F.mse_loss)
    assert pipe.mesh is not None and (pipe.replica, pipe.num_replicas) == (0, 1)
    assert pipe.mesh.layout(pipe.graph.stages_on) == (
        "mesh dp=1 x pp=2: rank -> (replica, stages)\n"
        "  replica 0: stages [0] on rank 0 | stages [1] on rank 1"
    )
    replicas = conveyor.Pipeline(model(), dp=2, loss_fn=F.mse_loss)  # pp = 1: one stage
    assert replicas.mesh is not None and replicas.mesh.layout(replicas.graph.stages_on) == (
        "mesh dp=2 x pp=1: rank -> (replica, stages)\n"
        "  replica 0: stages [0] on rank 0\n"
        "  replica 1: stages [0] on rank 1"
    )


@pytest.mark.dist
def test_bad_meshes_fail_before_any_message_and_the_layout_is_told(tmp_path: Path) -> None:
    run_ranks(_errors_and_layout, tmp_path, 2, timeout_s=120)


def _lost_replica(rank: int, world_size: int) -> None:
    pipe = conveyor.Pipeline(model(), dp=2, loss_fn=F.mse_loss, timeout_s=5)  # pp = 1
    if rank == 1:
        os._exit(0)  # the replica dies before the step
    started = time.monotonic()
    x = torch.randn(4, 4)
    lost = r"rank 0 \(replica 0, stage 0\): lost rank 1 \(replica 1, stage 0\) while comparing"
    with pytest.raises(conveyor.PeerLostError, match=lost):
        pipe.step(x, x)
    assert time.monotonic() - started < 15


@pytest.mark.dist
def test_a_lost_replica_is_named_within_the_timeout(tmp_path: Path) -> None:
    run_ranks(_lost_replica, tmp_path, 2, timeout_s=120)


def test_a_replicas_own_error_is_not_told_as_a_lost_peer() -> None:
    from conveyor.runtime.peers import about_a_peer

    assert not about_a_peer(RuntimeError("Cannot use ReduceOp.PREMUL_SUM with Gloo"))
    gone = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234"
    assert about_a_peer(RuntimeError(gone))
    assert about_a_peer(RuntimeError("Timed out waiting 5000ms for recv operation"))
    assert about_a_peer(RuntimeError(gone), backend_only=True)
    assert not about_a_peer(RuntimeError("request timed out"), backend_only=True)  # a user's
