"""Export a model built on the meta device as if it were on the device its stages run on.

    device = export_device(model, example_tensors, None)   # None: export the model as it is
    with faked(model, device) as twins:       # meta parameters and buffers: fake, on device
        exported = torch.export.export(model, ...)
    twins.restore(exported.module(), model)   # the model's own meta tensors back

Internal to conveyor.split (its export). See Note [meta models on fake tensors].
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from conveyor.text import listed
from conveyor.torch_compat import export_fake_mode, is_fake, tensor_tables, tracing_in

__all__ = ["Twins", "export_device", "faked", "on_device"]

# Note [meta models on fake tensors]:
# A model built under torch.device("meta") holds no memory. torch.export can trace it there,
# but the graph is then the meta device's: the model's meta tensors meet the inputs' real ones
# (BERT's loss of CPU labels, ViT's CLS token concatenated to CPU patches, batch norm), code
# that branches on the device takes the branch for neither CPU nor GPU (transformers' experts
# count tokens with `histc` of floats on CPU, of ints elsewhere, so a Mixtral exported on meta
# fails on CPU), and the tensors the forward makes (Falcon's `x[..., [-2]]` index) are lifted
# as constants on the meta device, their values lost. So conveyor exports such a model on fake
# tensors of the device its stages run on: for the export, each meta parameter and buffer is
# swapped for a fake tensor of that device (which allocates nothing) of the fake mode export
# traces in (passed as its TracingContext), and the example inputs are moved there (a batch,
# not the model). The graph then holds that device's branches and device arguments, lifted
# constants are real tensors of that device (fx copies one into each stage that reads it), and
# the graph module gets the model's own meta tensors back, to be materialized stage by stage
# (conveyor.pipeline.weights). An operation without a fake kernel stops such an export; the
# error says so, and building the model on the device (and splitting it there) is the way around it.


def export_device(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], device: torch.device | str | None
) -> torch.device | None:
    """The device to export ``model`` on as fake tensors: ``device``, else the example input
    ``tensors``' device; None to export the model as it is, when it holds no meta tensors or
    nothing says where it will run. See Note [meta models on fake tensors]."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    if device is not None:
        return torch.device(device)
    given = [t.device for t in tensors.values() if not t.is_meta]
    if given:
        return given[0]
    default = torch.get_default_device()  # a batch of no tensors: where tensors are made
    return None if default.type == "meta" else default


def on_device(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """An example input as the export should see it: on ``device`` when the model is exported
    on fake tensors there (a meta tensor as a new one: export reads shapes, not values)."""
    if device is None:
        return tensor
    return torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.to(device)


@contextmanager
def faked(model: nn.Module, device: torch.device | None) -> Iterator[Twins]:
    """While inside, ``model``'s meta parameters and buffers are fake tensors on ``device`` of
    one fake mode, which a torch.export inside traces in (nothing changes for ``device``
    None). See Note [meta models on fake tensors]."""
    twins = Twins()
    if device is None:
        yield twins
        return
    mode = export_fake_mode()
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        for table in tensor_tables(module):
            for name, tensor in list(table.items()):
                if tensor is not None and tensor.is_meta:
                    swapped.append((table, name, tensor))
                    table[name] = twins.fake(mode, tensor, device)
    try:
        with tracing_in(mode):
            yield twins
    finally:
        for held, name, tensor in swapped:
            held[name] = tensor


class Twins:
    """The fake tensors that stand in for a model's meta tensors during an export."""

    def __init__(self) -> None:
        self.fakes: dict[int, torch.Tensor] = {}
        """A fake tensor by the id of the meta tensor it stands for."""
        self.originals: dict[int, torch.Tensor] = {}
        """The meta tensor by the id of its fake (which ``fakes`` keeps alive)."""

    def fake(self, mode: Any, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The fake twin of ``tensor`` on ``device``: one per tensor, so ties stay ties."""
        if id(tensor) not in self.fakes:
            with mode:
                fake = torch.empty_strided(
                    tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device
                )
            if isinstance(tensor, nn.Parameter):
                fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
            self.fakes[id(tensor)] = fake
            self.originals[id(fake)] = tensor
        return self.fakes[id(tensor)]

    def restore(self, module: fx.GraphModule, model: nn.Module) -> None:
        """Give the exported ``module`` the model's own tensors where it holds their twins.

        Raises:
            TypeError: the export made a tensor from the meta device (or left a fake one): a
                constant whose values no weights file or initializer can give back.
        """
        own = {id(t) for t in (*model.parameters(), *model.buffers())}
        lost = []
        for owner_name, owner in module.named_modules():
            parameters, buffers = tensor_tables(owner)
            held: dict[str, torch.Tensor | None] = {**parameters, **buffers}
            held.update((k, v) for k, v in vars(owner).items() if isinstance(v, torch.Tensor))
            for name, tensor in held.items():
                if tensor is None:
                    continue
                original = self.originals.get(id(tensor))
                if original is not None:
                    _replace(owner, name, original)
                elif id(tensor) not in own and (tensor.is_meta or is_fake(tensor)):
                    lost.append(f"{owner_name}.{name}" if owner_name else name)
        if lost:
            raise TypeError(
                f"cannot split {type(model).__name__}: torch.export made {listed(lost)} from "
                "tensors of the meta device, so their values are lost; pass example_inputs on "
                "the device the stages run on, or build the model on that device"
            )


def _replace(owner: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` where ``owner`` holds ``name`` (a parameter, a buffer or a constant)."""
    parameters, buffers = tensor_tables(owner)
    if name in parameters:
        parameters[name] = tensor  # the model's Parameter
    elif name in buffers:
        buffers[name] = tensor
    else:
        setattr(owner, name, tensor)
