"""`conveyor generate` and `conveyor simulate --decode` (conveyor.cli.generate)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import Pipeline
from conveyor.checkpoint import Checkpointer, CheckpointError
from conveyor.cli import main
from conveyor.cli.generate import GenerateJob, load_model
from conveyor.models import gpt, gpt_loss
from conveyor.pipeline.decode import generate


def test_simulate_draws_a_decode_program(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--decode", "--stages", "2", "--groups", "1", "--actions"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [
        "rank 0 | 0F0  .  0F1  .  0F2  .  0F3  . ",
        "rank 1 |  .  1F0  .  1F1  .  1F2  .  1F3",
    ]
    assert "busy=50.0%" in out[2]  # the naive pipeline: one group, every other slot idle
    assert out[4].startswith("rank 1: 1RF0<0") and "1SF0>0" in out[4]  # the token fed back


def test_generate_help_lists_the_generation_settings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--prefill-chunk" in out and "--num-groups" in out and "--memory-budget" in out


def test_a_model_that_is_no_directory_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", "no/such/dir"])
    assert exit_.value.code == 2
    assert "neither 'gpt' nor a directory" in capsys.readouterr().err


def test_a_saved_hugging_face_model_is_read_from_disk(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    saved = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2)).eval()
    saved.save_pretrained(tmp_path)
    model, tokenizer = load_model(GenerateJob(model=str(tmp_path)))
    assert tokenizer is None  # saved without one: prompts as --prompt-ids
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(
        generate(model, ids, max_new_tokens=4), generate(saved, ids, max_new_tokens=4)
    )


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_generate_runs_the_demo_gpt_on_two_ranks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--prompt", "def ", "x = ", "--max-new-tokens", "5", "--num-layers", "2"]
    assert main([*argv, "--trace", str(tmp_path)]) == 0
    assert (tmp_path / "timeline.png").is_file() and (tmp_path / "trace.json").is_file()
    assert "RuntimeWarning" not in capfd.readouterr().err  # each rank runs its module once


def test_a_checkpoint_is_found_in_its_run_directory_and_a_wrong_size_names_the_flags(
    one_rank: None, tmp_path: Path
) -> None:
    trained = gpt(seq_len=32, dim=16, num_layers=2, num_heads=2)
    pipe = Pipeline(trained, loss_fn=gpt_loss)
    with Checkpointer(pipe, directory=tmp_path / "run") as checkpointer:
        checkpointer.save(3)
    job = GenerateJob(checkpoint=str(tmp_path / "run"), dim=16, num_layers=2, num_heads=2,
                      seq_len=32)  # fmt: skip
    model, _ = load_model(job)  # the run's directory: its newest checkpoint
    for name, value in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    with pytest.raises(CheckpointError, match=r"builds the GPT from --dim 64, --num-layers 2"):
        load_model(GenerateJob(checkpoint=job.checkpoint, num_layers=2, seq_len=32))
    with pytest.raises(CheckpointError, match="is not a checkpoint, and it holds no step-N"):
        load_model(GenerateJob(checkpoint=str(tmp_path)))


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_generate_with_cp_prints_the_pipelines_tokens(capfd: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "def ", "--max-new-tokens", "6", "--num-layers", "2"]
    texts = []
    for extra in ([], ["--cp", "2"]):
        assert main([*argv, *extra]) == 0
        err = capfd.readouterr().err
        texts.append([line.split("] ", 1)[-1] for line in err.splitlines() if "'def ' ->" in line])
    assert texts[0] and texts[0] == texts[1]
    with pytest.raises(SystemExit):
        main([*argv, "--ranks", "3", "--cp", "2"])
    assert "--cp 2 does not divide --ranks 3" in capfd.readouterr().err
