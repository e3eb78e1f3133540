"""The pipeline's DeviceMesh: named dimensions dp, pp and tp, sizes checked before any message.

mesh = pipeline_mesh(None, config, world_size=4)    # config.dp=2: a (pp=2, dp=2) mesh
pipe_group = mesh.pp_group; replica = mesh.replica  # this rank's pipeline, its replica
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from conveyor.runtime.peers import name_job
from conveyor.torch_compat import backend_options

__all__ = ["MESH_DIMS", "MeshShape", "PipelineMesh", "mesh_shape", "pipeline_mesh"]

logger = logging.getLogger(__name__)

MESH_DIMS = ("pp", "dp", "tp")
"""The dimensions conveyor knows, in the order it builds a mesh (outermost first)."""


# Note [pipeline mesh]:
# A job of dp x pp x tp ranks is one DeviceMesh with named dimensions. Each replica is one
# pipeline: the ranks sharing a dp (and tp) coordinate, which talk point-to-point over the
# group of mesh["pp"] exactly as a lone pipeline talks over the world. The ranks sharing a
# pp (and tp) coordinate hold the same stages and reduce those stages' gradients over
# mesh["dp"] once per step (conveyor.parallel.data_parallel); the ranks sharing dp and pp
# coordinates split each stage's layers over mesh["tp"] (conveyor.parallel.tensor_parallel).
# A mesh conveyor builds is ordered (pp, dp, tp), as Megatron-LM orders its ranks: the
# tensor-parallel ranks, which talk inside every layer, are neighbours (one node); then the
# replicas of a stage, whose all-reduce moves the most bytes; the pipeline's stages, which
# pass one activation per micro-batch, are outermost and may cross nodes. The mesh must span
# the world: clipping, the loss and checkpoints reduce over every rank of it.
@dataclass(frozen=True)
class MeshShape:
    """Sizes of the three dimensions; their product is the world size."""

    dp: int
    pp: int
    tp: int

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp}" + (f" x tp={self.tp}" if self.tp > 1 else "")


def mesh_shape(world_size: int, dp: int | None, pp: int | None, tp: int | None) -> MeshShape:
    """The mesh for ``world_size`` ranks from the sizes given; None is inferred: tp is 1, and
    of dp and pp, one missing size is what the world leaves (both missing: dp is 1).

    Raises:
        ValueError: the world does not divide by the sizes given, or they do not multiply to
            the world size.
    """
    tp = tp or 1
    if dp is None and pp is not None:
        dp = _rest(world_size, {"pp": pp, "tp": tp}, "dp")
    dp = dp or 1
    if pp is None:
        pp = _rest(world_size, {"dp": dp, "tp": tp}, "pp")
    shape = MeshShape(dp, pp, tp)
    if shape.size != world_size:
        raise ValueError(
            f"the mesh {shape} has {shape.size} ranks but the world has {world_size}; "
            f"launch {shape.size} ranks (conveyor run -n {shape.size}) or pass sizes whose "
            f"product is {world_size}"
        )
    return shape


def _rest(world_size: int, given: dict[str, int], name: str) -> int:
    """The size of dimension ``name`` that completes ``given`` to the world."""
    product = 1
    for size in given.values():
        product *= size
    if world_size % product:
        sizes = " x ".join(f"{k}={v}" for k, v in given.items())
        raise ValueError(
            f"a world of {world_size} ranks does not factor into {sizes} x {name}; launch a "
            f"multiple of {product} ranks (conveyor run -n N), or change the sizes"
        )
    return world_size // product


class PipelineMesh:
    """This rank's place in a dp x pp x tp DeviceMesh, and the groups it talks over."""

    def __init__(self, mesh: DeviceMesh) -> None:
        names = _check_names(mesh)
        self.mesh = mesh
        sizes = {name: mesh.size(names.index(name)) if name in names else 1 for name in MESH_DIMS}
        self.shape = MeshShape(sizes["dp"], sizes["pp"], sizes["tp"])
        self.replica = self._coordinate("dp")
        """Index of this rank's replica (its dp coordinate)."""
        self.tp_index = self._coordinate("tp")
        self.pp_group = mesh["pp"].get_group()
        """The group of this replica's pipeline: the runtime's point-to-point group."""
        self.dp_mesh = mesh["dp"] if "dp" in names else None
        """The 1-D mesh of this stage's replicas (None without a dp dimension)."""
        self.tp_mesh = mesh["tp"] if "tp" in names else None
        self.stages_on: Callable[[int], Sequence[int]] | None = None
        """The stages a pipeline rank holds, once the Pipeline has split the model; for
        messages (``place``)."""
        sub = [m.get_group() for m in (self.dp_mesh, self.tp_mesh) if m is not None]
        groups = [self.pp_group, *sub]
        # every rank makes the same meshes in the same order, so the count names the job alike
        scope = f"conveyor/failure/mesh-{next(_MESHES)}"
        name_job(groups, scope, range(dist.get_world_size()), self.place)

    def _coordinate(self, name: str) -> int:
        names = self.mesh.mesh_dim_names or ()
        return self.mesh.get_local_rank(name) if name in names else 0

    @property
    def num_replicas(self) -> int:
        return self.shape.dp

    def place(self, rank: int) -> str:
        """Where global ``rank`` sits in the mesh: 'replica 1, stage 0' (its stages once the
        Pipeline has set ``stages_on``, else its pipeline rank as the stage; ', tp rank 1'
        with tensor parallelism); See Note [rank names] in conveyor.runtime.peers."""
        found = (self.mesh.mesh == rank).nonzero()
        if not len(found):
            return ""
        at = dict(zip(self.mesh.mesh_dim_names or (), found[0].tolist(), strict=True))
        pp = at["pp"]
        stages = list(self.stages_on(pp)) if self.stages_on is not None else [pp]
        if len(stages) == 1:
            held = f"stage {stages[0]}"
        else:
            held = f"stages {', '.join(map(str, stages[:-1]))} and {stages[-1]}"
        text = f"replica {at.get('dp', 0)}, {held}"
        return text + (f", tp rank {at['tp']}" if self.shape.tp > 1 else "")

    def layout(self, stages_on: Callable[[int], Sequence[int]]) -> str:
        """Which global ranks hold which stages of which replica, one line per replica;
        ``stages_on(pipeline_rank)`` names the stages of a pipeline rank."""
        names = list(self.mesh.mesh_dim_names or ())
        ranks = self.mesh.mesh.permute(*[names.index(n) for n in MESH_DIMS if n in names])
        ranks = ranks.reshape(self.shape.pp, self.shape.dp, self.shape.tp)
        lines = [f"mesh {self.shape}: rank -> (replica, stages)"]
        for replica in range(self.shape.dp):
            cells = []
            for pp_rank in range(self.shape.pp):
                held = ",".join(map(str, ranks[pp_rank, replica].tolist()))
                cells.append(f"stages {list(stages_on(pp_rank))} on rank {held}")
            lines.append(f"  replica {replica}: " + " | ".join(cells))
        return "\n".join(lines)


_MESHES = itertools.count()
"""Meshes made in this process, to name each one's failure record."""


def _check_names(mesh: DeviceMesh) -> list[str]:
    names = list(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            "the mesh has no dimension names; create it with named dimensions, e.g. "
            'init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))'
        )
    if "cp" in names:
        raise ValueError(
            f"the mesh has dimensions {names}: context parallelism ('cp') serves generation, "
            "training with it is not built; generate with conveyor.DecodePipeline(model, "
            "mesh=mesh) on a ('pp', 'cp') mesh, and train on a mesh of 'pp' with 'dp' or 'tp'"
        )
    unknown = [n for n in names if n not in MESH_DIMS]
    if unknown or "pp" not in names:
        raise ValueError(
            f"the mesh has dimensions {names}; expected 'pp' and optionally 'dp' and 'tp' "
            f"(unknown: {unknown}); name the pipeline dimension 'pp'"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the mesh holds {mesh.size()} ranks but the world has {dist.get_world_size()}; "
            "a pipeline mesh must span every rank of the job"
        )
    return names


def pipeline_mesh(
    mesh: DeviceMesh | None,
    dp: int | None,
    pp: int | None,
    tp: int | None,
    world_size: int,
    timeout: timedelta,
) -> PipelineMesh | None:
    """The mesh a Pipeline runs on: ``mesh`` itself (checked against the sizes given), one
    built from the sizes (collective; its collectives give up after ``timeout``), or None
    when no size or mesh asks for one.

    Every check happens before any communication.

    Raises:
        ValueError: unnamed or unknown dimensions, sizes that disagree with ``mesh``, or sizes
            that do not factor the world.
    """
    if mesh is not None:
        found = PipelineMesh(mesh)
        wrong = [
            f"{name}={size} but the mesh's is {getattr(found.shape, name)}"
            for name, size in (("dp", dp), ("pp", pp), ("tp", tp))
            if size is not None and size != getattr(found.shape, name)
        ]
        if wrong:
            raise ValueError(f"{'; '.join(wrong)}; pass the mesh alone, or sizes that match it")
        return found
    shape = mesh_shape(world_size, dp, pp, tp)
    if shape.dp == shape.tp == 1:
        return None  # one pipeline over the world, as without a mesh
    device, backend = _device_and_backend()
    options = (backend, backend_options(backend, timeout))
    built = init_device_mesh(
        device,
        (shape.pp, shape.dp, shape.tp),
        mesh_dim_names=MESH_DIMS,
        backend_override=dict.fromkeys(MESH_DIMS, options),
    )
    return PipelineMesh(built)


def _device_and_backend() -> tuple[str, str]:
    """('cpu', 'gloo') for gloo; else this process's accelerator and the world's backend."""
    accelerator = torch.accelerator.current_accelerator()
    backend = str(dist.get_backend())
    if backend == "gloo" or accelerator is None:
        return "cpu", "gloo"
    return accelerator.type, backend
