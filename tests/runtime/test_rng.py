"""Micro-batch random streams (conveyor.runtime.rng): seeded by (seed, step, micro-batch) alone,
carried between stages, and never disturbing the caller's generator."""

from __future__ import annotations

import torch

from conveyor.runtime.rng import RngState, microbatch_seed, rng_stream

CPU = torch.device("cpu")


def test_seeds_depend_on_seed_step_and_microbatch_only() -> None:
    seeds = {microbatch_seed(s, t, k) for s in range(3) for t in range(3) for k in range(3)}
    assert len(seeds) == 27
    assert microbatch_seed(1, 2, 3) == microbatch_seed(1, 2, 3)
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_a_stream_continues_across_stages_as_one_stream() -> None:
    seed = microbatch_seed(0, 5, 1)
    torch.manual_seed(seed)
    whole = torch.rand(6)  # plain training: one stream, layer after layer
    first_end: list[RngState] = []
    with rng_stream(seed, CPU, first_end):
        first = torch.rand(4)  # stage 0
    second_end: list[RngState] = []
    with rng_stream(first_end[0], CPU, second_end):  # stage 1 picks up where 0 stopped
        second = torch.rand(2)
    torch.testing.assert_close(torch.cat([first, second]), whole)
    replay: list[RngState] = []
    with rng_stream(first_end[0], CPU, replay):  # recomputation redraws the same values
        torch.testing.assert_close(torch.rand(2), second)


def test_the_callers_generator_is_left_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with rng_stream(7, CPU, []):
        torch.rand(10)
    torch.testing.assert_close(torch.rand(3), expected)


def test_a_state_received_inside_a_larger_buffer_restores() -> None:
    """A state that arrives packed with activations is a view at an offset (See Note [one
    message]); restoring it must give the same stream as the state itself."""
    torch.manual_seed(3)
    state = RngState.capture(torch.device("cpu"))
    expected = torch.rand(4)
    packed = torch.zeros(64 + state.cpu.numel(), dtype=torch.uint8)
    packed[64:].copy_(state.cpu)
    RngState(packed[64:]).restore(torch.device("cpu"))
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)
