"""Input for a pipeline's first stage: a resumable batch order, Refurbish (reuse of partially
augmented samples, worker processes, exact resume), feeding a pipeline's other ranks, and a
synthetic image data set. Image transforms for Refurbish: conveyor.data.vision.

    loader = ResumableLoader(dataset, batch_size=32, seed=0)          # each sample once an epoch
    loader = Refurbish(images, 32, partial=DecodeCrop(32), batch_final=FinalAugment(), reuse=3)
    inputs, targets = next(broadcast_batches(loader, group=pipe.group))  # loaded on rank 0 only
"""

from conveyor.data.broadcast import broadcast_batches
from conveyor.data.loader import ResumableLoader, epoch_order
from conveyor.data.refurbish import Refurbish
from conveyor.data.shapes import SHAPES, JpegImages, synthetic_images

__all__ = [
    "SHAPES",
    "JpegImages",
    "Refurbish",
    "ResumableLoader",
    "broadcast_batches",
    "epoch_order",
    "synthetic_images",
]
