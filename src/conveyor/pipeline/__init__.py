"""The facades a user constructs: ``Pipeline`` (training, and inference of a split model) and
``DecodePipeline`` (generation), each a model cut into stages over the ranks.

    pipe = Pipeline(model, balance=[3, 3], num_microbatches=8, loss_fn=loss_fn)
    decoder = DecodePipeline(causal_lm, cp=2)

Modules: ``core`` (the Pipeline), ``build`` (from a model and settings to this rank's split,
Program and device), ``weights`` and ``uninitialized`` (stages built on the meta device,
materialized and loaded from files), ``state`` (state_dict, load_state_dict, save_pretrained),
``step`` (a batch as a step's inputs: micro-batches, loss weights, the fingerprint),
``mesh`` (data and tensor parallelism around the stages), ``recording`` (timelines of steps),
``training`` (global gradient clipping, the loss on every rank, throughput), ``faults``
(injected failures, for testing recovery) and ``decode`` (DecodePipeline, generate).
"""

from conveyor.pipeline.core import Pipeline
from conveyor.pipeline.decode import DecodePipeline, GenerationStats, as_causal_lm, generate

__all__ = ["DecodePipeline", "GenerationStats", "Pipeline", "as_causal_lm", "generate"]
