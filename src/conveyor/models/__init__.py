"""Models that ship with conveyor, for the demo, examples, tests and benchmarks."""

from conveyor.models.chunked import ChunkedGPT
from conveyor.models.dlrm import DLRM, click_batches, click_loss, dlrm
from conveyor.models.gpt import (
    Block,
    Embedding,
    Head,
    char_corpus,
    char_ids,
    gpt,
    gpt_loss,
    gpt_tp_plan,
    text_batches,
    unigram_entropy,
)
from conveyor.models.multimodal import TwoTower, classification_loss, multimodal_batches, two_tower
from conveyor.models.unet import segmentation_batches, segmentation_loss, unet

__all__ = [
    "DLRM",
    "Block",
    "ChunkedGPT",
    "Embedding",
    "Head",
    "TwoTower",
    "char_corpus",
    "char_ids",
    "classification_loss",
    "click_batches",
    "click_loss",
    "dlrm",
    "gpt",
    "gpt_loss",
    "gpt_tp_plan",
    "multimodal_batches",
    "segmentation_batches",
    "segmentation_loss",
    "text_batches",
    "two_tower",
    "unet",
    "unigram_entropy",
]
