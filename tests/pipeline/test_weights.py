"""Weights in files (conveyor.pipeline.weights): a trained pipeline saves what ``from_pretrained``
reads, and a meta-device model loads per stage from a sharded checkpoint without any rank holding it
whole."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_huggingface import VOCAB, gpt2, text_batch

import conveyor
from dist import run_ranks

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]


def _round_trip(rank: int, world_size: int, directory: str) -> None:
    torch.manual_seed(0)
    model = gpt2()
    batch = text_batch()
    pipe = conveyor.Pipeline(model, split_points=["transformer.h.2"], example_inputs=batch)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(batch)
    optimizer.step()
    pipe.save_pretrained(directory)
    held: list[dict[str, torch.Tensor]] = [{}] * world_size
    torch.distributed.all_gather_object(held, pipe.state_dict())
    if rank == 0:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(directory)
        state = loaded.state_dict()
        trained = {name: t for part in held for name, t in part.items()}
        assert set(trained) <= set(state)
        for name, tensor in trained.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
        # the tied output projection is the trained embedding, as in the pipeline
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
        # and a plain load_state_dict of the shards' union gives the same model
        plain = gpt2()
        shards = sorted(Path(directory).glob("*.safetensors"))
        assert len(shards) == world_size, shards
        read = {k: v for shard in shards for k, v in safetensors_torch.load_file(shard).items()}
        missing, unexpected = plain.load_state_dict(read, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        for name, tensor in plain.state_dict().items():
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)


def test_a_trained_pipeline_saves_what_from_pretrained_reads(tmp_path: Path) -> None:
    run_ranks(_round_trip, tmp_path, 2, timeout_s=400, directory=str(tmp_path / "saved"))


def llama_config(width: int = 32) -> object:
    return transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=width, intermediate_size=4 * width,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
        max_position_embeddings=64,
    )  # fmt: skip


def _peak_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _resident_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _per_stage_load(rank: int, world_size: int, directory: str) -> None:
    config = llama_config(width=512)
    if rank == 0:  # transformers writes the checkpoint, in shards, with its own code
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="20MB")
    torch.distributed.barrier()
    files = conveyor.pipeline.weights.WeightFiles(directory)
    assert len(set(files.weight_map.values())) > 2, "the checkpoint is sharded"
    model_bytes = sum(files.get(name).nbytes for name in files.weight_map)  # type: ignore[union-attr]
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    # the first export loads torch.export's own code (tens of MB, once per process): load it
    # before measuring what splitting and loading this model cost
    torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
    before = _resident_bytes()
    pipe = conveyor.Pipeline(
        model, split_points=["model.layers.2"], example_inputs=batch, weights=directory
    )
    grown = _peak_bytes() - before
    held = sum(t.nbytes for t in pipe.state_dict().values())
    print(f"rank {rank}: model {model_bytes / 2**20:.1f} MiB, stage {held / 2**20:.1f} MiB, "
          f"peak growth while splitting and loading {grown / 2**20:.1f} MiB")  # fmt: skip
    assert grown < 0.75 * model_bytes, (grown, model_bytes)
    for name, tensor in pipe.state_dict().items():
        expected = files.get(name)
        if expected is None:  # the rotary table: not saved, made by the model's own init
            reference = transformers.LlamaForCausalLM(config)
            expected = dict(reference.named_buffers())[name]
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
    plain = transformers.LlamaForCausalLM.from_pretrained(directory)
    loss = pipe.step(batch)
    if loss is not None:
        torch.testing.assert_close(loss, plain(**copy.deepcopy(batch)).loss.detach())
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()  # loaded tensors are the rank's own
    assert all(torch.isfinite(p).all() for p in pipe.parameters())


def test_a_meta_model_loads_each_stage_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    run_ranks(_per_stage_load, tmp_path, 2, timeout_s=400, directory=str(tmp_path / "ckpt"))
