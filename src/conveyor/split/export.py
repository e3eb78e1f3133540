"""Trace a model with torch.export (non-strict) for splitting: what torch.fx cannot trace.

    traced = export_model(model, example_inputs={"input_ids": ids, "labels": labels})
    traced.graph          # ATen operations, each tagged with the module that ran it
    traced.bind(batch)    # a later batch as the graph's inputs, checked against the export

Export runs the model's Python once on the example inputs (masks built from them, ``if``s on
config values, decorators: all fine), with every dimension of every input tensor dynamic
unless the model pins it, so a later step with another batch or sequence length runs the same
graph. Parameters keep their original qualified names and objects. See Note [exported modes];
a model built on the meta device is exported on fake tensors of the device its stages run on
(conveyor.split.fake).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim

from conveyor.split.capture import module_path, where, within
from conveyor.split.fake import export_device, faked, on_device
from conveyor.split.inputs import bind_error
from conveyor.torch_compat import data_dependent_errors, pytree

__all__ = ["HOLDS_FOR", "ExportedInputs", "export_model"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportedInputs:
    """How a batch becomes an exported graph's inputs: by the model's forward parameters."""

    signature: inspect.Signature
    tensors: Mapping[str, torch.Tensor]
    """The example's tensor inputs, by parameter name: the graph's placeholders."""
    constants: Mapping[str, Any]
    """The example's other inputs (flags, sizes): baked into the graph, so a batch must
    repeat them, or leave out those conveyor added (``added``)."""
    added: Mapping[str, Any]
    """Inputs conveyor passed itself (``use_cache=False``), filled in when a batch omits them."""
    sizes: Mapping[str, Mapping[int, SizeRule]]
    """What the export assumed of each input dimension, by input and dimension."""
    model_name: str

    def bind(self, batch: Any) -> dict[str, Any]:
        """``batch`` (a tensor, a tuple of positional inputs or a dict by name) as the graph's
        inputs.

        Raises:
            ValueError: the batch gives other inputs than the example did, or another value
                for an input the export baked in.
        """
        given = {**self.added, **_bind(self.signature, batch)}
        wanted = set(self.tensors) | set(self.constants)
        if set(given) != wanted:
            raise ValueError(
                f"{self.model_name} was split from example inputs {sorted(wanted)}, but this "
                f"batch gives {sorted(given)}; pass the same inputs at every step (split "
                "again with other example_inputs to run other ones)"
            )
        for name, baked in self.constants.items():
            if given[name] != baked:
                raise ValueError(
                    f"{self.model_name} was split with {name}={baked!r}, which the graph "
                    f"keeps; this batch passes {name}={given[name]!r}"
                )
        for name, example in self.tensors.items():
            _check_tensor(name, given[name], example, self.model_name)
        self._check_sizes(given)
        return {name: given[name] for name in self.tensors}

    def _check_sizes(self, given: Mapping[str, Any]) -> None:
        """Refuse sizes the exported graph does not hold for: a size export fixed, a size
        outside the range a branch of the traced code assumed (``if ids.shape[1] > 8``), or
        dimensions export found equal that differ."""
        seen: dict[Any, tuple[int, str]] = {}  # a symbol's size, and where it was read
        batch = {rules[0].size for rules in self.sizes.values() if 0 in rules}
        for name, rules in self.sizes.items():
            shape = tuple(given[name].shape)
            for dim, rule in rules.items():
                actual, here = shape[dim], f"{name!r} dimension {dim}"
                wanted = rule.expected(seen)
                problem = ""
                if wanted is not None and actual != wanted:
                    first = "" if isinstance(rule.size, int) else f" (as {_seen_at(rule, seen)})"
                    problem = f"only runs size {wanted} there{first}"
                elif rule.size not in batch and not rule.holds_for(actual):
                    problem = (
                        f"was traced at the example's size, where the model's code takes a "
                        f"branch that holds for sizes {rule.range()} only; split with "
                        "example_inputs of the sizes you run"
                    )
                if problem:
                    raise ValueError(
                        f"{self.model_name} input {here} has size {actual} (shape {shape}), "
                        f"but the exported model {problem}"
                    )
                if getattr(rule.size, "is_Symbol", False):
                    seen.setdefault(rule.size, (actual, here))


@dataclass(frozen=True)
class SizeRule:
    """What export assumed of one input dimension: a size it fixed (an int), or a symbolic
    size (every dimension export found equal shares the symbol) and the sizes the traced code
    holds for."""

    size: Any
    """An int, or a sympy expression of the inputs' size symbols."""
    low: int = 0
    high: int | None = None

    def expected(self, seen: Mapping[Any, tuple[int, str]]) -> int | None:
        """The size this dimension must have given the sizes already read, if it is known."""
        if isinstance(self.size, int):
            return self.size
        if not set(self.size.free_symbols) <= set(seen):
            return None
        return int(self.size.subs({symbol: seen[symbol][0] for symbol in self.size.free_symbols}))

    def holds_for(self, size: int) -> bool:
        # export assumes dynamic sizes of at least 2 (it specializes 0 and 1) and the graph
        # runs smaller ones: only a higher bound comes from the model's own code
        return (self.low <= 2 or size >= self.low) and (self.high is None or size <= self.high)

    def range(self) -> str:
        return f"{self.low} and up" if self.high is None else f"{self.low} to {self.high}"


def _seen_at(rule: SizeRule, seen: Mapping[Any, tuple[int, str]]) -> str:
    """Where the sizes a symbolic rule depends on were read: "the size of 'ids' dimension 1"."""
    return "the size of " + ", ".join(seen[s][1] for s in sorted(rule.size.free_symbols, key=str))


def export_model(
    model: nn.Module, example_inputs: Any, device: torch.device | str | None = None
) -> tuple[fx.GraphModule, ExportedInputs, pytree.TreeSpec]:
    """``model`` exported (non-strict, dynamic shapes) on ``example_inputs``: the graph module
    whose attributes are the model's own parameters and buffers, its input binding, and the
    structure of its output (the graph returns the output's flattened leaves).

    ``device`` is where the stages will run (default: the example inputs' device); a model
    with tensors on the meta device is traced as if it were there. See Note [meta models on
    fake tensors].

    Raises:
        TypeError: export failed; the message names the operation, the module and the line of
            user code, and what to do.
    """
    _refuse_reentrant_checkpointing(model)
    signature = inspect.signature(model.forward)
    added = _training_inputs(model, signature)
    given = {**added, **_bind(signature, example_inputs)}
    tensors = {k: v for k, v in given.items() if isinstance(v, torch.Tensor)}
    constants = {k: v for k, v in given.items() if not isinstance(v, torch.Tensor)}
    if any(pytree.tree_leaves(v) and not _is_plain(v) for v in constants.values()):
        raise TypeError(
            f"example inputs {sorted(constants)} of {type(model).__name__} hold nested "
            "tensors; pass tensors as top-level inputs (a dict of tensors by parameter name)"
        )
    dynamic: dict[str, Any] = {name: None for name in constants}
    dynamic.update({name: {d: Dim.AUTO for d in range(t.dim())} for name, t in tensors.items()})
    on = export_device(model, tensors, device)
    traced = {k: on_device(t, on) for k, t in tensors.items()}
    with faked(model, on) as twins:
        try:
            exported = torch.export.export(
                model, (), {**traced, **constants}, dynamic_shapes=dynamic, strict=False
            )
        except Exception as error:
            raise TypeError(_export_failure(model, error, on)) from error
    module = exported.module()
    twins.restore(module, model)
    _name_by_user(module, model)
    _drop_guards(module)
    module.meta[HOLDS_FOR] = _bind_training_flags(module, model.training)
    module.recompile()
    inputs = ExportedInputs(
        signature, tensors, constants, added, _size_rules(module, exported), type(model).__name__
    )
    return module, inputs, exported.call_spec.out_spec


# Note [exported modes]:
# Export runs the model in the mode it is in and bakes that mode into the graph: dropout's and
# batch norm's `train` argument is a constant, and so is attention's dropout probability
# (transformers passes `p if self.training else 0.0`). So conveyor wires every such argument to
# the graph module's own `training` attribute (a get_attr node), so that Pipeline.train() and
# .eval() switch the exported stages as they switch any module: dropout on or off, batch norm
# on its running statistics, attention's dropout at 0 in evaluation. Batch norm's count of
# batches tracked, an in-place add outside the op, is guarded the same way. What an export in
# evaluation mode lost cannot be wired back: attention's dropout probability (0.0 there) and
# batch norm's count; such a graph holds for evaluation only (HOLDS_FOR), and a Pipeline
# refuses to train with it, as it refuses when a traced forward reads self.training. Other
# Python-level `if self.training` branches of the model's own code stay as exported.
_MODE_ARGUMENTS: dict[Any, int] = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
}
"""ATen operations whose result depends on the mode, and the index of their mode argument."""
_DROPOUT_P: dict[Any, int] = {torch.ops.aten.scaled_dot_product_attention.default: 4}
"""ATen operations that take a dropout probability the caller zeroes in evaluation, and its
index."""
HOLDS_FOR = "conveyor_holds_for"
"""Key of an exported graph module's ``meta``: the mode its graph holds for (False: evaluation
only), or None for both."""


def _bind_training_flags(module: fx.GraphModule, training: bool) -> bool | None:
    """Wire the mode arguments of ``module``, exported in ``training`` mode or not, to its
    ``training`` attribute; returns the mode the graph then holds for (None: both). See Note
    [exported modes]."""
    graph = module.graph
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first), warnings.catch_warnings():
        # fx warns for attributes that are not parameters, buffers or modules; `training` is
        # the module flag itself, which every GraphModule has
        warnings.simplefilter("ignore", UserWarning)
        flag = graph.get_attr("training")
    lost = False
    for node in list(graph.nodes):
        index = _MODE_ARGUMENTS.get(node.target)
        p = _DROPOUT_P.get(node.target)
        if index is not None and len(node.args) > index and isinstance(node.args[index], bool):
            node.args = (*node.args[:index], flag, *node.args[index + 1 :])
            lost |= not training and node.target is torch.ops.aten.batch_norm.default
        elif p is not None and training and len(node.args) > p and node.args[p]:
            with graph.inserting_before(node):
                zeroed = graph.call_function(_if_training, (flag, node.args[p]))
            node.args = (*node.args[:p], zeroed, *node.args[p + 1 :])
        elif p is not None:
            lost |= not training
        elif _counts_batches(node):
            node.target = _add_if_training
            node.args = (flag, *node.args)
    return False if lost else None


def _counts_batches(node: fx.Node) -> bool:
    """``num_batches_tracked.add_(1)`` of a batch norm, which nn.BatchNorm runs in training
    only."""
    if node.target is not torch.ops.aten.add_.Tensor or not node.args:
        return False
    target = node.args[0]
    return (
        isinstance(target, fx.Node)
        and target.op == "get_attr"
        and str(target.target).endswith("num_batches_tracked")
    )


def _if_training(training: bool, p: float) -> float:
    """A dropout probability in training mode, 0 otherwise."""
    return p if training else 0.0


def _add_if_training(training: bool, tensor: torch.Tensor, other: Any) -> torch.Tensor:
    """``tensor.add_(other)`` in training mode, ``tensor`` untouched otherwise."""
    return tensor.add_(other) if training else tensor


def _size_rules(
    module: fx.GraphModule, exported: torch.export.ExportedProgram
) -> dict[str, dict[int, SizeRule]]:
    """Per placeholder and dimension, what export assumed of its size."""
    rules: dict[str, dict[int, SizeRule]] = {}
    for node in module.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or not isinstance(value, torch.Tensor):
            continue
        rules[str(node.target)] = {}
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt):
                rules[str(node.target)][dim] = SizeRule(int(size))
                continue
            expr = size.node.expr
            bounds = exported.range_constraints.get(expr)
            if bounds is None:
                rules[str(node.target)][dim] = SizeRule(expr)
                continue
            high = None if math.isinf(float(bounds.upper)) else int(bounds.upper)
            rules[str(node.target)][dim] = SizeRule(expr, int(bounds.lower), high)
    return rules


def _name_by_user(module: fx.GraphModule, model: nn.Module) -> None:
    """Give a tensor the model knows by several names (tied weights) the name of the module
    that uses it, at each use: export keeps one name per tensor, so the embedding of a model
    whose output projection is tied to it would otherwise be called ``lm_head.weight`` in the
    first stage. A stage then holds the tensor under the plain model's name for what it runs."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:  # fmt: skip
        names.setdefault(id(tensor), []).append(name)
    graph = module.graph
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        aliases = names.get(id(getattr_path(module, str(node.target))), [])
        if len(aliases) < 2:
            continue
        tensor = getattr_path(module, str(node.target))
        for user in list(node.users):
            name = _alias_for(aliases, module_path(user)) or str(node.target)
            if name == node.target:
                continue
            if not _has_attr(module, name):
                owner, _, leaf = name.rpartition(".")
                holder = _ensure_module(module, owner)
                if isinstance(tensor, nn.Parameter):
                    holder.register_parameter(leaf, tensor)
                else:
                    holder.register_buffer(leaf, tensor)
            with graph.inserting_before(node):
                renamed = graph.get_attr(name)
            user.replace_input_with(node, renamed)
        if not node.users:
            graph.erase_node(node)


def _alias_for(aliases: list[str], path: str) -> str | None:
    """The alias owned by the innermost module around ``path``."""
    owned = [a for a in aliases if within(path, a.rpartition(".")[0]) or not a.count(".")]
    return max(owned, key=lambda a: a.count("."), default=None)


def getattr_path(module: nn.Module, path: str) -> Any:
    value: Any = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _has_attr(module: nn.Module, path: str) -> bool:
    try:
        getattr_path(module, path)
    except AttributeError:
        return False
    return True


def _ensure_module(module: nn.Module, path: str) -> nn.Module:
    """The submodule at ``path``, made (as an empty container) where missing."""
    for part in [p for p in path.split(".") if p]:
        if part not in dict(module.named_children()):
            module.add_module(part, nn.Module())
        module = module.get_submodule(part)
    return module


def place_on(module: fx.GraphModule, device: torch.device) -> None:
    """Make an exported stage run on ``device``: export records the device the model was on
    (the meta device, or a CPU) wherever the model's code names one (``arange(device=...)``,
    ``.to(x.device)``); every such constant becomes ``device``."""

    def on(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    for graph_module in module.modules():  # nested graphs too (autocast and no_grad blocks)
        if isinstance(graph_module, fx.GraphModule):
            for node in graph_module.graph.nodes:
                node.args = fx.node.map_aggregate(node.args, on)
                node.kwargs = fx.node.map_aggregate(node.kwargs, on)
            graph_module.recompile()


def _drop_guards(module: fx.GraphModule) -> None:
    """Remove the input guard call export adds; ``ExportedInputs.bind`` checks inputs on every
    rank before any stage runs, which a guard inside one stage could not."""
    for node in list(module.graph.nodes):
        if node.op == "call_module" and not node.users and "guard" in str(node.target):
            module.graph.erase_node(node)
    module.graph.eliminate_dead_code()


def _refuse_reentrant_checkpointing(model: nn.Module) -> None:
    """Refuse Hugging Face's reentrant gradient checkpointing: export traces the checkpointed
    layers as code without gradients (reentrant checkpointing runs its forward under
    no_grad), so the split model would not train."""
    for name, module in model.named_modules():
        function = getattr(module, "_gradient_checkpointing_func", None)
        if (
            getattr(module, "gradient_checkpointing", False)
            and isinstance(function, functools.partial)
            and function.keywords.get("use_reentrant", False)
        ):
            raise ValueError(
                f"{type(model).__name__}{f' module {name!r}' if name else ''} has gradient "
                "checkpointing with use_reentrant=True, which torch.export traces as layers "
                "without gradients; enable it with {'use_reentrant': False} (transformers 5's "
                "default), or turn it off and pass recompute='always' to the Pipeline"
            )


def _training_inputs(model: nn.Module, signature: inspect.Signature) -> dict[str, Any]:
    """``use_cache=False`` for a model whose forward takes it: a key/value cache serves
    generation, and a forward that returned one would ship it through the pipeline."""
    if "use_cache" not in signature.parameters:
        return {}
    logger.info(
        "splitting %s with use_cache=False (no key/value cache in training)", type(model).__name__
    )
    return {"use_cache": False}


def _bind(signature: inspect.Signature, batch: Any) -> dict[str, Any]:
    """The inputs a batch gives, by forward parameter name (no defaults filled in)."""
    try:
        if isinstance(batch, Mapping):
            bound = signature.bind(**batch)
        elif isinstance(batch, tuple | list):
            bound = signature.bind(*batch)
        else:
            bound = signature.bind(batch)
    except TypeError as error:
        raise ValueError(bind_error("forward", signature, batch, error)) from error
    return {name: value for name, value in bound.arguments.items() if value is not None}


def _is_plain(value: Any) -> bool:
    return isinstance(value, bool | int | float | str)


def _check_tensor(name: str, value: Any, example: torch.Tensor, model_name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{model_name} input {name!r} was a tensor when it was split; got "
            f"{type(value).__name__}"
        )
    if value.dim() != example.dim() or value.dtype != example.dtype:
        raise ValueError(
            f"{model_name} input {name!r} was split with {example.dim()} dimensions of "
            f"{example.dtype}; got {tuple(value.shape)} of {value.dtype}; pass inputs of the "
            "example's rank and dtype (sizes may change)"
        )


def _export_failure(model: nn.Module, error: BaseException, fake: torch.device | None) -> str:
    """What stopped the export of ``model`` (traced on fake tensors of ``fake`` when it is
    built on the meta device), where, and the advice that fits the cause."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    inside = _failing_module(model, error)
    name = f" in module {inside!r} ({type(model.get_submodule(inside)).__name__})" if inside else ""
    around = repr(inside) if inside else "that code"
    fx_instead = (
        f"if torch.fx can trace the model around {around}, split with tracer='fx' and split "
        "points or stage_modules that keep it whole (torch.fx never traces inside a module "
        "without a cut)"
    )
    cause = f"{where(error)}: {type(error).__name__}: {first[:300]}"
    if _is_data_dependent(error):
        return (
            f"cannot split {type(model).__name__}: torch.export could not trace it{name}"
            f"{cause}. torch.export needs the whole forward traceable: rewrite that code "
            "without Python branches on tensor values (if x.sum() > 0, .item(), .tolist()); "
            f"or, {fx_instead}"
        )
    if fake is not None:
        return (
            f"cannot split {type(model).__name__}: torch.export could not run it on fake "
            f"tensors of device {str(fake)!r} (the model is built on the meta device){name}"
            f"{cause}; build the model on {str(fake)!r} instead (every rank then holds it "
            f"whole until the split), or, {fx_instead}"
        )
    return (
        f"cannot split {type(model).__name__}: torch.export could not trace it{name}{cause}; "
        f"{fx_instead}"
    )


def _is_data_dependent(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is export's refusal to branch on, or size by, a
    tensor's values."""
    kinds = data_dependent_errors()
    seen: BaseException | None = error
    for _ in range(16):  # a chain of causes, never a cycle
        if seen is None:
            return False
        if isinstance(seen, kinds):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _failing_module(model: nn.Module, error: BaseException) -> str:
    """Qualified name of the innermost submodule of ``model`` whose forward was running."""
    names = {id(m): name for name, m in model.named_modules()}
    found = ""
    frame = error.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if id(owner) in names and names[id(owner)]:
            found = names[id(owner)]
        frame = frame.tb_next
    return found
