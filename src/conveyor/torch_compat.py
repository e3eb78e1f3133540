"""Every private PyTorch API conveyor uses, in one place: why, and what would replace it.

Internal. A torch upgrade that moves one of these breaks this module alone; each use falls
back to a public API where one exists.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# Pytrees (flatten a nested batch or message to tensors and back). torch's own pytree is what
# torch.export, DTensor and torch.distributed.pipelining use and what knows torch's containers
# (and transformers' ModelOutput, which registers itself), so a third-party pytree (optree)
# would disagree with it. Replace with ``torch.utils.pytree`` once torch makes it public.
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# What torch.fx calls on an input that ``concrete_args`` specialized to None: the node that
# marks such an input in a traced graph. No public name; compare ``node.target`` to it.
from torch.fx._symbolic_trace import _assert_is_none as assert_is_none

__all__ = [
    "GradBucket",
    "assert_is_none",
    "attention_with_lse",
    "backend_options",
    "close_gloo_group",
    "data_dependent_errors",
    "default_store",
    "export_fake_mode",
    "flatten_state_dict",
    "fsdp_reduce_gradients",
    "grad_unchecked",
    "is_fake",
    "pytree",
    "replicate",
    "tensor_tables",
    "tensor_version",
    "tracing_in",
]
"""Internal to conveyor: listed so that its modules may import them."""


# What DDP's communication hooks receive: public as ``torch.distributed.GradBucket``, but
# torch's type stubs declare it only in its C extension's. Import it from there once the
# stubs export it.
if TYPE_CHECKING:
    from torch._C._distributed_c10d import GradBucket
else:
    GradBucket = dist.GradBucket

_CLOSING_TAG = 0x0C0FFEE
"""A point-to-point tag conveyor never sends on (it sends on tag 0)."""


def close_gloo_group(group: dist.ProcessGroup) -> None:
    """Close this rank's connections in the gloo ``group``, so that every peer blocked on one
    of them fails at once ("Connection closed by peer"), as if this process had died.

    gloo has no call for it: ``ProcessGroup.abort()``, ``shutdown()`` and
    ``destroy_process_group`` leave the connections open (measured on torch 2.13: a peer's
    pending receive still waits its whole timeout). A wait that times out does close them:
    gloo then signals the timeout to every connection of the group's context
    (gloo/transport/tcp/unbound_buffer.cc, ``Context::signalException``). So this posts a
    receive on a tag no one sends to and lets its wait time out after 1 ms, from each peer in
    turn, as the receive from a peer already gone fails at once, without the timeout that
    closes the others. Replace it with
    ``ProcessGroup.abort()`` once gloo implements it. The group is unusable afterwards.
    """
    rank = dist.get_rank(group)
    for peer in range(dist.get_world_size(group)):  # a closed connection fails at once: next
        if peer == rank:
            continue
        try:
            work = dist.irecv(torch.empty(1), group=group, group_src=peer, tag=_CLOSING_TAG)
            assert work is not None
            work.wait(timedelta(milliseconds=1))
        except RuntimeError:  # the timeout, which closed the connections, or a closed one
            continue


def default_store() -> torch._C._distributed_c10d.Store | None:
    """The store the default process group rendezvoused through (outlives every rank), or
    None. No public API returns it; ``torch.distributed.distributed_c10d._get_default_store``
    is what torch's own elastic and checkpoint code use."""
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        return None
    try:
        store: torch._C._distributed_c10d.Store = get()
    except (RuntimeError, ValueError):  # no default group (anymore)
        return None
    return store


def flatten_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    """A nested state dict flattened to the keys torch.distributed.checkpoint stores
    (``model.layer.weight``, ``optim.state.0.exp_avg``); to match a checkpoint's metadata
    before loading it. DCP has no public flattening helper; this is its own
    (``torch.distributed.checkpoint._nested_dict.flatten_state_dict``)."""
    from torch.distributed.checkpoint._nested_dict import (
        flatten_state_dict as flatten,  # private: see above
    )

    flat, _ = flatten(state)
    return dict(flat)


def grad_unchecked(
    outputs: Sequence[torch.autograd.graph.GradientEdge],
    inputs: Sequence[torch.autograd.graph.GradientEdge],
    grads: Sequence[torch.Tensor],
    keep_graph: bool,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph=keep_graph,
    allow_unused=True)`` without its Python shape checks, when torch has its engine entry.

    Those checks rebuild a node's input metadata for every GradientEdge (about 0.1 ms a call,
    where the engine itself takes 0.02); the split backward's W makes one call per weight
    group with gradients autograd itself produced, so the checks cannot fail. The public
    ``torch.autograd.grad`` (used when the entry is missing) computes the same.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        return torch.autograd.grad(
            outputs, inputs, grads, retain_graph=keep_graph, allow_unused=True
        )
    found: tuple[torch.Tensor | None, ...] = run(
        tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate_grad=False
    )
    return found


def is_compiled(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (an OptimizedModule, which
    torch exports under ``torch._dynamo`` only). Asked without importing dynamo, which loads
    DTensor and FSDP too: nothing was compiled before it was imported."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # private: see above
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place writes ``tensor`` has seen (autograd's version counter, which it uses
    to catch saved tensors modified in place). No public API exposes it; conveyor uses it to
    tell whether anything has written a tensor since it was allocated."""
    version: int = tensor._version
    return version


def replicate(module: nn.Module, mesh: DeviceMesh, ignored_params: set[nn.Parameter]) -> None:
    """Data parallelism without sharding on FSDP2's machinery: parameters stay whole on every
    replica (DTensors placed ``Replicate()``), gradients are all-reduced. It is the DDP that
    composes with ``fully_shard``, tensor parallelism and split backward (DDP itself reduces
    from autograd hooks that a deferred weight gradient never fires), and what
    ``torch.distributed.pipelining`` and torchtitan use; torch has it only under
    ``torch.distributed._composable.replicate_with_fsdp`` so far. Replace with its public
    name once it has one."""
    from torch.distributed._composable.replicate_with_fsdp import (
        replicate as replicate_with_fsdp,  # private: see above
    )

    replicate_with_fsdp(module, mesh=mesh, ignored_params=ignored_params)


def fsdp_reduce_gradients(module: nn.Module) -> None:
    """Reduce now the gradients an FSDP2 module (``fully_shard`` or ``replicate``) accumulated
    with gradient sync off, and reshard its parameters: its post-backward, run by hand.

    FSDP2 reduces from autograd hooks on a module's inputs, which run with the input gradient;
    a pipeline's split backward computes the weight gradients later (W), outside any hook, so
    the reduction must be started once the stage's last W has run. torch has no public call
    for it; this is what ``torch.distributed.pipelining``'s stage does
    (``_PipelineStageBase.perform_reduce_grad``). Replace with a public FSDPModule method
    once one exists.
    """
    from torch.distributed._composable import replicate_with_fsdp  # private: see above
    from torch.distributed.fsdp import FSDPModule, fully_shard

    assert isinstance(module, FSDPModule), "only FSDP2 modules reduce gradients"
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    is_replicated = isinstance(module, replicate_with_fsdp.ReplicateModule)
    owner = replicate_with_fsdp.replicate if is_replicated else fully_shard
    state = owner.state(module)  # type: ignore[union-attr]  # set by torch's @contract
    for each in state._state_ctx.all_states:
        for param_group in each._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()


def backend_options(backend: str, timeout: timedelta) -> Any:
    """Options for the groups ``init_device_mesh`` creates (its ``backend_override``) that
    make their collectives give up after ``timeout``, so a rank whose replica died fails in
    bounded time instead of the default 30 minutes. The timeout is the options' ``_timeout``
    (``init_device_mesh`` reads it there itself); gloo's options class is ``_Options``.
    Replace once ``init_device_mesh`` takes a timeout."""
    group_class: Any = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    options = getattr(group_class, "_Options", None) or group_class.Options
    made = options()
    made._timeout = timeout
    return made


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + bias) v and the log-sum-exp of the biased scores per query
    (``causal``: query i sees keys 0..i), which context parallelism needs to merge attention
    over shards of the keys.

    On CPU, aten's flash-attention kernel returns both in one pass and never holds the whole
    score matrix (no public API returns the log-sum-exp); elsewhere the same result is
    computed from the scores. Same values either way, to rounding.
    """
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=bias, scale=scale
        )
        return out, lse
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(
            torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores.float(), dim=-1)
    weights = torch.exp(scores.float() - lse[..., None]).to(q.dtype)
    return weights @ v, lse


# Fake tensors for torch.export of a model built on the meta device (conveyor.split.fake):
# export makes a fake mode of its own unless a TracingContext holds one (as when dynamo
# exports); no public API takes a fake mode or fake parameters, so conveyor hands it one in a
# TracingContext, with export's own settings.
def export_fake_mode() -> Any:
    """A fake tensor mode as torch.export makes one (dynamic shapes, non-fake inputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shapes = ShapeEnv(tracked_fakes=[], trace_asserts=True)
    return FakeTensorMode(shape_env=shapes, allow_non_fake_inputs=True, export=True)


def tracing_in(mode: Any) -> AbstractContextManager[Any]:
    """A TracingContext holding ``mode``: a torch.export inside traces in it."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(mode))


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (shape and dtype, no memory)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def data_dependent_errors() -> tuple[type[BaseException], ...]:
    """What torch.export raises when the code branches on, or sizes by, a tensor's values."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)


def tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """A module's own parameter and buffer tables, to swap entries in place without the
    checks ``register_parameter`` makes (fake tensors are no Parameters)."""
    return module._parameters, module._buffers
