"""Pipelined training computes what plain training computes: loss, every gradient, outputs."""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

import conveyor
from conveyor.models import gpt, gpt_loss, text_batches
from conveyor.runtime.backward import backward_input
from conveyor.runtime.fingerprint import BatchMismatchError
from conveyor.runtime.peers import PeerLostError
from dist import run_ranks

pytestmark = pytest.mark.dist


def tiny(depth: int = 8, width: int = 8, dropout: float = 0.2) -> nn.Sequential:
    """Linear layers with dropout and layer norm, float64."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        layers.append([nn.Dropout(dropout), nn.LayerNorm(width), nn.Tanh()][i % 3])
    return nn.Sequential(*layers).double()


def reference(
    model: nn.Module, x: Any, y: torch.Tensor, num_microbatches: int, loss_fn: Any, step: int = 0
) -> torch.Tensor:
    """Plain training of ``model`` on one process: micro-batch k seeded as conveyor seeds it,
    losses weighted by their share of the batch, gradients accumulated."""
    total = torch.zeros(())
    xs = torch.tensor_split(x, num_microbatches)
    for k, (xk, yk) in enumerate(zip(xs, torch.tensor_split(y, num_microbatches), strict=True)):
        torch.manual_seed(conveyor.microbatch_seed(0, step, k))
        loss = loss_fn(model(xk), yk) * (len(xk) / len(x))
        loss.backward()
        total = total + loss.detach()
    return total


def check_step(
    pipe: conveyor.Pipeline,
    plain: nn.Module,
    x: Any,
    y: torch.Tensor,
    loss_fn: Any,
    atol: float | None,
    step: int = 0,
) -> None:
    expected = reference(plain, x, y, pipe.config.num_microbatches, loss_fn, step)
    loss = pipe.step(x, y)
    tolerance: dict[str, float] = {} if atol is None else {"rtol": 0.0, "atol": atol}
    if pipe.rank == pipe.graph.rank_of(pipe.graph.sink):
        assert loss is not None
        torch.testing.assert_close(loss, expected.to(loss.dtype), **tolerance)
    else:
        assert loss is None
    reference_grads = dict(plain.named_parameters())
    names = [name for name, _ in pipe.named_parameters()]
    assert names, "every rank holds parameters"
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(
            parameter.grad,
            reference_grads[name].grad,
            **tolerance,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def _equivalence(rank: int, world_size: int, depth: int) -> None:
    for dtype, atol in ((torch.float64, 1e-10), (torch.float32, None)):  # None: defaults
        x = torch.randn(10, 8, dtype=dtype)
        y = torch.randn(10, 8, dtype=dtype)
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 3, 8):
                for recompute in ("never", "except_last", "always"):
                    model = tiny(depth).to(dtype)
                    pipe = conveyor.Pipeline(
                        copy.deepcopy(model),
                        num_microbatches=m,
                        schedule=schedule,
                        recompute=recompute,
                        loss_fn=F.mse_loss,
                        timeout_s=15,
                    )
                    check_step(pipe, model, x, y, F.mse_loss, atol=atol)


@pytest.mark.parametrize("world_size", [2, 4])
def test_loss_and_every_gradient_match_plain_training(tmp_path: Path, world_size: int) -> None:
    run_ranks(_equivalence, tmp_path, world_size, timeout_s=150, depth=8)


def _gpt_curve(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = gpt(seq_len=16, dim=32, num_layers=2, dropout=0.1)
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(
        model, num_microbatches=4, schedule="1f1b", loss_fn=gpt_loss, timeout_s=15
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    names = dict(pipe.named_parameters())
    losses, plain_losses = [], []
    for step, (x, y) in enumerate(text_batches(8, 16, 50)):
        loss = pipe.step(x, y)
        plain_losses.append(reference(plain, x, y, 4, gpt_loss, step).item())
        optimizer.step()
        optimizer.zero_grad()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    if losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses))
        assert losses[-1] < losses[0] - 0.5, "the model learns"
    reference_parameters = dict(plain.named_parameters())
    for name, parameter in names.items():
        torch.testing.assert_close(parameter, reference_parameters[name])


def test_fifty_steps_follow_the_plain_loss_curve(tmp_path: Path) -> None:
    run_ranks(_gpt_curve, tmp_path, 2, timeout_s=150)


class Tower(nn.Module):
    """Takes keyword inputs, passes a dict with an integer tensor, a mask and a constant
    between stages, and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.register_buffer("offset", torch.arange(8, dtype=torch.float64))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> Any:
        h = self.embed(ids) + self.offset
        state = {"h": h, "ids": ids, "keep": mask, "count": ids.shape[1]}
        h = self.body(state["h"]) * state["keep"].unsqueeze(-1)
        pooled = h.sum(1) / state["count"] + state["ids"].float().mean(1, keepdim=True)
        return self.head(pooled) * scale, pooled.detach()


def tower_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output[0], target)


def _pytrees(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Tower().double()
    plain = copy.deepcopy(model)
    pipe = conveyor.Pipeline(
        model, split_points=["body"], num_microbatches=3, loss_fn=tower_loss, timeout_s=15
    )
    for step, seq in enumerate((5, 7, 5)):  # variable sequence length, and back
        ids = torch.randint(0, 10, (7, seq))
        mask = torch.rand(7, seq) > 0.3
        y = torch.randint(0, 3, (7,))
        inputs = {"ids": ids, "mask": mask, "scale": 0.5}

        expected = torch.zeros((), dtype=torch.float64)
        for k, (ik, mk, yk) in enumerate(
            zip(
                torch.tensor_split(ids, 3),
                torch.tensor_split(mask, 3),
                torch.tensor_split(y, 3),
                strict=True,
            )
        ):
            torch.manual_seed(conveyor.microbatch_seed(0, step, k))
            loss = tower_loss(plain(ik, mk, 0.5), yk) * (len(ik) / 7)
            loss.backward()
            expected += loss.detach()
        loss = pipe.step(inputs, y)
        if loss is not None:
            torch.testing.assert_close(loss, expected, rtol=0, atol=1e-10)
        grads = dict(plain.named_parameters())
        for name, parameter in pipe.named_parameters():
            torch.testing.assert_close(parameter.grad, grads[name].grad, rtol=0, atol=1e-10)
            parameter.grad = None
        plain.zero_grad()
    pipe.eval()
    plain.eval()
    for samples in (5, 1):  # one sample: one micro-batch through both ranks
        ids = torch.randint(0, 10, (samples, 4))
        mask = torch.ones(samples, 4, dtype=torch.bool)
        output = pipe.forward({"ids": ids, "mask": mask})
        if output is not None:
            for got, want in zip(output, plain(ids, mask), strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_pytrees_keywords_variable_shapes_and_inference(tmp_path: Path) -> None:
    run_ranks(_pytrees, tmp_path, 2, timeout_s=90)


def _meta(rank: int, world_size: int) -> None:
    with torch.device("meta"):
        model = tiny(4)
    pipe = conveyor.Pipeline(model, num_microbatches=2, loss_fn=F.mse_loss, timeout_s=15)
    assert all(not p.is_meta for p in pipe.parameters())
    local = {name for name, _ in pipe.named_parameters()}
    elsewhere = [p for n, p in model.named_parameters() if n not in local]
    assert elsewhere and all(p.is_meta for p in elsewhere), "other stages stay unallocated"
    plain = tiny(4)
    pipe.load_state_dict(plain.state_dict())
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    check_step(pipe, plain, x, y, F.mse_loss, atol=1e-10)


def test_meta_model_materializes_only_local_stages(tmp_path: Path) -> None:
    run_ranks(_meta, tmp_path, 2, timeout_s=60)


class Growing(nn.Module):
    """Returns one more column on every call: shapes that do not follow the input's."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.repeat(1, self.calls)


def _shape_change(rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Growing(), nn.Linear(4, 2)).double()
    pipe = conveyor.Pipeline(model, balance=[2, 1], num_microbatches=2, timeout_s=5)
    x = torch.randn(4, 4, dtype=torch.float64)
    if rank == 0:
        with pytest.raises(RuntimeError, match="changed shape, dtype or gradient requirement"):
            pipe.forward(x)
    else:
        with pytest.raises(PeerLostError, match="lost rank 0"):
            pipe.forward(x)


def test_changed_shape_fails_clearly_and_the_peer_does_not_hang(tmp_path: Path) -> None:
    run_ranks(_shape_change, tmp_path, 2, timeout_s=60)


def _freezing(rank: int, world_size: int) -> None:
    """A stage frozen, then unfrozen, between steps: its activations stop and start carrying
    gradients, which the ranks learn before the step (Note [batch fingerprint])."""
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    for schedule in ("1f1b", "zb-h1"):
        plain = tiny(depth=4)
        pipe = conveyor.Pipeline(
            copy.deepcopy(plain), num_microbatches=2, schedule=schedule, loss_fn=F.mse_loss,
            timeout_s=15,
        )  # fmt: skip
        for step, frozen in enumerate([False, True, True, False]):
            for name, parameter in [*plain.named_parameters(), *pipe.named_parameters()]:
                parameter.grad = None
                if int(name.split(".")[0]) < 4:  # stage 0's layers
                    parameter.requires_grad_(not frozen)
            check_step(pipe, plain, x, y, F.mse_loss, atol=1e-12, step=step)


def test_a_stage_frozen_and_unfrozen_between_steps_trains_as_plain(tmp_path: Path) -> None:
    run_ranks(_freezing, tmp_path, 2, timeout_s=90)


def _autocast(rank: int, world_size: int) -> None:
    model = tiny(4).float()
    pipe = conveyor.Pipeline(copy.deepcopy(model), num_microbatches=2, loss_fn=F.mse_loss)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    for step, autocast in enumerate((False, True, False, True)):  # the dtypes sent change
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            check_step(pipe, model, x, y, F.mse_loss, atol=0.0, step=step)  # bitwise
        for p in (*pipe.parameters(), *model.parameters()):
            p.grad = None


def test_autocast_steps_equal_plain_autocast_between_float32_steps(tmp_path: Path) -> None:
    run_ranks(_autocast, tmp_path, 2, timeout_s=90)


def _compiled(rank: int, world_size: int) -> None:
    model = tiny(4, dropout=0.0)
    pipe = conveyor.Pipeline(
        copy.deepcopy(model),
        schedule="zb-h1",
        num_microbatches=2,
        loss_fn=F.mse_loss,
        timeout_s=2,  # shorter than compiling takes: the first step waits compile_timeout_s
    ).compile(backend="aot_eager")
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    # the plain model's parameter names find every gradient: compiling kept the names
    check_step(pipe, model, x, y, F.mse_loss, atol=1e-10)  # I and W of zb-h1
    if rank == 1:  # the compiled region's backward runs once, whole, at I
        stage = pipe.stages[1]
        h = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
        (out,) = stage(h)
        assert out.grad_fn is not None and out.grad_fn.name() == "CompiledFunctionBackward"
        runs: list[int] = []
        out.grad_fn.register_prehook(lambda grads: runs.append(1))
        stage.zero_grad()
        _, weight = backward_input([out], [torch.ones_like(out)], [h])
        assert weight.is_empty and all(p.grad is not None for p in stage.parameters())
        weight.run()
        assert runs == [1]


def test_compiled_stages_train_exactly_with_split_backward(tmp_path: Path) -> None:
    run_ranks(_compiled, tmp_path, 2, timeout_s=110)


def _lost_peer(rank: int, world_size: int) -> None:
    pipe = conveyor.Pipeline(tiny(4), num_microbatches=2, loss_fn=F.mse_loss, timeout_s=30)
    x = torch.randn(4, 8, dtype=torch.float64)
    pipe.step(x, x)
    if rank == 1:
        os._exit(0)  # vanish between steps, without a clean shutdown
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="lost rank 1"):
        pipe.step(x, x)
    assert time.monotonic() - start < 30, "noticed within the peer timeout"


def test_lost_peer_fails_the_other_rank_naming_it(tmp_path: Path) -> None:
    run_ranks(_lost_peer, tmp_path, 2, timeout_s=90)


def _bad_input(rank: int, world_size: int) -> None:
    model, x = tiny(4), torch.randn(4, 8, dtype=torch.float64)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"balance": (3, 3, 2)}, "places stages on 3 ranks but the process group has 2"),
        ({"balance": (3, 4)}, "sum to 8"),
        ({"split_points": ("9",)}, "split point '9' is not a submodule"),
        ({"schedule": "ifib"}, "unknown schedule 'ifib'"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            conveyor.Pipeline(model, loss_fn=F.mse_loss, **options)
    pipe = conveyor.Pipeline(model, num_microbatches=8, loss_fn=F.mse_loss, timeout_s=10)
    with pytest.raises(ValueError, match="at least 8 samples"):
        pipe.step(x, x)
    with pytest.raises(ValueError, match="loss_fn is set, targets is None"):
        pipe.step(x)
    unlossy = conveyor.Pipeline(model, num_microbatches=2, timeout_s=10)
    with pytest.raises(ValueError, match="needs a loss"):
        unlossy.step(x, x)
    for mine in ({"num_microbatches": 2 + 2 * rank}, {"placement": (rank, 1 - rank)}):
        other = conveyor.Pipeline(model, loss_fn=F.mse_loss, timeout_s=10, **mine)
        with pytest.raises(BatchMismatchError, match=f"rank {1 - rank} runs another pipeline"):
            other.step(x, x)  # ranks constructed differently: told so, before any activation
    pipe = conveyor.Pipeline(model, num_microbatches=2, loss_fn=F.mse_loss, timeout_s=10)
    pipe.step(x, x)  # nothing above left a message in flight


def test_bad_input_fails_before_any_communication(tmp_path: Path) -> None:
    run_ranks(_bad_input, tmp_path, 2, timeout_s=60)


def _hung_peer(rank: int, world_size: int, done: str) -> None:
    pipe = conveyor.Pipeline(tiny(4), num_microbatches=2, loss_fn=F.mse_loss, timeout_s=3)
    x = torch.randn(4, 8, dtype=torch.float64)
    if rank == 1:  # hangs mid-run (say, stuck in a data loader) until rank 0 has failed
        give_up = time.monotonic() + 12
        while not Path(done).exists() and time.monotonic() < give_up:
            time.sleep(0.05)
        return
    start = time.monotonic()
    match = r"lost rank 1 while receiving the batch fingerprint of step 0"  # its first wait
    with pytest.raises(PeerLostError, match=match):
        pipe.step(x, x)
    assert time.monotonic() - start < 10
    Path(done).touch()


def test_hung_peer_fails_the_other_rank_after_the_timeout(tmp_path: Path) -> None:
    run_ranks(_hung_peer, tmp_path, 2, timeout_s=60, done=str(tmp_path / "failed"))


def test_inference_runs_a_batch_smaller_than_the_microbatches(one_rank: None) -> None:
    model = tiny(4)
    pipe = conveyor.Pipeline(copy.deepcopy(model), num_microbatches=4, loss_fn=F.mse_loss).eval()
    model.eval()
    x = torch.randn(3, 8, dtype=torch.float64)
    for batch in (x[:1], x):  # one sample; three, in three micro-batches
        torch.testing.assert_close(pipe(batch), model(batch), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="batch of 3 samples cannot be split into 4"):
        pipe.train().step(x, x)  # a step's micro-batches are its schedule's


def masked_token_loss(logits: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """A token-level mean over the labels not -100, each weighted (targets beside labels)."""
    losses = F.cross_entropy(logits, targets["labels"], reduction="none")
    counted = targets["labels"] != -100
    return (losses * targets["weight"])[counted].sum() / counted.sum()


def test_token_mean_counts_the_labels_of_a_dict_of_targets(one_rank: None) -> None:
    torch.manual_seed(5)
    model = tiny(4, dropout=0.0)  # the whole batch at once is the reference
    x, weight = torch.randn(6, 8, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    labels = torch.tensor([1, -100, -100, -100, 2, 3])  # the micro-batches count 1, 0 and 2
    targets = {"labels": labels, "weight": weight}
    pipe = conveyor.Pipeline(
        copy.deepcopy(model), num_microbatches=3, loss_fn=masked_token_loss,
        loss_reduction="token_mean",
    )  # fmt: skip
    loss = pipe.step(x, targets)
    expected = masked_token_loss(model(x), targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    check_grads_equal(pipe, model)
    with pytest.raises(TypeError, match=r"token_mean.* got tuple\. Pass the labels"):
        pipe.step(x, (labels, weight))


def test_a_loss_fn_error_says_where_and_on_what(one_rank: None) -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    for loss_fn, error, message in [
        (lambda out, y: (out - y) ** 2, TypeError, r"loss_fn returned \(2, 8\) float64 for"),
        (lambda out, y: 1.0, TypeError, "loss_fn returned float for micro-batch 0"),
        (lambda out, y: out @ y, RuntimeError, "cannot be multiplied"),
    ]:
        pipe = conveyor.Pipeline(tiny(4), num_microbatches=2, loss_fn=loss_fn)
        with pytest.raises(error, match=message) as raised:
            pipe.step(x, x)
        if error is RuntimeError:
            assert "loss_fn of micro-batch 0 on the output (2, 8) float64" in str(
                raised.value.__notes__
            )


def check_grads_equal(pipe: conveyor.Pipeline, model: nn.Module) -> None:
    expected = dict(model.named_parameters())
    for name, parameter in pipe.named_parameters():
        torch.testing.assert_close(parameter.grad, expected[name].grad, rtol=0, atol=1e-12)


def test_api_mistakes_say_what_to_write(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny(4)
    pipe = conveyor.Pipeline(model, num_microbatches=2.0, loss_fn=F.mse_loss)
    assert pipe.config.num_microbatches == 2
    x = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"to pass one tuple .* pipe\.forward\(\(\(a, b\),\)\)"):
        pipe.forward((x, x))
    with pytest.raises(
        ValueError, match=r"model inputs\['input'\] of shape \(4, 8\) is on the meta"
    ):
        pipe.step(x.to("meta"), x)
    with pytest.raises(ValueError, match=r"targets of shape \(4, 8\) is on the meta"):
        pipe.step(x, x.to("meta"))
    with pytest.raises(ValueError, match=r"targets hold no tensor of the batch's 4 samples"):
        pipe.step(x, x[:2])  # each micro-batch would get both targets, silently
    with pytest.raises(ValueError, match="no layers to split"):
        conveyor.Pipeline(nn.Sequential(), loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match="schedule must be a name, a schedule file or a function"):
        conveyor.Pipeline(tiny(4), schedule=3, loss_fn=F.mse_loss)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        conveyor.Pipeline(tiny(4), loss_fn=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Pass the uncompiled model and call pipe\.compile\(\)"):
        conveyor.Pipeline(torch.compile(tiny(4)), balance=[2, 2], loss_fn=F.mse_loss)
    if not torch.cuda.is_available():  # a CPU build of torch, or no GPU
        with pytest.raises(ValueError, match="sees no cuda device here; pass device='cpu'"):
            conveyor.Pipeline(tiny(4), device="cuda", loss_fn=F.mse_loss)
    layer = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"same module object at positions \[0, 1\]"):
        conveyor.Pipeline(nn.Sequential(layer, layer), placement=(0, 0))  # no balance given
    with caplog.at_level(logging.WARNING, logger="conveyor.pipeline"):
        conveyor.Pipeline(nn.Sequential(nn.ReLU()))
    assert "rank 0 holds no parameters" in caplog.text
    assert "AdamW(params) if params else None" in caplog.text
    with torch.device("meta"):
        built = tiny(2)
        built[1] = nn.Sequential(nn.Tanh())
        built[1].register_buffer("shift", torch.zeros(8, dtype=torch.float64))
    pipe = conveyor.Pipeline(built, num_microbatches=2, loss_fn=F.mse_loss)
    with pytest.raises(RuntimeError, match=r"rank 0 \(stages \[0\]\): \[1.shift\] were built"):
        pipe.step(x, x)
    pipe.load_state_dict({**tiny(2).state_dict(), "1.shift": torch.zeros(8)}, strict=False)
    assert pipe.step(x, x) is not None  # initialized now: it trains
    with pytest.raises(KeyError, match=r"no stage of the model holds: \['4.bias', '4.weight'\]"):
        pipe.load_state_dict({**pipe.state_dict(), **tiny(3).state_dict()})  # a layer more
    wider = {k: torch.zeros(16, *v.shape[1:]) for k, v in pipe.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"other shapes: 0.weight \(16, 8\) \(the model's: \(8, 8\)\); 0.bias"
    ):
        pipe.load_state_dict(wider)


class Aliased(nn.Module):
    """A module registered under two names, used by both stages."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.middle, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.again = self.shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.again(self.middle(self.shared(x).tanh()).tanh()))


def test_state_dict_keeps_every_name_of_a_module_registered_twice(one_rank: None) -> None:
    model = Aliased()
    pipe = conveyor.Pipeline(model, split_points=["middle"], schedule="gpipe", loss_fn=F.mse_loss)
    state = pipe.state_dict()
    assert sorted(state) == sorted(model.state_dict())
    plain = Aliased()
    plain.load_state_dict(state)  # strict: every name is there
    x = torch.randn(4, 8)
    torch.testing.assert_close(plain(x), model(x))


def test_an_index_error_in_a_stage_names_the_stage_and_the_likely_cause(
    one_rank: None, tmp_path: Path
) -> None:
    model = gpt(vocab_size=16, seq_len=8, dim=8, num_layers=1, num_heads=2)
    pipe = conveyor.Pipeline(model, num_microbatches=2, loss_fn=gpt_loss)
    ids = torch.randint(0, 16, (4, 12))  # longer than the 8 positions the model has
    with pytest.raises(IndexError) as error:
        pipe.step(ids, ids)
    note = "\n".join(error.value.__notes__)
    assert "rank 0 (stage 0), forward of micro-batch 0 on inputs input (2, 12) int64" in note
    assert "longer than the model's position embeddings" in note
    # the abandoned step closed this world's groups; a new world's are new, whatever their names
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'again'}", rank=0, world_size=1
    )
    ids = ids[:, :8]
    assert conveyor.Pipeline(model, num_microbatches=2, loss_fn=gpt_loss).step(ids, ids) is not None
