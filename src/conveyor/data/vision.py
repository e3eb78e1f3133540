"""Image augmentation for Refurbish, split where it pays: decode and crop (partial), then flip,
colour jitter, normalize and cutout on whole batches (final); Pillow decodes, kornia augments.

    loader = Refurbish(images, 64, partial=DecodeCrop(32), batch_final=FinalAugment(),
                       reuse=3, num_workers=2)        # images: (JPEG bytes, label) samples
    evaluation = [FinalAugment(train=False)(default_collate([DecodeResize(32)(s) for s in test]))]
"""

from __future__ import annotations

import importlib
import io
from types import ModuleType
from typing import Any

import numpy
import torch
from PIL import Image

__all__ = ["MEAN", "STD", "DecodeCrop", "DecodeResize", "FinalAugment"]

MEAN = (0.5, 0.5, 0.5)
"""Per-channel mean that FinalAugment subtracts by default."""
STD = (0.25, 0.25, 0.25)
"""Per-channel deviation that FinalAugment divides by default."""


def _kornia() -> ModuleType:
    try:
        return importlib.import_module("kornia.augmentation")
    except ImportError as error:
        raise ImportError(
            f"conveyor.data.vision augments images with kornia, which is not installed "
            f"({error}); install it with: pip install conveyor[vision]"
        ) from error


def _decode(data: bytes) -> torch.Tensor:
    """JPEG (or any Pillow format) bytes as a float (3, H, W) tensor in [0, 1]."""
    with Image.open(io.BytesIO(data)) as image:
        pixels = numpy.array(image.convert("RGB"))  # a writable copy, (H, W, 3) uint8
    image_module = importlib.import_module("kornia.image")
    tensor: torch.Tensor = image_module.image_to_tensor(pixels, keepdim=True)
    return tensor.float().div_(255)


class DecodeCrop:
    """Partial augmentation of an (image bytes, label) sample: decode, then a random crop of
    ``scale`` of the area at an aspect ratio in ``ratio``, resized to ``size`` x ``size``.
    Returns (float tensor (3, size, size) in [0, 1], label): 12 KiB a sample at size 32."""

    def __init__(
        self,
        size: int,
        scale: tuple[float, float] = (0.25, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        self.crop = _kornia().RandomResizedCrop((size, size), scale=scale, ratio=ratio)

    def __call__(self, sample: tuple[bytes, Any]) -> tuple[torch.Tensor, Any]:
        data, label = sample
        with torch.no_grad():
            return self.crop(_decode(data))[0], label


class DecodeResize:
    """Evaluation's counterpart of DecodeCrop: decode, resize the whole image to ``size``."""

    def __init__(self, size: int) -> None:
        self.resize = _kornia().Resize((size, size))

    def __call__(self, sample: tuple[bytes, Any]) -> tuple[torch.Tensor, Any]:
        data, label = sample
        with torch.no_grad():
            return self.resize(_decode(data))[0], label


class FinalAugment:
    """Final augmentation of a collated (images, labels) batch, each image drawn on its own:
    horizontal flip, colour jitter (brightness, contrast, saturation; ``jitter``, with
    probability 0.8), normalize by ``mean`` and ``std``, and cutout (random erasing, with
    probability ``cutout``). With ``train=False``, only normalize. Cheap on a batch (about
    0.1 ms an image of 32 x 32 on a CPU core), where per image kornia costs ten times more."""

    def __init__(
        self,
        mean: tuple[float, ...] = MEAN,
        std: tuple[float, ...] = STD,
        jitter: float = 0.4,
        cutout: float = 0.5,
        train: bool = True,
    ) -> None:
        augmentation = _kornia()
        steps: list[torch.nn.Module] = []
        if train:
            steps.append(augmentation.RandomHorizontalFlip())
            steps.append(augmentation.ColorJitter(jitter, jitter, jitter, 0.0, p=0.8))
        steps.append(augmentation.Normalize(mean=torch.tensor(mean), std=torch.tensor(std)))
        if train and cutout > 0:
            steps.append(augmentation.RandomErasing(p=cutout))
        self.steps = torch.nn.Sequential(*steps)

    def __call__(self, batch: Any) -> Any:
        images, *rest = batch
        with torch.no_grad():
            finished = self.steps(images)
        return type(batch)([finished, *rest]) if isinstance(batch, list) else (finished, *rest)
