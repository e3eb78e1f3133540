"""Pipelines over a DeviceMesh: data-parallel replicas (FSDP2), tensor parallelism in a stage.

Modules: ``mesh`` (the dp x pp x tp mesh, sizes checked before any message, the rank layout),
``data_parallel`` (each stage replicated or sharded with FSDP2, gradients reduced once per
step) and ``tensor_parallel`` (a user's plan applied with parallelize_module). Pipeline uses
them when given ``mesh=``, or sizes ``dp=``, ``pp=``, ``tp=``; See Note [pipeline mesh].
"""

from conveyor.parallel.data_parallel import DataParallel
from conveyor.parallel.mesh import MESH_DIMS, MeshShape, PipelineMesh, mesh_shape, pipeline_mesh
from conveyor.parallel.tensor_parallel import TPPlan, parallelize_stages

__all__ = [
    "MESH_DIMS",
    "DataParallel",
    "MeshShape",
    "PipelineMesh",
    "TPPlan",
    "mesh_shape",
    "parallelize_stages",
    "pipeline_mesh",
]
