"""Run one rank's Program: the interpreter and everything it needs.

Modules: ``interpreter`` (the Runtime: forward, backward, send and receive, one small handler
per action kind), ``comm`` (point-to-point transport of pytrees), ``peers`` (lost peers named:
PeerLostError, the first failure in the store, heartbeats), ``backward``
(split backward: I now, W later), ``recompute`` (activation recomputation modes and rule),
``rng`` (each micro-batch's random stream), ``microbatch`` (splitting and merging batches),
``memory`` (activation accounting), ``batchnorm`` (deferred batch norm), ``tied`` (weights
shared across ranks), ``host_memory`` (keeping freed memory), ``faults`` (fault injection
for recovery tests), ``fingerprint`` (every rank's batch compared before a step),
``input_grads`` (gradients of model inputs read on several ranks), ``inplace`` (stage inputs
written in place) and ``stage_errors`` (errors raised inside a stage). Users reach what they
need through ``conveyor`` and ``Pipeline``.
"""

__all__: list[str] = []
