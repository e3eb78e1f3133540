"""Pipeline: the user's entry point; splits the model, keeps this rank's stages, runs steps."""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO, get_args

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from conveyor.config import PLAN_ENV, PipelineConfig, SplitMethod, read_plan, resolve
from conveyor.files import write_atomic
from conveyor.graph import StageGraph
from conveyor.huggingface import LABELS, initializer, label_counts, model_loss, takes_labels
from conveyor.inference.pipeline import DecodePipeline
from conveyor.parallel import (
    DataParallel,
    PipelineMesh,
    TPPlan,
    parallelize_stages,
    pipeline_mesh,
)
from conveyor.parallel.data_parallel import local
from conveyor.parallel.tensor_parallel import check_plan
from conveyor.program import Program
from conveyor.runtime import microbatch
from conveyor.runtime.batchnorm import DeferredBatchNorm
from conveyor.runtime.comm import P2P, Meta
from conveyor.runtime.fingerprint import (
    autocast_state,
    digest,
    fingerprint,
    initial_digest,
    warn_other_initializations,
)
from conveyor.runtime.host_memory import keep_freed_memory
from conveyor.runtime.interpreter import LossFn, Runtime, RuntimeHooks, StepInputs
from conveyor.runtime.loss import LossReduction, counted_tokens, loss_weights
from conveyor.runtime.memory import MemoryReport
from conveyor.runtime.tied import Tie, TiedWeights, find_ties
from conveyor.schedule import (
    Schedule,
    build_program,
    forward_only,
    schedule_name,
    spec_of,
    stage_placement,
)
from conveyor.simulator import simulate
from conveyor.split import (
    balance_to_split_points,
    bind_inputs,
    even_balance,
    split_by_modules,
    split_model,
)
from conveyor.split.auto import auto_split
from conveyor.split.export import place_on
from conveyor.split.stages import EXPORTED
from conveyor.torch_compat import is_compiled, pytree
from conveyor.trace import REDUCE, Recorder, Timeline, merge, trace_file_name
from conveyor.training import clip_grad_norm_, share_loss
from conveyor.uninitialized import Unset, listed
from conveyor.weights import WeightFiles, materialize, save_stage_files, unread, write_index

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
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized; launch with `conveyor run "
                "-n N script.py` (or torchrun) and call "
                "torch.distributed.init_process_group() before Pipeline(...)"
            )
        if is_compiled(model):
            raise TypeError(
                "the model was compiled (torch.compile(model)), which cannot be split: it is "
                "one compiled graph around the whole model. Pass the uncompiled model and "
                "call pipe.compile() to compile each stage on its own rank"
            )
        if schedule is not None:
            options["schedule"] = schedule_name(schedule)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a function (outputs, targets) -> scalar loss, got "
                f"{type(loss_fn).__name__} {loss_fn!r}"
            )
        config = self.config = resolve(config, plan=plan, options=options)
        if config.keep_host_memory:
            keep_freed_memory()
        self.mesh = _mesh(model, config, mesh, group, tp_plan, plan)
        """This rank's place in the dp x pp x tp mesh; None for one pipeline (no mesh)."""
        if self.mesh is not None:
            group = self.mesh.pp_group
            shape = self.mesh.shape
            config = self.config = config.replace(dp=shape.dp, pp=shape.pp, tp=shape.tp)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.device = _usable(device) if device is not None else _default_device(group)
        self.loss_fn = loss_fn
        if config.deferred_batch_norm and isinstance(model, nn.Module):
            model = DeferredBatchNorm.convert(model, config.num_microbatches)
        if not isinstance(model, StageGraph):
            config = self.config = _with_layout(config, self.num_ranks)
        self._model = model
        held = [model] if isinstance(model, nn.Module) else [s.module for s in model.stages]
        initial = 0 if weights is not None else initial_digest(m for m in held if m is not None)
        planned = os.environ.get(PLAN_ENV) or (
            None if set(options) & set(get_args(SplitMethod)) else plan
        )  # the plan file the split comes from, if any
        self.split_points, self.graph = _split_as_planned(
            model, config, self.num_ranks, concrete_args, example_inputs, planned, self.mesh
        )
        self.topology = self.graph.topology()
        if (
            config.stage_checkpoint is not None
            and len(config.stage_checkpoint) != self.graph.num_stages
        ):
            raise ValueError(
                f"stage_checkpoint {list(config.stage_checkpoint)} has "
                f"{len(config.stage_checkpoint)} modes for {self.graph.num_stages} "
                "stages; give one mode per stage"
            )
        if not (callable(schedule) and config.schedule == schedule_name(schedule)):
            schedule = config.schedule  # a name, or a plan's schedule over the script's function
        self.program = build_program(schedule, self.topology, config.num_microbatches)
        self._runs = digest(
            (
                str(self.program),
                [(st.inputs, st.outputs, st.rank) for st in self.graph.stages],
                config.stage_checkpoint or config.checkpoint,
                config.loss_reduction,
                config.seed,
            )
        )
        """Digest of what every rank must run alike, compared in each step's batch check."""
        self._inference: dict[int, Program] = {}
        """Forward-only Programs by number of micro-batches (fewer for a smaller batch)."""
        ties = find_ties(self.graph, config.tie_weights)  # by identity: before materializing
        self._unset = Unset()
        """Tensors of meta-built stages nothing has initialized; See Note [meta materialization]."""
        self.stages = self._materialize(ties, weights)
        self._tied_names = ties
        self._aliases, self._shapes = _whole_state(model, self.graph)
        """A held tensor's other names that no stage holds; the shape of every tensor of the
        whole model's state_dict, on every rank, so every rank checks a state_dict alike."""
        if not any(True for _ in self.parameters()):
            logger.warning(
                "rank %d holds no parameters (stages %s); torch.optim refuses an empty "
                "parameter list, so make the optimizer only where there are some: params "
                "= list(pipe.parameters()); optimizer = AdamW(params) if params else None "
                "(or move the cut so that every rank holds parameters)",
                self.rank,
                list(self.stages),
            )
        p2p = self._p2p = P2P(group, self.device, timedelta(seconds=config.timeout_s))
        self.peers = p2p.peers
        """Names lost peers in errors (conveyor.runtime.peers); the Checkpointer uses it too."""
        warn_other_initializations(p2p, initial)  # See Note [one initialization]
        if self.mesh is not None:  # messages place ranks by stage: See Note [rank names]
            self.mesh.stages_on = self.graph.stages_on
        self.ties = TiedWeights(ties, self.graph, self.rank, self.stages, p2p)
        """Parameters shared by stages on several ranks; See Note [tied weights]."""
        self.ties.equalize()
        self.data_parallel = self._parallelize(tp_plan)
        """This rank's stages over the replicas (FSDP2), or None with one replica."""
        self.ties.rebind(self.stages)
        data = self.data_parallel
        self._runtime = Runtime(
            self.graph,
            self.rank,
            p2p,
            self.device,
            loss_fn or model_loss,
            config.stage_checkpoint or config.checkpoint,
            config.seed,
            config.measure_memory,
            RuntimeHooks(
                on_agreed=self.ties.check_frozen if self.ties.across else None,
                before_last_backward=None if data is None else data.arm,
                on_weights_done=None if data is None else self._reduce_stage,
            ),
        )
        self.step_index = 0
        self._shares_checked = False
        """Whether the replicas' first shares were compared (DataParallel.check_shares)."""
        self._decoder: DecodePipeline | None = None
        self.recorder: Recorder | None = None
        """This rank's recorder when tracing (trace=True or trace_dir), else None."""
        if config.trace or config.trace_dir:
            self._start_trace(p2p)
        if self.rank == 0 if self.mesh is None else dist.get_rank() == 0:
            logger.info("%s", self.describe())
            if self.mesh is not None:
                logger.info("%s", self.mesh.layout(self.graph.stages_on))

    def _parallelize(self, tp_plan: TPPlan | None) -> DataParallel | None:
        """Split this rank's stages over the tensor-parallel ranks, then wrap them for data
        parallelism; See Note [pipeline mesh]."""
        mesh, config = self.mesh, self.config
        if mesh is None:
            return None
        if mesh.tp_mesh is not None and tp_plan:
            self._check_tensor_parallel()
            parallelize_stages(self.stages, mesh.tp_mesh, tp_plan)
        if mesh.dp_mesh is None or mesh.num_replicas == 1:
            if config.fsdp:
                logger.warning("fsdp=True has nothing to shard over with one replica; ignored")
            return None
        return DataParallel(
            self.stages,
            mesh.dp_mesh,
            fsdp=config.fsdp,
            split_backward=self.program.has_split_backward,
            tensor_parallel=mesh.tp_mesh is not None and bool(tp_plan),
            tied=[shared.param for shared in self.ties.params],
            timeout=timedelta(seconds=config.timeout_s),
            reshard_after_forward=config.reshard_after_forward,
            reduction=config.loss_reduction,
        )

    def _check_tensor_parallel(self) -> None:
        """Refuse what tensor parallelism cannot run, before any message: split backward (its
        weight gradients are DTensors, which it cannot keep from I to W), and stages split
        through torch.export (their modules are graph modules, not the nn.Linear and
        nn.Embedding a plan shards)."""
        if self.program.has_split_backward:
            raise ValueError(
                f"schedule {self.config.schedule!r} splits the backward into I and W, which "
                "tensor parallelism does not support; pick gpipe, 1f1b or interleaved-1f1b "
                "with tp, or drop tp"
            )
        exported = [
            s for s, module in self.stages.items()
            if isinstance(module, fx.GraphModule) and module.meta.get(EXPORTED)
        ]  # fmt: skip
        if exported:
            raise ValueError(
                "tensor parallelism shards nn.Linear and nn.Embedding modules, but this model "
                "was split through torch.export, whose stages hold graph modules (as Hugging "
                "Face models are split); split it with tracer='fx' if torch.fx traces it, or "
                "scale it with data parallelism (dp, fsdp=True) instead of tp"
            )

    def _reduce_stage(self, stage: int) -> None:
        """Reduce a stage's gradients over the replicas as soon as its backward is done (a
        stage whose reduction is in flight already: its wait comes at the step's end)."""
        assert self.data_parallel is not None
        if stage not in self.data_parallel.in_flight:
            with self._recorded(f"{REDUCE} {stage}"):
                self.data_parallel.stage_done(stage)

    def _finish_reductions(self) -> None:
        """Wait for the reductions in flight (recorded as the stages' reductions), then
        reduce the parameters two local stages share."""
        assert self.data_parallel is not None
        for stage in self.data_parallel.in_flight:
            with self._recorded(f"{REDUCE} {stage}"):
                self.data_parallel.wait(stage)
        self.data_parallel.end_step()

    @contextmanager
    def _recorded(self, action: str) -> Iterator[None]:
        """Record what runs inside as ``action`` when tracing."""
        recorder = self.recorder
        start = 0.0 if recorder is None else recorder.now()
        yield
        if recorder is not None:
            recorder.add(action, start, recorder.now())

    def _materialize(
        self, ties: list[Tie], weights: str | os.PathLike[str] | None
    ) -> dict[int, nn.Module]:
        """This rank's stages on its device: tensors read from ``weights`` as
        ``from_pretrained`` reads them, meta tensors the files lack initialized by the model's
        own modules (conveyor.weights). With ``weights``, the ranks then check together that
        every file key a stage needs was read (collective)."""
        model = self._model if isinstance(self._model, nn.Module) else None
        tied = [[name for _, name in tie.users] for tie in ties]
        files = WeightFiles(weights, model, tied) if weights is not None else None
        stages = {}
        problem = ""
        try:
            for s in self.graph.stages_on(self.rank):
                module = self.graph.stages[s].module
                assert module is not None
                if isinstance(module, fx.GraphModule) and module.meta.get(EXPORTED):
                    place_on(module, self.device)
                stages[s] = materialize(
                    module,
                    self.device,
                    initialize=initializer(model) if model is not None else initializer(module),
                    owners=model,
                    files=files,
                    unset=self._unset,
                )
        except ValueError as error:
            if files is None:
                raise
            problem = str(error)  # every rank learns of it below, instead of waiting
        if files is not None:
            self._check_read(files, problem)
        return stages

    def _check_read(self, files: WeightFiles, problem: str) -> None:
        """Raise on every rank if a rank failed to load (``problem``), or if a file key that
        ``from_pretrained`` would read into a stage's tensor was read by no rank; warn about
        keys it would leave too. See Note [weights as from_pretrained reads them]."""
        reports: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(reports, (problem, sorted(files.used)), group=self.group)
        failed = [(r, p) for r, (p, _) in enumerate(reports) if p]
        if failed:
            rank, first = failed[0]
            raise ValueError(first if rank == self.rank else f"rank {rank}: {first}")
        held = {k for st in self.graph.stages if st.module is not None
                for k in st.module.state_dict(keep_vars=True)}  # fmt: skip
        missed = unread(files, held, [k for _, used in reports for k in used])
        if missed:
            raise ValueError(
                f"weights in {files.directory}: {listed(missed)} fill tensors of this model "
                "(as from_pretrained reads them), but no rank read them; this is a conveyor "
                "bug, please report it with the model's class; build the model on a real "
                "device and load it with from_pretrained meanwhile"
            )
        if self.rank == 0 and files.keys.ignored:
            logger.warning(
                "weights in %s: %s fill no tensor of %s and were not loaded (from_pretrained "
                "leaves them too)",
                files.directory,
                listed(files.keys.ignored),
                type(self._model).__name__,
            )

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write the whole model's weights to ``directory`` (collective): each rank writes its
        stages' tensors as one safetensors shard, under the model's own names (a tied weight
        once), and rank 0 the index and, for a transformers model, its config, so that
        ``from_pretrained(directory)`` (or ``load_file`` + ``load_state_dict``) reads it.

        On a mesh, call it on every rank of the job: sharded tensors are gathered whole and
        replica 0's first tensor-parallel pipeline writes them."""
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        # gathering a DTensor is collective over its replicas and tensor-parallel ranks
        tensors = {k: _whole(v) for k, v in self._own_tensors().items()}
        if self.mesh is None or (self.replica == 0 and self.mesh.tp_index == 0):
            shard = save_stage_files(tensors, target, self.rank, self.num_ranks)
            shards: list[Any] = [None] * self.num_ranks
            dist.all_gather_object(shards, shard, group=self.group)
            if self.rank == 0:
                config = getattr(self._model, "config", None)
                if config is not None and hasattr(config, "to_json_string"):
                    write_atomic(target / "config.json", config.to_json_string())
                write_index(target, shards)
        dist.barrier(group=self.group if self.mesh is None else None)
        return target

    def _own_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's state_dict without the names of tied weights another rank writes, or
        that are another name of a tensor this rank writes."""
        state: dict[str, torch.Tensor] = {}
        written: set[tuple[int, tuple[int, ...]]] = set()
        for name, tensor in self.state_dict().items():
            where = (local(tensor).data_ptr(), tuple(tensor.shape))
            if where not in written:  # one tensor under two names in one stage: once
                written.add(where)
                state[name] = tensor
        for tie in self._tied_names:
            for _, name in tie.users[1:]:
                state.pop(name, None)
            if self.graph.rank_of(tie.users[0][0]) != self.rank:
                state.pop(tie.name, None)
        return state

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
        recorder = self.recorder
        if recorder is not None:
            recorder.begin_step(self.step_index)
        self._check_loss(targets)
        self._check_usable()
        step_inputs = self._inputs(inputs, targets, True)
        if self.data_parallel is not None and not self._shares_checked:
            fingerprint = step_inputs.fingerprint
            assert fingerprint is not None
            self.data_parallel.check_shares((fingerprint.inputs, fingerprint.targets))
            self._shares_checked = True
        with self._abandoning(f"step {self.step_index}"), self.ties.summing_gradients():
            if self.data_parallel is not None:
                self.data_parallel.begin_step()
            state = self._runtime.run(self.program[self.rank], step_inputs)
            if self.data_parallel is not None:
                self._finish_reductions()
        if recorder is not None:
            recorder.end_step()
        self.step_index += 1
        loss = None
        if state.losses:
            loss = torch.stack([state.losses[k] for k in sorted(state.losses)]).sum().detach()
            if self.data_parallel is not None:
                loss = self.data_parallel.replica_loss(self.config.loss_reduction, loss)
        if not self.config.broadcast_loss:
            return loss
        with self._abandoning(f"step {self.step_index - 1}"):  # names a peer lost meanwhile
            return share_loss(self, loss)

    def _check_loss(self, targets: Any) -> None:
        """A loss_fn with targets, or no loss_fn and labels for the model's own loss."""
        model = self._model
        own = self.loss_fn is None and targets is None and isinstance(model, nn.Module)
        if (self.loss_fn is None or targets is None) and not own:
            raise ValueError(
                f"step() trains, which needs a loss: pass loss_fn=... to Pipeline "
                f"and targets to step() (loss_fn is "
                f"{'set' if self.loss_fn else 'None'}, targets is "
                f"{'set' if targets is not None else 'None'}), or, without loss_fn, labels in "
                "the batch of a model that computes its own loss (a Hugging Face model); use "
                "forward() for inference"
            )
        if own and isinstance(model, nn.Module) and not takes_labels(model):
            raise ValueError(
                f"step() trains, which needs a loss: {type(model).__name__} takes no labels, "
                "so it computes no loss of its own; pass loss_fn=... to Pipeline and targets "
                "to step()"
            )

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
        split and ranks; arguments as conveyor.inference.DecodePipeline.generate's.

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
        if self.recorder is None:
            raise RuntimeError(
                "this Pipeline records no timeline; create it with trace=True "
                "(or trace_dir=DIR, or run under `conveyor run --trace DIR`)"
            )
        part = self.recorder.timeline(self.num_ranks, step)
        parts: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(parts, part, group=self.group)
        return merge(parts, self._trace_meta())

    def _trace_meta(self) -> dict[str, Any]:
        return {
            "schedule": self.config.schedule,
            "microbatches": self.config.num_microbatches,
            "ranks": self.num_ranks,
            "split_points": list(self.split_points),
            "checkpoint": list(self.config.stage_checkpoint or [self.config.checkpoint]),
            "replicas": self.num_replicas,
            "tp": 1 if self.mesh is None else self.mesh.shape.tp,
        }

    def _start_trace(self, p2p: P2P) -> None:
        recorder = Recorder(self.rank)
        self._runtime.recorder = recorder
        p2p.recorder = recorder
        self.recorder = recorder
        if self.config.trace_dir:
            directory = os.path.abspath(self.config.trace_dir)
            recorder.sink = self._trace_file(recorder, directory)
            if self.rank == 0 if self.mesh is None else dist.get_rank() == 0:
                logger.info(
                    "tracing to %s; render with `conveyor trace %s`",
                    directory,
                    self.config.trace_dir,
                )

    def _trace_file(self, recorder: Recorder, directory: str) -> TextIO:
        """This rank's trace file (one per replica and stage rank), its header written;
        line-buffered, so each step is on disk when step() returns, even if the run dies."""
        os.makedirs(directory, exist_ok=True)
        tp_index = 0 if self.mesh is None else self.mesh.tp_index
        name = trace_file_name(self.rank, None if self.mesh is None else self.replica, tp_index)
        sink = open(os.path.join(directory, name), "w", buffering=1)  # noqa: SIM115
        weakref.finalize(self, sink.close)  # flushed when the Pipeline goes, or at exit
        head = {**recorder.header(), "replica": self.replica, "tp": tp_index}
        sink.write(json.dumps({**head, "meta": self._trace_meta()}) + "\n")
        return sink

    def _inputs(self, inputs: Any, targets: Any, is_training: bool) -> StepInputs:
        m = self.config.num_microbatches
        bound = bind_inputs(self.graph, inputs)
        size = microbatch.batch_size(bound)
        if not is_training and size:  # inference: a batch smaller than m runs as it is
            m = min(m, size)
        chunks = microbatch.split(bound, m, size)
        _check_targets(targets, size)
        split_targets = None if targets is None else microbatch.split(targets, m, size)
        if is_training and self.loss_fn is None and bound.get(LABELS) is None:
            raise ValueError(
                f"the batch has no {LABELS!r}: without loss_fn, the model computes its own loss "
                f"and needs its labels; pass them in the batch, e.g. {{'input_ids': ids, "
                f"'{LABELS}': ids}}"
            )
        weights: Sequence[float] = [1.0] * m
        if size:
            kind, counts = self._loss_counts(chunks, split_targets)
            data = self.data_parallel
            if data is None or not is_training or self.graph.sink not in self.stages:
                weights = loss_weights(kind, counts)  # over the replicas: for the loss only
            else:
                weights = data.loss_weights(kind, counts)
        where = f"rank {self.rank} (stages {list(self.stages)})"
        frozen = [i for i, p in enumerate(self.parameters()) if not p.requires_grad]
        mine = fingerprint(
            bound,
            targets,
            is_training,
            self.device,
            size,
            self._unset.problem(where),
            frozen,
            self._runs,
        )
        return StepInputs(
            chunks,
            [_signature(c, self.device) for c in chunks],
            split_targets,
            weights,
            self.step_index,
            is_training,
            fingerprint=mine,
            first_microbatch=self.replica * m,
        )

    def _loss_counts(
        self, chunks: list[dict[str, Any]], targets: list[Any] | None
    ) -> tuple[LossReduction, list[int]]:
        """How micro-batch losses add up and what each averages over (samples, or counted
        tokens); conveyor.runtime.loss turns them into the micro-batches' weights."""
        reduction = self.config.loss_reduction
        own_loss = self.loss_fn is None and chunks and chunks[0].get(LABELS) is not None
        if own_loss and isinstance(self._model, nn.Module):  # the model's own loss
            counts = label_counts(self._model, [chunk[LABELS] for chunk in chunks], chunks[0])
            return ("sum" if reduction == "sum" else "mean"), counts
        if reduction == "token_mean" and targets is not None:
            return reduction, [counted_tokens(t) for t in targets]
        return reduction, [microbatch.batch_size(c) or 0 for c in chunks]

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
        once; See Note [global gradient norm] in conveyor.training.
        """
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

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
        state: dict[str, torch.Tensor] = {}
        for module in self.stages.values():
            state.update(module.state_dict())
        for name, others in self._aliases.items():
            if name in state:
                state.update(dict.fromkeys(others, state[name]))
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's entries of ``state`` (a full model state_dict works).

        Raises:
            KeyError: with ``strict``, an entry this rank needs is missing from ``state``, or
                ``state`` holds an entry no stage of the model has (on every rank).
            ValueError: an entry's shape is not its parameter's or buffer's.
        """
        unexpected = sorted(k for k in state if k not in self._shapes)
        if strict and unexpected:
            raise KeyError(
                f"rank {self.rank}: state has entries no stage of the model holds: "
                f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}; pass a "
                "state_dict of the same model, or strict=False to ignore them"
            )
        wrong = [_shapes(k, v, self._shapes[k]) for k, v in state.items() if k in self._shapes]
        wrong = [w for w in wrong if w]
        if wrong:
            raise ValueError(
                f"rank {self.rank}: state has entries of other shapes: "
                f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; pass a "
                "state_dict of a model of the same sizes"
            )
        for s, module in self.stages.items():
            current = module.state_dict()
            wanted = current.keys()
            missing = [k for k in wanted if k not in state]
            if missing and strict:
                raise KeyError(
                    f"rank {self.rank} (stage {s}): state lacks {missing[:5]}"
                    f"{' ...' if len(missing) > 5 else ''}; pass a state_dict of the "
                    "same model, or strict=False to keep the current values"
                )
            module.load_state_dict(
                {k: _placed_like(state[k], current[k]) for k in wanted if k in state},
                strict=False,
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
            f"{_split_summary(self.graph, self.split_points)} "
            f"checkpoint={list(self.config.stage_checkpoint or ()) or self.config.checkpoint} "
            f"est. bubble={estimate.bubble_fraction:.0%}"
        )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whole on this rank: a DTensor's shards gathered (collective), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _placed_like(value: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """``value`` (a whole tensor) as this rank's part of ``current`` when that is a DTensor
    (data or tensor parallelism): each rank slices its own shard, without communication."""
    if not isinstance(current, DTensor) or isinstance(value, DTensor):
        return value
    return distribute_tensor(
        value.to(current.device), current.device_mesh, current.placements, src_data_rank=None
    )


def _mesh(
    model: nn.Module | StageGraph,
    config: PipelineConfig,
    mesh: DeviceMesh | None,
    group: dist.ProcessGroup | None,
    tp_plan: TPPlan | None,
    plan: str | os.PathLike[str] | None = None,
) -> PipelineMesh | None:
    """The mesh of ``mesh=`` or of the config's sizes (None: one pipeline over ``group``);
    every check runs before any communication, and names a plan file that set the sizes.
    See Note [pipeline mesh]."""
    sized = any(size not in (None, 1) for size in (config.dp, config.tp))
    if group is not None and (mesh is not None or sized):
        raise ValueError(
            "pass group= (one pipeline over a process group of your own) or a mesh (mesh=, "
            "or sizes dp=, pp=, tp=), not both"
        )
    names = list(mesh.mesh_dim_names or ()) if mesh is not None else []
    tp = mesh.size(names.index("tp")) if mesh is not None and "tp" in names else config.tp or 1
    if tp > 1 and not tp_plan:
        raise ValueError(
            f"tp={tp} splits every stage over {tp} ranks, which needs a plan: pass "
            'tp_plan={"module.name": ColwiseParallel(), ...} (torch.distributed.tensor.parallel)'
        )
    if tp_plan and tp == 1:
        raise ValueError(
            "tp_plan is given but there is no tensor parallelism; pass tp=N, or a mesh with "
            "a 'tp' dimension"
        )
    if tp_plan:
        check_plan(tp_plan, _module_names(model))
    if group is not None:
        return None
    timeout = timedelta(seconds=config.timeout_s)
    try:
        return pipeline_mesh(mesh, config.dp, config.pp, config.tp, dist.get_world_size(), timeout)
    except ValueError as error:
        _blame_plan(error, plan)
        raise


def _module_names(model: nn.Module | StageGraph) -> list[str]:
    modules = [model] if isinstance(model, nn.Module) else [s.module for s in model.stages]
    return [name for m in modules if m is not None for name, _ in m.named_modules()]


def _split_summary(graph: StageGraph, split_points: tuple[str, ...]) -> str:
    """'split before [...]' for a chain; the edges and depth of a graph pipeline."""
    if graph.depth == graph.num_stages:
        return f"split before {list(split_points)}"
    edges = [f"{s.index}->{c}" for s in graph.stages for c in graph.consumers(s.index)]
    return f"graph depth={graph.depth} edges={edges}"


def _shapes(name: str, given: Any, shape: torch.Size) -> str:
    """``name`` with both shapes if ``given`` is a tensor of another shape than ``shape``."""
    if not isinstance(given, torch.Tensor) or given.shape == shape:
        return ""
    return f"{name} {tuple(given.shape)} (the model's: {tuple(shape)})"


def _whole_state(
    model: nn.Module | StageGraph, graph: StageGraph
) -> tuple[dict[str, list[str]], dict[str, torch.Size]]:
    """(aliases, shapes) of the whole model's state_dict: the shape of each tensor every
    stage holds, under each of its names; and the names no stage holds, by the name a stage
    holds the same tensor by (a module registered twice, ``self.out = self.shared``, is
    traced by one of its names, while the plain state_dict has both)."""
    held = {k: v for st in graph.stages if st.module is not None
            for k, v in st.module.state_dict().items()}  # fmt: skip
    aliases = _aliases(model, set(held))
    shapes = {k: v.shape for k, v in held.items() if isinstance(v, torch.Tensor)}
    for name, others in aliases.items():
        shapes.update(dict.fromkeys(others, shapes[name]) if name in shapes else {})
    return aliases, shapes


def _aliases(model: nn.Module | StageGraph, held: set[str]) -> dict[str, list[str]]:
    """Names of the plain model's tensors not in ``held``, by a held name of the same
    tensor."""
    if not isinstance(model, nn.Module):
        return {}
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(tensor), []).append(name)
    aliases: dict[str, list[str]] = {}
    for names in by_tensor.values():
        kept = [n for n in names if n in held]
        if kept and len(kept) < len(names):
            aliases[kept[0]] = [n for n in names if n not in held]
    return aliases


def _split_as_planned(
    model: nn.Module | StageGraph,
    config: PipelineConfig,
    num_ranks: int,
    concrete_args: dict[str, Any] | None,
    example_inputs: Any,
    plan: str | os.PathLike[str] | None,
    mesh: PipelineMesh | None = None,
) -> tuple[tuple[str, ...], StageGraph]:
    """``_split``, checked against the number of ranks; when the split comes from a plan file
    (``plan=`` or ``conveyor run --plan``), an error says so: a plan fits the model and the
    ranks it was made for."""
    try:
        split_points, graph = _split(model, config, num_ranks, concrete_args, example_inputs)
        if graph.num_ranks != num_ranks:
            raise ValueError(_ranks_mismatch(graph.num_ranks, num_ranks, mesh))
    except (ValueError, TypeError) as error:
        source = plan
        if source is None:
            raise
        kind = ValueError if isinstance(error, ValueError) else TypeError
        raise kind(
            f"{error} (the split comes from plan file {str(source)!r}, which does not fit "
            "this model on these ranks; make a plan for it with `conveyor plan ... --out "
            "FILE`, or leave the plan out)"
        ) from error
    return split_points, graph


def _split(
    model: nn.Module | StageGraph,
    config: PipelineConfig,
    num_ranks: int,
    concrete_args: dict[str, Any] | None,
    example_inputs: Any,
) -> tuple[tuple[str, ...], StageGraph]:
    """(split points, StageGraph): a prebuilt graph, stage_modules, auto_split, or a chain cut
    before split points (see conveyor.split)."""
    if isinstance(model, StageGraph):
        if any(s.module is None for s in model.stages):
            raise ValueError(
                "the StageGraph has stages without modules (a topology); pass a "
                "graph from conveyor.split, or the model itself"
            )
        return (), model
    traced = {
        "example_inputs": example_inputs,
        "tracer": config.tracer,
        # interleaved 1F1B and ZB-V run chains: a value that skips stages (a skip connection,
        # a transformer's mask and rotary tables) is passed through every stage between
        "relay_skips": spec_of(config.schedule).needs_chain,
    }
    if config.stage_modules is not None:
        graph = split_by_modules(
            model, config.stage_modules, config.placement, concrete_args, **traced
        )
        return (), graph
    if config.auto_split:
        num_stages = len(config.placement) if config.placement is not None else num_ranks
        return (), auto_split(
            model,
            num_stages,
            num_microbatches=config.num_microbatches,
            placement=config.placement,
            concrete_args=concrete_args,
            leaf_modules=config.leaf_modules,
            **traced,
        )
    split_points = _split_points(model, config, num_ranks)
    graph = split_model(model, split_points, config.placement, concrete_args, **traced)
    return split_points, graph


def _ranks_mismatch(needed: int, num_ranks: int, mesh: PipelineMesh | None) -> str:
    """Why a split over ``needed`` ranks does not fit a pipeline of ``num_ranks``, and the
    launch that would fit it (on a mesh, in its dp, pp and tp sizes)."""
    if mesh is None:
        return (
            f"the split places stages on {needed} ranks but the process group has "
            f"{num_ranks}; launch with `conveyor run -n {needed}` or change the split"
        )
    shape = mesh.shape
    world = shape.dp * shape.pp * shape.tp
    fits = shape.dp * needed * shape.tp
    return (
        f"the split places stages on {needed} pipeline ranks but the mesh has pp={shape.pp} "
        f"(dp={shape.dp} x pp={shape.pp} x tp={shape.tp} on a world of {world}); change the "
        f"split to {shape.pp} pipeline ranks, or run pp={needed} on {fits} ranks "
        f"(`conveyor run -n {fits}` with dp={shape.dp}{f', tp={shape.tp}' if shape.tp > 1 else ''})"
    )


def _blame_plan(error: ValueError, plan: str | os.PathLike[str] | None) -> None:
    """Note on a mesh ``error`` the plan file that set the mesh's sizes, if one did."""
    for path in (plan, os.environ.get(PLAN_ENV)):
        if path and {"dp", "tp", "pp"} & set(read_plan(path)):
            error.add_note(
                f"the mesh sizes come from plan file {str(path)!r}, made for another world; "
                "plan again with `conveyor plan --world-size N` for this one"
            )


def _check_targets(targets: Any, size: int | None) -> None:
    """Refuse targets none of whose tensors has the batch's samples: each micro-batch would
    get them whole, and train on the wrong targets without an error."""
    shapes = [tuple(t.shape) for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    batched = [shape for shape in shapes if shape]
    if size is not None and batched and not any(shape[0] == size for shape in batched):
        raise ValueError(
            f"the targets hold no tensor of the batch's {size} samples (shapes {batched}); "
            f"give targets with the batch as their first dimension, {size} like the inputs'"
        )


def _with_layout(config: PipelineConfig, num_ranks: int) -> PipelineConfig:
    """``config`` with the rank of every stage (conveyor.schedule.stage_placement)."""
    placement = stage_placement(
        config.schedule,
        num_ranks,
        num_stages=config.num_stages,
        virtual_stages=config.virtual_stages,
        style=config.placement_style,
    )
    if config.placement is not None or config.auto_split:
        return config
    return config.replace(placement=tuple(placement))


def _split_points(model: nn.Module, config: PipelineConfig, num_ranks: int) -> tuple[str, ...]:
    """Where to cut: the configured split points, or the layers that start each stage of an
    nn.Sequential split by balance (even by default)."""
    split_points = config.split_points
    if split_points is None:
        if isinstance(model, nn.Sequential):
            num_stages = config.num_stages or len(config.placement or range(num_ranks))
            balance = config.balance or even_balance(len(model), num_stages)
            split_points = tuple(balance_to_split_points(model, balance))
        elif config.balance is not None:
            raise TypeError(
                f"balance splits an nn.Sequential, but the model is a "
                f"{type(model).__name__}; pass split_points=[...] (qualified names "
                "of the submodules that start each stage) instead"
            )
        elif num_ranks > 1:
            raise ValueError(
                f"cannot split a {type(model).__name__} over {num_ranks} ranks "
                "without split points; pass split_points=[...] naming the "
                "submodules that start stages 1.., e.g. ['layers.4'], "
                "stage_modules=(...) naming each stage's submodules, or "
                "auto_split=True"
            )
        else:
            split_points = ()
    return tuple(split_points)


def _usable(device: torch.device | str) -> torch.device:
    """``device``, if this torch build and machine have it."""
    found = torch.device(device)
    if found.type != "cpu" and found.type != "meta":
        module = getattr(torch, found.type, None)
        available = getattr(module, "is_available", None)
        if available is not None and not available():
            raise ValueError(
                f"device={str(device)!r}, but this torch ({torch.__version__}) sees no "
                f"{found.type} device here; pass device='cpu' (with the gloo backend) or leave "
                "device out to use this process's accelerator when there is one"
            )
    return found


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    """CPU for gloo; otherwise this process's current accelerator (one GPU per rank)."""
    if dist.get_backend(group) == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def _signature(chunk: dict[str, Any], device: torch.device) -> str:
    """Shapes, dtypes and constants of a micro-batch, and the autocast state (it changes the
    dtypes stages send): the key for exchanged shapes."""
    meta = Meta.of(chunk)
    leaves = [(leaf.shape, leaf.dtype, leaf.constant) for leaf in meta.leaves]
    return repr((meta.spec, leaves, autocast_state(device)))
