"""Activation accounting: the meter's (stage, micro-batch) sets and bytes, and the liveness of
saved tensors, through a plain backward and a split one."""

from __future__ import annotations

import torch
from torch import nn

from conveyor.runtime.backward import backward_input
from conveyor.runtime.memory import ActivationMeter, LiveSavedTensors

ROW = 3 * 8 * 8  # one (3, 8) float64 tensor


def test_saved_tensors_live_until_autograd_releases_them() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    live = LiveSavedTensors(model.parameters())
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with live.watching():
        y = model(x)  # Linear saves x, Tanh its output: two storages
    assert live.bytes == live.peak_bytes == 2 * ROW
    y.sum().backward(retain_graph=True)
    assert live.bytes == 2 * ROW  # retained graph: still saved
    del y
    assert live.bytes == 0 and live.peak_bytes == 2 * ROW
    live.reset()
    assert live.peak_bytes == 0


def test_meter_keeps_a_split_backward_alive_until_w() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    meter = ActivationMeter()
    meter.exclude(model.parameters())
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    with meter.saving((0, 0)):
        y = model(x)
    meter.hold((0, 0), (x, y))
    assert meter.held_bytes == 2 * ROW and meter.held_microbatches == 1
    _, weight = backward_input([y], [torch.ones_like(y)], [x])
    del y
    meter.keep_only((0, 0), weight.tensors())  # + the gradient W starts from
    # the meter counts the set until W; autograd already let Tanh's output go (nothing W
    # needs lies above Linear's node), and keeps x, which Linear's weight gradient needs
    assert meter.held_bytes == 3 * ROW and meter.live.bytes == ROW
    weight.run()
    del weight
    meter.release((0, 0))
    report = meter.report()
    assert (report.peak_bytes, report.peak_microbatches, report.peak_saved_bytes) == (
        3 * ROW,
        1,
        2 * ROW,
    )
    assert meter.held_bytes == 0 and meter.live.bytes == 0


def test_no_grad_forward_holds_nothing() -> None:
    meter = ActivationMeter()
    with torch.no_grad(), meter.saving((0, 0)):
        nn.Linear(8, 8)(torch.randn(3, 8))
    assert meter.held_microbatches == 0 and meter.report().peak_microbatches == 0
