"""Pipeline: the user's entry point; splits the model, keeps this rank's stages, runs steps.

The parts live beside it: ``build`` (mesh, device, split), ``weights`` (materializing),
``state`` (state_dict and saving), ``step`` (a batch as a step's inputs), ``mesh`` (data and
tensor parallelism), ``recording`` (timelines) and ``training`` (clipping, the loss on every
rank). The class wires them and holds what they share.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from conveyor.config import PLAN_ENV, PipelineConfig, SplitMethod, resolve
from conveyor.graph import StageGraph
from conveyor.hf.loss import model_loss
from conveyor.parallel import TPPlan
from conveyor.pipeline import build, recording
from conveyor.pipeline.decode import DecodePipeline
from conveyor.pipeline.mesh import Reductions, parallelize
from conveyor.pipeline.state import WholeState, save_pretrained, whole
from conveyor.pipeline.step import Batching, check_loss
from conveyor.pipeline.training import clip_grad_norm_, share_loss
from conveyor.pipeline.uninitialized import Unset
from conveyor.pipeline.weights import materialize_stages
from conveyor.program import Program
from conveyor.runtime import microbatch
from conveyor.runtime.batchnorm import DeferredBatchNorm
from conveyor.runtime.comm import P2P
from conveyor.runtime.fingerprint import digest, initial_digest, warn_other_initializations
from conveyor.runtime.host_memory import keep_freed_memory
from conveyor.runtime.interpreter import LossFn, Runtime, RuntimeHooks, StepInputs
from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.tied import Tie, TiedWeights, find_ties
from conveyor.schedule import Schedule, build_program, forward_only, schedule_name
from conveyor.simulator import simulate
from conveyor.trace import Recorder, Timeline, trace_file_name

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)

_MODE = {True: "train", False: "eval"}


class Pipeline:
    """A model cut into stages over the ranks of a process group; each rank runs its own.

        pipe = conveyor.Pipeline(model, balance=[3, 5], num_microbatches=8, loss_fn=loss_fn)
        loss = pipe.step(inputs, targets)   # on every rank; the loss on the last stage's rank
        optimizer.step()                    # over pipe.parameters(): this rank's stages only

    Every rank calls ``step`` with the same batch (as data-parallel scripts do): each rank
    takes the model inputs its stages use from its own copy, and all ranks agree on shapes.
    A model built on the meta device is materialized stage by stage, so no rank ever holds
    more than its own stages.
    """

    def __init__(
        self,
        model: nn.Module | StageGraph,
        config: PipelineConfig | None = None,
        *,
        loss_fn: LossFn | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        schedule: str | Schedule | None = None,
        concrete_args: dict[str, Any] | None = None,
        plan: str | os.PathLike[str] | None = None,
        example_inputs: Any = None,
        mesh: DeviceMesh | None = None,
        tp_plan: TPPlan | None = None,
        weights: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        build.check_model(model, loss_fn)
        if schedule is not None:
            options["schedule"] = schedule_name(schedule)
        config = self.config = resolve(config, plan=plan, options=options)
        if config.keep_host_memory:
            keep_freed_memory()
        self._place(model, mesh, group, tp_plan, plan, device)
        self.loss_fn = loss_fn
        if self.config.deferred_batch_norm and isinstance(model, nn.Module):
            model = DeferredBatchNorm.convert(model, self.config.num_microbatches)
        if not isinstance(model, StageGraph):
            self.config = build.with_layout(self.config, self.num_ranks)
        self._model = model
        held = [model] if isinstance(model, nn.Module) else [s.module for s in model.stages]
        initial = 0 if weights is not None else initial_digest(m for m in held if m is not None)
        planned = os.environ.get(PLAN_ENV) or (
            None if set(options) & set(get_args(SplitMethod)) else plan
        )  # the plan file the split comes from, if any
        self.split_points, self.graph = build.split_as_planned(
            model, self.config, self.num_ranks, concrete_args, example_inputs, planned,
            self.mesh, None if self.mesh is not None else self.group,
        )  # fmt: skip
        self._schedule(schedule)
        ties = find_ties(self.graph, self.config.tie_weights)  # by identity: before materializing
        self._unset = Unset()
        """Tensors of meta-built stages nothing has initialized; See Note [meta materialization]."""
        self.stages = materialize_stages(
            self.graph,
            self.rank,
            self.device,
            model if isinstance(model, nn.Module) else None,
            weights,
            [[name for _, name in tie.users] for tie in ties],
            self._unset,
            self.group,
        )
        self._whole = WholeState(model, self.graph, ties)
        """The whole model's state_dict names and shapes, on every rank."""
        self._warn_if_empty()
        self._connect(ties, tp_plan, initial)
        self.step_index = 0
        self._shares_checked = False
        """Whether the replicas' first shares were compared (DataParallel.check_shares)."""
        self._decoder: DecodePipeline | None = None
        self.recorder: Recorder | None = None
        """This rank's recorder when tracing (trace=True or trace_dir), else None."""
        if self.config.trace or self.config.trace_dir:
            self._start_trace()
        if self._is_first_rank:
            logger.info("%s", self.describe())
            if self.mesh is not None:
                logger.info("%s", self.mesh.layout(self.graph.stages_on))

    # -- construction ----------------------------------------------------------------------

    def _place(
        self,
        model: nn.Module | StageGraph,
        mesh: DeviceMesh | None,
        group: dist.ProcessGroup | None,
        tp_plan: TPPlan | None,
        plan: str | os.PathLike[str] | None,
        device: torch.device | str | None,
    ) -> None:
        """This rank's place: the mesh (None for one pipeline), its pipeline group, rank
        and device."""
        self.mesh = build.mesh_of(model, self.config, mesh, group, tp_plan, plan)
        """This rank's place in the dp x pp x tp mesh; None for one pipeline (no mesh)."""
        if self.mesh is not None:
            group = self.mesh.pp_group
            shape = self.mesh.shape
            self.config = self.config.replace(dp=shape.dp, pp=shape.pp, tp=shape.tp)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = (
            build.usable_device(device) if device is not None else build.default_device(group)
        )

    def _schedule(self, schedule: str | Schedule | None) -> None:
        """This rank's Program, and the digest of what every rank must run alike."""
        config = self.config
        self.topology = self.graph.topology()
        build.check_stage_recompute(config, self.graph)
        if not (callable(schedule) and config.schedule == schedule_name(schedule)):
            schedule = config.schedule  # a name, or a plan's schedule over the script's function
        self.program = build_program(schedule, self.topology, config.num_microbatches)
        self._runs = digest(
            (
                str(self.program),
                [(st.inputs, st.outputs, st.rank) for st in self.graph.stages],
                config.stage_recompute or config.recompute,
                config.loss_reduction,
                config.seed,
            )
        )
        """Digest of what every rank must run alike, compared in each step's batch check."""
        self._inference: dict[int, Program] = {}
        """Forward-only Programs by number of micro-batches (fewer for a smaller batch)."""

    def _connect(self, ties: list[Tie], tp_plan: TPPlan | None, initial: int) -> None:
        """The transport, tied weights, data and tensor parallelism, and the runtime."""
        config = self.config
        p2p = self._p2p = P2P(self.group, self.device, timedelta(seconds=config.timeout_s))
        self.peers = p2p.peers
        """Names lost peers in errors (conveyor.runtime.peers); the Checkpointer uses it too."""
        warn_other_initializations(p2p, initial)  # See Note [one initialization]
        if self.mesh is not None:  # messages place ranks by stage: See Note [rank names]
            self.mesh.stages_on = self.graph.stages_on
        self.ties = TiedWeights(ties, self.graph, self.rank, self.stages, p2p)
        """Parameters shared by stages on several ranks; See Note [tied weights]."""
        self.ties.equalize()
        tied = [shared.param for shared in self.ties.params]
        self.data_parallel = parallelize(
            self.stages, self.mesh, config, self.program, tied, tp_plan
        )
        """This rank's stages over the replicas (FSDP2), or None with one replica."""
        self.ties.rebind(self.stages)
        data = self.data_parallel
        self._reductions = None if data is None else Reductions(data, self._recorded)
        self._runtime = Runtime(
            self.graph,
            self.rank,
            p2p,
            self.device,
            self.loss_fn or model_loss,
            config.stage_recompute or config.recompute,
            config.seed,
            config.measure_memory,
            RuntimeHooks(
                on_agreed=self.ties.check_frozen if self.ties.across else None,
                before_last_backward=None if data is None else data.arm,
                on_weights_done=None if self._reductions is None else self._reductions.stage_done,
            ),
        )
        self._batching = Batching(
            self.graph, config, self.loss_fn, self._model, self.device, self.rank,
            self.stages, data, self._runs, self.replica, self._unset, self._frozen,
        )  # fmt: skip

    def _warn_if_empty(self) -> None:
        if not any(True for _ in self.parameters()):
            logger.warning(
                "rank %d holds no parameters (stages %s); torch.optim refuses an empty "
                "parameter list, so make the optimizer only where there are some: params "
                "= list(pipe.parameters()); optimizer = AdamW(params) if params else None "
                "(or move the cut so that every rank holds parameters)",
                self.rank,
                list(self.stages),
            )

    @property
    def _is_first_rank(self) -> bool:
        """Whether this rank logs for the job: the pipeline's rank 0, or the world's."""
        return self.rank == 0 if self.mesh is None else dist.get_rank() == 0

    def _frozen(self) -> list[int]:
        return [i for i, p in enumerate(self.parameters()) if not p.requires_grad]

    # -- running ---------------------------------------------------------------------------

    def step(self, inputs: Any, targets: Any = None) -> torch.Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad``.

        Returns the batch's loss (detached) on the rank that holds the last stage, None on the
        others; with ``broadcast_loss``, the step's loss over every replica, on every rank.
        With data parallelism the last stage's loss is its replica's part of the global
        batch's mean loss times the number of replicas: its own mean loss when the replicas'
        counts (samples, or counted tokens) are equal.
        Call the optimizer and ``zero_grad`` as in plain training. With data parallelism,
        each replica passes its own share of the global batch (conveyor.data.ResumableLoader
        with ``num_replicas``), the same on every rank of the replica.
        """
        if self.recorder is not None:
            self.recorder.begin_step(self.step_index)
        check_loss(self.loss_fn, targets, self._model)
        self._check_usable()
        step_inputs = self._inputs(inputs, targets, True)
        self._check_shares(step_inputs)
        with self._abandoning(f"step {self.step_index}"), self.ties.summing_gradients():
            if self.data_parallel is not None:
                self.data_parallel.begin_step()
            state = self._runtime.run(self.program[self.rank], step_inputs)
            if self._reductions is not None:
                self._reductions.finish()
        if self.recorder is not None:
            self.recorder.end_step()
        self.step_index += 1
        loss = None
        if state.losses:
            loss = torch.stack([state.losses[k] for k in sorted(state.losses)]).sum().detach()
            if self.data_parallel is not None:
                loss = self.data_parallel.replica_loss(self.config.loss_reduction, loss)
        if not self.config.broadcast_loss:
            return loss
        with self._abandoning(f"step {self.step_index - 1}"):  # names a peer lost meanwhile
            source = self.graph.rank_of(self.graph.sink)
            summed = self.config.loss_reduction == "sum"
            return share_loss(loss, self.device, self.mesh, self.group, source, summed)

    def _inputs(self, inputs: Any, targets: Any, is_training: bool) -> StepInputs:
        return self._batching.inputs(inputs, targets, is_training, self.step_index)

    def _check_shares(self, step_inputs: StepInputs) -> None:
        """On the first step, the replicas compare their shares (See DataParallel)."""
        if self.data_parallel is not None and not self._shares_checked:
            fingerprint = step_inputs.fingerprint
            assert fingerprint is not None
            self.data_parallel.check_shares((fingerprint.inputs, fingerprint.targets))
            self._shares_checked = True

    def forward(self, inputs: Any) -> Any:
        """Inference: the model's output for ``inputs`` on the last stage's rank, else None."""
        self._check_usable()
        step_inputs = self._inputs(inputs, None, False)
        with torch.no_grad(), self._abandoning("a forward"):
            state = self._runtime.run(self._forward_program(step_inputs)[self.rank], step_inputs)
        if self.data_parallel is not None:
            self.data_parallel.reshard()
        if not state.model_outputs:
            return None
        outputs = [state.model_outputs[k] for k in sorted(state.model_outputs)]
        sizes = [microbatch.batch_size(c) for c in step_inputs.microbatches]
        return microbatch.merge(outputs, step_inputs.loss_weights, sizes)

    __call__ = forward

    def _forward_program(self, step: StepInputs) -> Program:
        m = len(step.microbatches)
        if m not in self._inference:
            self._inference[m] = build_program(forward_only, self.topology, m)
        return self._inference[m]

    def compile(self, **options: Any) -> Pipeline:
        """Compile this rank's stages with ``torch.compile(**options)``, in place.

        Call it on every rank after the split. Parameter names stay the model's (the stages
        are compiled in place, as ``nn.Module.compile`` does); a step that compiles (the first,
        and the first with new input shapes or another mode) waits up to ``compile_timeout_s``
        for peers instead of ``timeout_s``. See Note [compiled stages] for split backward.
        """
        for module in self.stages.values():
            module.compile(**options)
        self._runtime.compile_timeout = timedelta(seconds=self.config.compile_timeout_s)
        return self

    def _abandoning(self, doing: str) -> AbstractContextManager[None]:
        """On any error, tell the other ranks that this rank gives up ``doing``, and refuse
        to run again; See Note [abandoned step] in conveyor.runtime.comm."""
        return self._p2p.abandoning(doing)

    def _check_usable(self) -> None:
        self._p2p.check_usable("Pipeline")

    def generate(self, input_ids: Any, config: Any = None, **options: Any) -> torch.Tensor | None:
        """Generate after each prompt with a KV cache on every stage, over this Pipeline's
        split and ranks; arguments as conveyor.DecodePipeline.generate's.

            tokens = pipe.generate(input_ids, max_new_tokens=32)   # on every rank
        """
        if self.data_parallel is None:
            return self.decoder.generate(input_ids, config, **options)
        with self.data_parallel.gathered():  # every replica generates the same tokens
            return self.decoder.generate(input_ids, config, **options)

    @property
    def decoder(self) -> DecodePipeline:
        """The generator over this Pipeline's stages, sharing their parameters (made on first
        use, on every rank: it is collective)."""
        if self._decoder is None:
            self._decoder = DecodePipeline.from_split(
                self._model,
                self.graph,
                self.stages,
                group=self.group,
                device=self.device,
                timeout_s=self.config.timeout_s,
                trace=self.recorder is not None,
            )
        return self._decoder

    # -- timelines -------------------------------------------------------------------------

    def timeline(self, step: int = -1) -> Timeline:
        """Every rank's events of one recorded training step: ``step`` is its index (0: the
        first step), or counts back from the last (-1, the default).

        Collective: call it on every rank of the group; each gets the whole Timeline. Needs
        ``trace=True`` (or ``trace_dir``). Times are seconds from the step's first event.
        """
        return recording.gather(self.recorder, self.num_ranks, step, self.group, self._trace_meta())

    def _trace_meta(self) -> dict[str, Any]:
        return {
            "schedule": self.config.schedule,
            "microbatches": self.config.num_microbatches,
            "ranks": self.num_ranks,
            "split_points": list(self.split_points),
            "recompute": list(self.config.stage_recompute or [self.config.recompute]),
            "replicas": self.num_replicas,
            "tp": 1 if self.mesh is None else self.mesh.shape.tp,
        }

    def _start_trace(self) -> None:
        """Record every step: in memory, and one file per (replica, tp rank, stage rank)."""
        tp_index = 0 if self.mesh is None else self.mesh.tp_index
        name = trace_file_name(self.rank, None if self.mesh is None else self.replica, tp_index)
        header = {"replica": self.replica, "tp": tp_index, "meta": self._trace_meta()}
        self.recorder, sink = recording.start(
            self.rank, self.config, self._p2p, self._runtime, name, header, self._is_first_rank
        )
        if sink is not None:
            weakref.finalize(self, sink.close)  # flushed when the Pipeline goes, or at exit

    def _recorded(self, action: str) -> AbstractContextManager[None]:
        """Record what runs inside as ``action`` when tracing."""
        return recording.recorded(self.recorder, action)

    # -- the mesh ---------------------------------------------------------------------------

    @property
    def replica(self) -> int:
        """Index of this rank's replica (0 without data parallelism)."""
        return 0 if self.mesh is None else self.mesh.replica

    @property
    def num_replicas(self) -> int:
        return 1 if self.mesh is None else self.mesh.num_replicas

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip the whole model's gradients to a global norm of at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` clips a plain model's; returns the norm before
        clipping, on every rank. Collective: call it on every rank of the job.

        The norm is over every stage, replica and shard, a weight tied across stages counted
        once; See Note [global gradient norm] in conveyor.pipeline.training.
        """
        elsewhere = {id(s.param) for s in self.ties.params if s.source != self.rank}
        return clip_grad_norm_(
            list(self.parameters()),
            elsewhere,
            self.mesh,
            self.group,
            max_norm,
            norm_type,
            error_if_nonfinite,
        )

    # -- the local part of the model ------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, for its optimizer."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the model's original qualified names."""
        seen: set[nn.Parameter] = set()
        for module in self.stages.values():
            for name, p in module.named_parameters():
                if p not in seen:
                    seen.add(p)
                    yield name, p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers, keyed like the plain model's state_dict (a
        module registered under two names, under both)."""
        return self._whole.state_dict(self.stages)

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's entries of ``state`` (a full model state_dict works).

        Raises:
            KeyError: with ``strict``, an entry this rank needs is missing from ``state``, or
                ``state`` holds an entry no stage of the model has (on every rank).
            ValueError: an entry's shape is not its parameter's or buffer's.
        """
        self._whole.load(self.stages, state, strict, self.rank)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write the whole model's weights to ``directory`` (collective): each rank writes its
        stages' tensors as one safetensors shard, under the model's own names (a tied weight
        once), and rank 0 the index and, for a transformers model, its config, so that
        ``from_pretrained(directory)`` (or ``load_file`` + ``load_state_dict``) reads it.

        On a mesh, call it on every rank of the job: sharded tensors are gathered whole and
        replica 0's first tensor-parallel pipeline writes them."""
        own = self._whole.own_tensors(self.state_dict(), self.rank)
        # gathering a DTensor is collective over its replicas and tensor-parallel ranks
        tensors = {k: whole(v) for k, v in own.items()}
        writes = self.mesh is None or (self.replica == 0 and self.mesh.tp_index == 0)
        config = getattr(self._model, "config", None)
        return save_pretrained(
            Path(directory), tensors, config, self.group, writes, self.mesh is not None
        )

    def train(self, mode: bool = True) -> Pipeline:
        """Training or evaluation mode, as ``nn.Module.train``.

        Raises:
            ValueError: the split traced code that reads ``self.training`` in the other mode.
        """
        traced = self.graph.training
        if traced is not None and mode != traced:
            name = type(self._model).__name__
            raise ValueError(
                f"{name} was split in {_MODE[traced]} mode into stages that hold for that mode "
                f"only (its traced forward reads self.training, or its export dropped what "
                f"{_MODE[mode]} mode needs, such as attention's dropout): in {_MODE[mode]} mode "
                f"they would still compute the {_MODE[traced]}-mode path. Build another Pipeline "
                "from the model "
                f"in {_MODE[mode]} mode (model.{'train()' if mode else 'eval()'} first) to "
                f"run in {_MODE[mode]} mode, or move the branch into a submodule that lies "
                "wholly inside one stage (only modules that contain a split point are traced)"
            )
        for module in self.stages.values():
            module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def memory(self) -> MemoryReport:
        """Peak activation bytes and micro-batches this rank held since ``reset_memory``."""
        if not self._runtime.meter.enabled:
            raise RuntimeError(
                "memory accounting is off; construct the Pipeline with "
                "measure_memory=True to measure peaks"
            )
        return self._runtime.meter.report()

    def reset_memory(self) -> None:
        """Start a new peak measurement (for example after warm-up steps)."""
        self._runtime.meter.reset()

    def describe(self) -> str:
        """One line: the plan, as logged at start-up."""
        estimate = simulate(self.program, self.topology)
        mesh = "" if self.mesh is None else f"mesh {self.mesh.shape}{' fsdp' * self.config.fsdp} "
        return (
            f"{mesh}schedule={self.config.schedule} stages={self.graph.num_stages} "
            f"ranks={self.num_ranks} microbatches={self.config.num_microbatches} "
            f"{build.split_summary(self.graph, self.split_points)} "
            f"recompute={list(self.config.stage_recompute or ()) or self.config.recompute} "
            f"est. bubble={estimate.bubble_fraction:.0%}"
        )
