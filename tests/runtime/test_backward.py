"""Split backward: I then W give exactly backward's gradients, and W does none of I's work."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conveyor.models import Block
from conveyor.runtime.backward import backward_input


class Probe(torch.autograd.Function):
    """Identity whose backward counts its calls: a marker on the input-gradient path."""

    calls = 0

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        Probe.calls += 1
        return grad


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Probe.apply(torch.tanh(self.a(self.norm(x)))))


class SameWeightTwice(nn.Module):
    """One Linear applied twice: a weight used twice on the input path (tied in one stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(Probe.apply(torch.tanh(self.a(x))))


class WeightAlone(nn.Module):
    """A weight used with the input, alone (w * w) and row by row."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + (self.w * self.w).sum() + x * self.w[0]


class TwoInTwoOut(nn.Module):
    """Several inputs and outputs; one output ignores the inputs, one returns an input."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.c = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.a(x) * y, self.c.expand(3, 4) * 2, x


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block(4, 2, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x.view(3, 1, 4)).view(3, 4)


MODELS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "mlp": (Mlp, 1),
    "same weight twice": (SameWeightTwice, 1),
    "weight alone": (WeightAlone, 1),
    "two in, two out": (TwoInTwoOut, 2),
    "attention": (Attention, 1),
}


def run(model: nn.Module, inputs: list[torch.Tensor], recompute: bool) -> list[torch.Tensor]:
    leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
    out = checkpoint(model, *leaves, use_reentrant=False) if recompute else model(*leaves)
    inputs[:] = leaves
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("inputs_need_grad", [True, False])
def test_input_then_weight_equals_backward(
    name: str, recompute: bool, inputs_need_grad: bool
) -> None:
    make, num_inputs = MODELS[name]
    model = make().double()
    inputs = [
        torch.randn(3, 4, dtype=torch.float64, requires_grad=inputs_need_grad)
        for _ in range(num_inputs)
    ]
    outputs = run(model, inputs, recompute)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(
        [o for o in outputs if o.requires_grad],
        [g for o, g in zip(outputs, grads, strict=True) if o.requires_grad],
    )
    expected_inputs = [x.grad for x in inputs]
    expected = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    outputs = run(model, inputs, recompute)
    Probe.calls = 0
    found, weight = backward_input(outputs, grads, inputs)
    assert all(p.grad is None for p in model.parameters()), "I must not touch .grad"
    del outputs
    on_input_path = Probe.calls
    weight.run()
    if not inputs_need_grad:  # a first stage: nothing to do in I, W is the whole backward
        assert on_input_path == 0
    elif name == "same weight twice":  # the walk between the two uses of one weight is
        # the documented exception (Note [split backward]); pinning keeps it exact
        assert Probe.calls == on_input_path + 1
    else:
        assert Probe.calls == on_input_path, "W walked the input-gradient path again"
    for got, want in zip(found, expected_inputs, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-12, msg=n)


def test_weight_gradients_accumulate_and_never_alias() -> None:
    model = nn.Linear(4, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 4, dtype=torch.float64)
    for _ in range(2):
        _, weight = backward_input([model(x)], [grad], [x])
        weight.run()
    torch.testing.assert_close(model.bias.grad, 2 * grad.sum(0))
    before = grad.clone()
    model.bias.grad.add_(1.0)  # the optimizer side may change .grad in place
    assert torch.equal(grad, before), "a .grad must not alias the gradient W started from"


def test_weight_keeps_only_what_it_needs() -> None:
    """W keeps the gradients at its frontier nodes, not the stage's outputs."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    out = model(x)
    _, weight = backward_input([out], [torch.randn_like(out)], [x])
    kept = weight.tensors()
    assert len(kept) == 2 and all(t.shape == (3, 4) for t in kept)  # one per Linear
    assert not weight.is_empty
    weight.run()
    assert weight.is_empty


def test_loss_root_and_no_roots() -> None:
    model = nn.Linear(4, 1).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    loss = model(x).pow(2).mean()
    found, weight = backward_input([loss], [None], [x])
    weight.run()
    expected = torch.autograd.grad(model(x).pow(2).mean(), [x, model.weight])
    torch.testing.assert_close(found[0], expected[0])
    torch.testing.assert_close(model.weight.grad, expected[1])
    found, weight = backward_input([], [], [x])
    assert found == [None] and weight.is_empty
