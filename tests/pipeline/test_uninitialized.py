"""Meta-device materialization (conveyor.pipeline.weights, conveyor.pipeline.uninitialized): torch's
own initializers run, children before parents, and whatever nothing initialized is named until
something does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from conveyor.hf.weights import initializer
from conveyor.pipeline.uninitialized import Unset
from conveyor.pipeline.weights import materialize

CPU = torch.device("cpu")


class Block(nn.Module):
    """Attention (initialized by _reset_parameters), a parameter of its own beside children,
    buffers that no reset_parameters sets."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2)
        self.norm = nn.BatchNorm1d(8)
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("mask", torch.ones(4, dtype=torch.bool), persistent=False)
        self.register_buffer("window", torch.ones(4), persistent=False)


def _built_on_meta() -> tuple[Block, Unset]:
    with torch.device("meta"):
        block = Block()
    unset = Unset()
    materialize(block, CPU, initialize=initializer(block), unset=unset)
    return block, unset


def test_torch_initializers_run_and_the_rest_is_named() -> None:
    block, unset = _built_on_meta()
    # nn.MultiheadAttention's _reset_parameters ran after its out_proj's reset_parameters,
    # as its constructor does: out_proj's bias is zero, its weight is not
    assert all(torch.isfinite(p).all() for p in block.attn.parameters())
    assert block.attn.out_proj.bias.abs().sum() == 0 and block.attn.out_proj.weight.std() > 0
    assert torch.equal(block.norm.running_var, torch.ones(8))
    assert unset.names() == ["scale", "steps", "mask", "window"]  # bool has no sentinel
    problem = unset.problem("rank 0 (stage 0)")
    assert problem.startswith("rank 0 (stage 0): [scale, steps, mask, window] were built on")
    assert "their modules, Block, have no initializer that sets them" in problem
    assert "non-persistent buffers [mask, window] are in no state_dict" in problem


def test_loading_values_in_any_way_counts_as_initializing() -> None:
    block, unset = _built_on_meta()
    plain = Block()
    block.load_state_dict(plain.state_dict())  # scale and steps: copied in place
    assert unset.names() == ["mask", "window"]
    block.window.data.fill_(1.0)  # a write through .data: no version change, no sentinel
    block.mask = torch.ones(4, dtype=torch.bool)  # a new tensor
    assert unset.names() == [] and unset.problem("rank 0") == ""


def test_a_model_on_a_real_device_is_only_moved() -> None:
    block = Block()
    before = copy.deepcopy(block.state_dict())
    unset = Unset()
    assert materialize(block, CPU, initialize=initializer(block), unset=unset) is block
    assert unset.names() == []
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_sentinels_mark_every_numeric_dtype(dtype: torch.dtype) -> None:
    with torch.device("meta"):
        module = nn.Module()
        module.register_buffer("values", torch.zeros(3, dtype=dtype))
    unset = Unset()
    materialize(module, CPU, initialize=initializer(module), unset=unset)
    assert unset.names() == ["values"]
    module.values.data[0] = 1  # written, if only in part
    assert unset.names() == []


def test_without_a_tracker_what_nothing_initialized_is_an_error() -> None:
    with torch.device("meta"):
        block = Block()
    with pytest.raises(ValueError, match=r"\[scale, steps, mask, window\] were built on the meta"):
        materialize(block, CPU, initialize=initializer(block))
