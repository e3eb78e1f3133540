"""Interpret one rank's Program: forward, backward, send and receive; no schedule logic."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from conveyor.graph import MODEL_OUTPUT, StageGraph
from conveyor.program import Action, Kind, last_weight_actions
from conveyor.runtime.backward import WeightGrad, backward_input, grad_leaves
from conveyor.runtime.batchnorm import recompute_context, running_stats
from conveyor.runtime.comm import P2P, Meta, Receive
from conveyor.runtime.core import Interpreter
from conveyor.runtime.fingerprint import Fingerprint, agree
from conveyor.runtime.inplace import copying_inputs
from conveyor.runtime.input_grads import InputGradients
from conveyor.runtime.memory import ActivationMeter
from conveyor.runtime.recompute import RecomputeMode, is_recomputed
from conveyor.runtime.rng import RngState, microbatch_seed, rng_stream
from conveyor.runtime.sharded import local
from conveyor.runtime.stage_errors import check_loss, loss_errors, stage_errors
from conveyor.torch_compat import pytree
from conveyor.trace import Recorder

__all__ = ["LossFn", "Runtime", "RuntimeHooks", "StepInputs"]

logger = logging.getLogger(__name__)

LossFn = Callable[[Any, Any], torch.Tensor]
_ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]
_Key = tuple[int, int]  # (stage, micro-batch)


@dataclass(frozen=True)
class StepInputs:
    """What every rank knows about one step: its micro-batches and how to weigh their losses."""

    microbatches: Sequence[dict[str, Any]]
    """Model inputs by name, one dict per micro-batch."""
    signatures: Sequence[str]
    """Shape signature of each micro-batch; shapes between stages are exchanged once per one."""
    targets: Sequence[Any] | None
    loss_weights: Sequence[float]
    step_index: int
    is_training: bool
    fingerprint: Fingerprint | None = None
    """This rank's batch, compared with every other rank's before the first message (See
    Note [batch fingerprint]); None skips the comparison."""
    first_microbatch: int = 0
    """Index of micro-batch 0 in the global batch (replica x micro-batches with data
    parallelism), for its random stream: replicas draw the masks plain training would."""


@dataclass
class _State:
    """Everything one step keeps between actions, keyed by (stage, micro-batch)."""

    inputs: dict[_Key, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[_Key, dict[str, Any]] = field(default_factory=dict)
    rng_end: dict[_Key, RngState] = field(default_factory=dict)
    receives: dict[Action, Receive] = field(default_factory=dict)
    sent_meta: dict[tuple[int, int, int], Meta] = field(default_factory=dict)
    """What the gradients for each sent message look like: (stage, consumer, micro-batch)."""
    input_grads: dict[_Key, dict[str, list[torch.Tensor]]] = field(default_factory=dict)
    weight_grads: dict[_Key, WeightGrad] = field(default_factory=dict)
    """Deferred weight gradients: from a stage's I to its W."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    model_outputs: dict[int, Any] = field(default_factory=dict)


@dataclass
class RuntimeHooks:
    """What the layers around a pipeline (data parallelism, tied weights) do at points of a
    step, handed to the Runtime at construction; each is optional."""

    on_agreed: Callable[[tuple[int, ...]], None] | None = None
    """Called with every rank's trainable digest once a training step's batch check passed,
    before its first message: tied weights check their copies are frozen alike."""
    before_last_backward: Callable[[int, list[torch.Tensor]], None] | None = None
    """Called with a stage and the tensors its step's last B backpropagates from, just before
    it runs: data parallelism arms DDP's reducer then (conveyor.parallel)."""
    on_weights_done: Callable[[int], None] | None = None
    """Called with a stage once the step's last action adding to its weight gradients (its
    last B or W) has run: data parallelism reduces that stage's gradients then, while the rest
    of the step runs (conveyor.parallel.data_parallel)."""


class Runtime(Interpreter):
    """Runs one rank's actions over its local stages, talking to peers through ``P2P``."""

    def __init__(
        self,
        graph: StageGraph,
        rank: int,
        p2p: P2P,
        device: torch.device,
        loss_fn: LossFn | None,
        recompute: RecomputeMode | Sequence[RecomputeMode],
        seed: int,
        measure_memory: bool,
        hooks: RuntimeHooks | None = None,
    ) -> None:
        self.graph = graph
        self.rank = rank
        self.p2p = p2p
        self.device = device
        self.loss_fn = loss_fn
        self.recompute = recompute
        """One mode for every stage, or one per stage (indexed by stage)."""
        self.seed = seed
        self.modules: dict[int, nn.Module] = {}
        for s in graph.stages_on(rank):
            module = graph.stages[s].module
            assert module is not None, f"stage {s} on rank {rank} has no module"
            self.modules[s] = module
        self._calls = {s: copying_inputs(m) for s, m in self.modules.items()}
        """Each stage's module, or a function that copies the inputs it modifies in place
        first; See Note [in-place stage inputs]."""
        self.meter = ActivationMeter(enabled=measure_memory)
        self.meter.exclude(local(p) for m in self.modules.values() for p in m.parameters())
        self.hooks = hooks or RuntimeHooks()
        self._last_backward: set[tuple[int, int]] = set()
        """(stage, micro-batch) of each stage's last B in the step being run."""
        self._meta: dict[_Channel, Meta | Receive] = {}
        """What each channel carries per micro-batch signature, step kind and trainable state:
        the sender sends it in a header with the first message of each key, the receiver
        reads it there, so shapes and which tensors carry gradients cross once per key."""
        self._running_stats: dict[int, list[torch.Tensor]] = {}
        """Each recomputing stage's batch norm running statistics (recompute_context)."""
        self._trainable: tuple[int, ...] = ()
        """Every rank's digest of which of its parameters require gradients, this step."""
        self.compile_timeout: timedelta | None = None
        """Longest wait for a peer in a step that compiles stages (Pipeline.compile)."""
        self._compiled: set[tuple[str, bool]] = set()
        """(signature, is_training) of the micro-batches stages have run (and compiled) for."""
        self._input_grads = InputGradients(graph, rank, p2p)
        """See Note [input gradients]."""

        self._grad_meta: dict[_Channel, Meta] = {}
        """Per channel and signature (as ``_meta``): the gradients that come back for what was
        sent, worked out once rather than per message."""
        self.handlers = {
            Kind.F: self._forward,
            Kind.B: self._backward,
            Kind.I: self._backward_input,
            Kind.W: self._backward_weight,
            Kind.SEND_F: self._send_forward,
            Kind.RECV_F: self._recv_forward,
            Kind.SEND_B: self._send_backward,
            Kind.RECV_B: self._recv_backward,
        }

    def run(self, actions: Sequence[Action], step: StepInputs) -> _State:
        """Execute ``actions`` in order; returns the step's state (losses, outputs)."""
        self._step = step
        self._state = _State()
        hooks = self.hooks
        self._input_grads.begin()
        done = last_weight_actions(actions) if hooks.on_weights_done is not None else {}
        self._last_backward = {
            (a.stage, a.microbatch) for i, a in enumerate(actions) if i in done and a.kind is Kind.B
        }

        def reduce_when_done(index: int, action: Action) -> None:
            if index in done and hooks.on_weights_done is not None:
                hooks.on_weights_done(done[index])

        with torch.set_grad_enabled(step.is_training), self._compile_allowance(step):
            if step.fingerprint is not None:
                what = f"step {step.step_index}" if step.is_training else "a forward() call"
                with self._as_one_wait("batch check" if self.graph.num_ranks > 1 else None):
                    self._trainable = agree(self.p2p, step.fingerprint, what)
                    if hooks.on_agreed is not None and step.is_training:
                        hooks.on_agreed(self._trainable)
            self.execute(actions, reduce_when_done if done else None)
            if step.is_training and self._input_grads.has_work(step.microbatches):
                with self._as_one_wait("input gradients"):
                    self._input_grads.finish(step.microbatches)
            self.p2p.wait_sends()
        state, self._state = self._state, _State()
        return state

    def held_bytes(self) -> int:
        return self.meter.held_bytes

    @contextmanager
    def _as_one_wait(self, describe: str | None) -> Iterator[None]:
        """Record the messages inside as one wait named ``describe`` (they are no action of
        the Program); None: record nothing."""
        recorder, self.p2p.recorder = self.p2p.recorder, None
        start = 0.0 if recorder is None else recorder.now()
        try:
            yield
        finally:
            self.p2p.recorder = recorder
        if recorder is not None and describe is not None:
            recorder.wait(describe, start, recorder.now())

    @contextmanager
    def _compile_allowance(self, step: StepInputs) -> Iterator[None]:
        """Peers wait up to ``compile_timeout`` in a step that compiles (a micro-batch
        signature or mode not seen before), since a rank compiling its stage is silent."""
        keys = {(signature, step.is_training) for signature in step.signatures}
        timeout = self.p2p.timeout
        if self.compile_timeout is None or keys <= self._compiled:
            yield
            return
        self.p2p.timeout = max(timeout, self.compile_timeout)
        try:
            yield
        finally:
            self.p2p.timeout = timeout
        self._compiled |= keys

    # -- forward -------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        s, k = action.stage, action.microbatch
        stage = self.graph.stages[s]
        received = {
            u: self.p2p.wait(self._state.receives.pop(Action(s, Kind.RECV_F, k, u)))
            for u in self.graph.producers(s)
            if self.graph.rank_of(u) != self.rank
        }
        args = [self._input(s, k, name, received) for name in stage.inputs]
        end: list[RngState] = []
        with (
            rng_stream(self._rng_start(s, k, received), self.device, end),
            self.meter.saving((s, k)),
            stage_errors(self.rank, s, k, stage.inputs, args),
        ):
            if self._is_recomputed(k, s):
                out = recompute(
                    self._calls[s],
                    *args,
                    use_reentrant=False,
                    context_fn=self._recompute_context(s, str(action)),
                )
            else:
                out = self._calls[s](*args)
        self._state.rng_end[(s, k)] = end[0]
        if not isinstance(out, tuple) or len(out) != len(stage.outputs):
            raise RuntimeError(
                f"rank {self.rank} (stage {s}): stage module returned "
                f"{type(out).__name__}; expected a tuple of {len(stage.outputs)} "
                f"values {list(stage.outputs)}"
            )
        outputs = dict(zip(stage.outputs, out, strict=True))
        self._state.outputs[(s, k)] = outputs
        if self._step.is_training:
            self.meter.hold((s, k), (self._state.inputs.get((s, k)), out))
        if s == self.graph.sink:
            self._finish(k, outputs[MODEL_OUTPUT])

    def _finish(self, k: int, output: Any) -> None:
        """Loss of micro-batch ``k`` when training; keep the output when not."""
        step = self._step
        if not step.is_training:
            self._state.model_outputs[k] = output
            return
        if self.loss_fn is None:
            raise ValueError("training needs a loss: pass loss_fn to the Pipeline")
        target = None if step.targets is None else step.targets[k]
        with loss_errors(self.rank, self.graph.sink, k, output, target):
            loss = check_loss(self.loss_fn(output, target), self.rank, k)
        weight = step.loss_weights[k]
        # weight 0: nothing to count (every target ignored), and the mean over nothing is NaN
        self._state.losses[k] = loss * weight if weight else loss.nan_to_num(0.0) * 0.0

    def _input(self, s: int, k: int, name: str, received: dict[int, Any]) -> Any:
        """One input value of stage ``s``: from the micro-batch, a local stage, or a peer."""
        producer = self.graph.producer(name)
        if producer is None:
            value = self._step.microbatches[k][name]
            return self._input_grads.leaf(k, name, value) if self._step.is_training else value
        if producer in received:
            value = received[producer]["values"][name]
        else:
            value = pytree.tree_map_only(
                torch.Tensor, _leaf, self._state.outputs[(producer, k)][name]
            )
        self._state.inputs.setdefault((s, k), {})[name] = value
        return value

    def _rng_start(self, s: int, k: int, received: dict[int, Any]) -> RngState | int:
        """Micro-batch ``k``'s random stream as the previous stage left it.

        See Note [micro-batch randomness].
        """
        producers = self.graph.producers(s)
        if not producers:  # a parallel first stage (another branch) draws from its own stream
            seed = microbatch_seed(
                self.seed, self._step.step_index, self._step.first_microbatch + k
            )
            return seed if s == 0 else microbatch_seed(seed, s, 0)
        parent = producers[-1]
        if parent not in received:
            return self._state.rng_end[(parent, k)]
        cpu, *device = received[parent]["rng"]
        return RngState(cpu.cpu(), device[0] if device else None)

    def _recompute_context(self, s: int, forward: str) -> _ContextFn:
        """``context_fn`` of stage ``s``'s checkpointed ``forward``: marks the recomputation
        for DeferredBatchNorm, keeps batch norms' running statistics as the forward left them
        (as plain training updates them: once), and when tracing records it as an event."""
        if s not in self._running_stats:
            self._running_stats[s] = running_stats(self.modules[s])
        stats, recorder = self._running_stats[s], self.recorder

        def context() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
            first, again = recompute_context(stats)
            return first, again if recorder is None else _Recorded(again, recorder, forward)

        return context

    def _is_recomputed(self, k: int, s: int) -> bool:
        mode = self.recompute if isinstance(self.recompute, str) else self.recompute[s]
        return self._step.is_training and is_recomputed(mode, k, len(self._step.microbatches))

    # -- backward ------------------------------------------------------------------------

    def _backward(self, action: Action) -> None:
        s, k = action.stage, action.microbatch
        roots, grads = self._roots(s, k)
        arm = self.hooks.before_last_backward
        if roots and (s, k) in self._last_backward and arm is not None:
            arm(s, roots)
        if roots:
            torch.autograd.backward(roots, grads)
        inputs = self._state.inputs.pop((s, k), {})
        self._state.input_grads[(s, k)] = {
            name: [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                for leaf in grad_leaves(value)
            ]
            for name, value in inputs.items()
            if self.graph.producer(name) is not None
        }
        self._forget_forward(s, k)
        self.meter.release((s, k))

    def _backward_input(self, action: Action) -> None:
        """I: the input gradients, for the producers; the weight gradient waits for W.

        See Note [split backward] in conveyor.runtime.backward.
        """
        s, k = action.stage, action.microbatch
        roots, grads = self._roots(s, k)
        inputs = {
            name: grad_leaves(value)
            for name, value in self._state.inputs.pop((s, k), {}).items()
            if self.graph.producer(name) is not None
        }
        found, weight = backward_input(roots, grads, [x for xs in inputs.values() for x in xs])
        del roots, grads
        found_iter = iter(found)
        self._state.input_grads[(s, k)] = {
            name: [_or_zeros(next(found_iter), leaf) for leaf in leaves]
            for name, leaves in inputs.items()
        }
        self._state.weight_grads[(s, k)] = weight
        self._forget_forward(s, k)
        self.meter.keep_only((s, k), weight.tensors())

    def _backward_weight(self, action: Action) -> None:
        """W: the weight gradients an earlier I of this stage and micro-batch deferred."""
        s, k = action.stage, action.microbatch
        weight = self._state.weight_grads.pop((s, k), None)
        if weight is None:
            raise RuntimeError(
                f"rank {self.rank} (stage {s}): {action} runs before {s}I{k}; a "
                "W needs the I of the same stage and micro-batch first"
            )
        weight.run()
        self.meter.release((s, k))

    def _forget_forward(self, s: int, k: int) -> None:
        """Drop what the forward of ``(s, k)`` kept for its backward: outputs, the random
        stream, and the loss's graph (the loss value stays)."""
        del self._state.outputs[(s, k)]
        self._state.rng_end.pop((s, k), None)
        if s == self.graph.sink and k in self._state.losses:
            self._state.losses[k] = self._state.losses[k].detach()

    def _roots(self, s: int, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Tensors to backpropagate from and their gradients, summed over consumers.

        Gradients travel as flat lists with one entry per output leaf that requires a gradient
        (see ``grad_leaves``), for a local consumer as for a remote one.
        """
        outputs = self._state.outputs[(s, k)]
        totals: dict[str, list[torch.Tensor]] = {}
        for consumer in self.graph.consumers(s):
            names = self.graph.edge_values(s, consumer)
            if self.graph.rank_of(consumer) == self.rank:
                consumed = self._state.input_grads[(consumer, k)]
                per_name = [consumed.pop(name) for name in names]
            else:
                flat = self.p2p.wait(self._state.receives.pop(Action(s, Kind.RECV_B, k, consumer)))
                per_name, start = [], 0
                for name in names:
                    count = len(grad_leaves(outputs[name]))
                    per_name.append(flat[start : start + count])
                    start += count
            for name, grads in zip(names, per_name, strict=True):
                total = totals.get(name)
                totals[name] = (
                    grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
                )
        roots: list[torch.Tensor] = []
        root_grads: list[torch.Tensor | None] = []
        if s == self.graph.sink:
            roots.append(self._state.losses[k])
            root_grads.append(None)
        for name, grads in totals.items():
            roots.extend(grad_leaves(outputs[name]))
            root_grads.extend(grads)
        return roots, root_grads

    # -- communication -------------------------------------------------------------------

    def _send_forward(self, action: Action) -> None:
        s, k, d = action.stage, action.microbatch, action.peer
        assert d is not None
        outputs = self._state.outputs[(s, k)]
        values = {name: outputs[name] for name in self.graph.edge_values(s, d)}
        rng = self._state.rng_end[(s, k)]
        message = {
            "values": values,
            "rng": (rng.cpu,) if rng.device is None else (rng.cpu, rng.device),
        }
        meta = Meta.of(message)
        key = self._channel(s, d, k)
        known = self._meta.get(key)
        assert not isinstance(known, Receive), "a sender's cache holds only what it sent"
        if known is not None and known != meta:
            raise RuntimeError(
                f"rank {self.rank} (stage {s}): the values sent to stage {d} for micro-batch {k} "
                f"changed shape, dtype or gradient requirement for the same input shapes "
                f"({_shapes(known)} before, {_shapes(meta)} now); conveyor exchanges shapes once "
                "per input shape, so a stage's output shapes must depend only on its input "
                "shapes (and which parameters require gradients)"
            )
        self._meta[key] = meta
        grads = self._grad_meta.get(key)
        if grads is None:  # first message of this signature (later ones match it, checked above)
            grads = self._grad_meta[key] = _grad_meta(Meta.of(values))
        self._state.sent_meta[(s, d, k)] = grads
        self.p2p.send(
            message, self.graph.rank_of(d), str(action), header=meta if known is None else None
        )

    def _recv_forward(self, action: Action) -> None:
        s, k, u = action.stage, action.microbatch, action.peer
        assert u is not None
        key = self._channel(u, s, k)
        known = self._meta.get(key)
        if isinstance(known, Receive) and known.meta is not None:
            known = self._meta[key] = known.meta
        if isinstance(known, Meta):
            receive = self.p2p.post(self.graph.rank_of(u), known, str(action))
        else:  # the shapes arrive in a header, with the first message of this signature
            receive = self.p2p.post(self.graph.rank_of(u), None, str(action), same_as=known)
            self._meta.setdefault(key, receive)
        self._state.receives[action] = receive

    def _channel(self, sender: int, receiver: int, k: int) -> _Channel:
        step = self._step
        return sender, receiver, step.signatures[k], step.is_training, self._trainable

    def _send_backward(self, action: Action) -> None:
        s, k, u = action.stage, action.microbatch, action.peer
        assert u is not None
        grads = self._state.input_grads[(s, k)]
        message = [grad for name in self.graph.edge_values(u, s) for grad in grads.pop(name)]
        if not grads:
            del self._state.input_grads[(s, k)]
        self.p2p.send(message, self.graph.rank_of(u), str(action))

    def _recv_backward(self, action: Action) -> None:
        s, k, d = action.stage, action.microbatch, action.peer
        assert d is not None
        meta = self._state.sent_meta.pop((s, d, k))
        self._state.receives[action] = self.p2p.post(self.graph.rank_of(d), meta, str(action))


_Channel = tuple[int, int, str, bool, tuple[int, ...]]
"""(sending stage, receiving stage, micro-batch signature, training, every rank's trainable
digest): messages of one key have one layout."""


class _Recorded:
    """A recomputation's context that also records each recomputation (a split backward may
    run two: one for I, one for W) as a ``recompute <forward>`` event."""

    def __init__(
        self, inner: AbstractContextManager[Any], recorder: Recorder, forward: str
    ) -> None:
        self._inner = inner
        self._recorder = recorder
        self._forward = forward
        self._starts: list[float] = []

    def __enter__(self) -> None:
        self._starts.append(self._recorder.now())
        self._inner.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._inner.__exit__(*exc)
        self._recorder.recompute(self._forward, self._starts.pop(), self._recorder.now())


def _grad_meta(sent: Meta) -> Meta:
    """The message of gradients for ``sent``: a flat list, one per leaf requiring a grad."""
    return Meta.of(
        [
            torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
            for leaf in sent.leaves
            if leaf.requires_grad and leaf.shape is not None
        ]
    )


def _or_zeros(grad: torch.Tensor | None, leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if grad is None else grad


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A new autograd leaf sharing ``tensor``'s data, so each stage backpropagates alone."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def _shapes(meta: Meta) -> str:
    return ", ".join(
        f"{tuple(leaf.shape)} {leaf.dtype}".replace("torch.", "")
        for leaf in meta.leaves
        if leaf.shape is not None
    )
