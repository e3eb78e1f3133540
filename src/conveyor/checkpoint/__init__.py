"""Training checkpoints of pipelined runs: atomic, verified, asynchronous, resumable on another
split; built on torch.distributed.checkpoint.

    ckpt = Checkpointer(pipe, optimizer, scheduler=scheduler, data=loader, every=50)
    start = ckpt.resume_latest()            # newest valid checkpoint; 0 if none
    for step in range(start, num_steps): ...; ckpt.maybe_save(step + 1)

A checkpoint ``DIR/step-<N>`` holds every rank's parameters and buffers under the model's own
names, the optimizer's state keyed by those names, the LR scheduler, the step count and
``Pipeline.step_index`` (which seeds dropout), the data position (conveyor.data), every rank's
random generators, and ``manifest.json``: each file's size and SHA-256 and the configuration.
It appears only by a rename once every rank has written and hashed its files, so a directory
named ``step-<N>`` is complete; loading verifies every file first.

``Checkpointer(..., allow_reshard=True)`` loads a checkpoint into another split, placement,
number of stages (virtual stages included) or ranks: the state loads bitwise, and for models
without weights tied across stages the losses go on bitwise too. ``allow_numerics_change``
also admits another schedule, micro-batch count, loss reduction or seed, which change the
order of sums or the dropout streams. ``load_model`` reads a checkpoint into the plain model;
``Pipeline.load_state_dict(model.state_dict())`` starts a pipelined run from a plain one.
"""

from conveyor.checkpoint.checkpointer import Checkpointer, SaveRecord
from conveyor.checkpoint.manifest import CheckpointError, Manifest, list_checkpoints, verify
from conveyor.checkpoint.plain import load_model, model_state_dict, read_checkpoint

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Manifest",
    "SaveRecord",
    "list_checkpoints",
    "load_model",
    "model_state_dict",
    "read_checkpoint",
    "verify",
]
