"""Training checkpoints of pipelined runs: atomic, verified, asynchronous, resumable on another
split; built on torch.distributed.checkpoint.

    ckpt = Checkpointer(pipe, optimizer, scheduler=scheduler, data=loader, every=50)
    start = ckpt.resume_latest()            # newest valid checkpoint; 0 if none
    for step in range(start, num_steps): ...; ckpt.maybe_save(step + 1)
"""

from conveyor.checkpoint.checkpointer import Checkpointer, SaveRecord
from conveyor.checkpoint.manifest import CheckpointError, Manifest, list_checkpoints, verify
from conveyor.checkpoint.plain import load_model, model_state_dict, read_checkpoint

__all__ = [
    "CheckpointError", "Checkpointer", "Manifest", "SaveRecord", "list_checkpoints",
    "load_model", "model_state_dict", "read_checkpoint", "verify",
]
