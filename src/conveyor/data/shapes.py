"""A learnable image data set the code makes: shapes on noisy backgrounds, as JPEG bytes.

train, test = synthetic_images(num_train=4000, num_test=1000, seed=0)
data, label = train[0]        # JPEG bytes (Pillow), label = SHAPES.index(shape)
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING

import numpy
from torch.utils.data import Dataset

from conveyor.data.loader import _seed

if TYPE_CHECKING:
    from PIL import ImageDraw

__all__ = ["SHAPES", "JpegImages", "render_shape", "synthetic_images"]

SHAPES = ("circle", "triangle", "square", "cross")
"""The classes: a label is an index into this tuple."""


class JpegImages(Dataset[tuple[bytes, int]]):
    """(JPEG bytes, label) samples held in memory; decoding is the loader's work."""

    def __init__(self, images: list[bytes], labels: list[int]) -> None:
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels; pass one each")
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        return self.images[index], self.labels[index]


def synthetic_images(
    num_train: int = 4000,
    num_test: int = 1000,
    image_size: int = 96,
    seed: int = 0,
    quality: int = 90,
) -> tuple[JpegImages, JpegImages]:
    """A training and a held-out test set of ``image_size`` JPEG images, one shape each
    (its kind is the label; colour, place, size and angle random), on a noisy background with
    a few distracting lines. The same seed gives the same bytes (with the same Pillow); the
    test set is drawn from other seeds than the training set. About 1 ms an image."""
    if num_train < 1 or num_test < 0 or image_size < 16:
        raise ValueError(
            f"synthetic_images needs num_train >= 1, num_test >= 0 and image_size >= 16, got "
            f"{num_train}, {num_test} and {image_size}"
        )
    splits = []
    for split, count in (("train", num_train), ("test", num_test)):
        labels = [index % len(SHAPES) for index in range(count)]  # balanced classes
        purpose = f"shapes-{split}"
        images = [
            render_shape(labels[i], image_size, _seed(purpose, seed, i), quality)
            for i in range(count)
        ]
        splits.append(JpegImages(images, labels))
    return splits[0], splits[1]


def render_shape(label: int, image_size: int, seed: int, quality: int = 90) -> bytes:
    """One JPEG image of shape ``SHAPES[label]`` drawn from ``seed``."""
    from PIL import Image, ImageDraw  # Pillow comes with matplotlib, a dependency

    random = numpy.random.default_rng(seed)
    background = random.integers(0, 256, size=3)
    noise = random.normal(0.0, 16.0, size=(image_size, image_size, 3))
    pixels = numpy.clip(background + noise, 0, 255).astype(numpy.uint8)
    image = Image.fromarray(pixels, "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(int(random.integers(1, 4))):  # distractors: thin lines in random colours
        ends = random.uniform(0, image_size, size=4).tolist()
        draw.line(ends, fill=_colour(random), width=int(random.integers(1, 3)))
    radius = random.uniform(0.18, 0.32) * image_size
    centre = random.uniform(radius + 2, image_size - radius - 2, size=2)
    # each channel 80 to 175 levels away from the background's (modulo 256): always visible
    colour = (background + random.integers(80, 176, size=3)) % 256
    fill = (int(colour[0]), int(colour[1]), int(colour[2]))
    _draw(draw, SHAPES[label], (float(centre[0]), float(centre[1])), radius, fill, random)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _colour(random: numpy.random.Generator) -> tuple[int, int, int]:
    red, green, blue = random.integers(0, 256, size=3).tolist()
    return int(red), int(green), int(blue)


def _draw(
    draw: ImageDraw.ImageDraw,
    shape: str,
    centre: tuple[float, float],
    radius: float,
    colour: tuple[int, int, int],
    random: numpy.random.Generator,
) -> None:
    angle = float(random.uniform(0.0, 360.0))
    x, y = centre
    if shape == "circle":
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)
    elif shape == "triangle":
        draw.regular_polygon((x, y, radius), 3, rotation=angle, fill=colour)
    elif shape == "square":
        draw.regular_polygon((x, y, radius), 4, rotation=angle, fill=colour)
    else:  # a cross: two bars, a third of the radius thick, turned together
        for turn in (0.0, 90.0):
            draw.polygon(_bar(centre, radius, math.radians(angle + turn)), fill=colour)


def _bar(centre: tuple[float, float], radius: float, angle: float) -> list[tuple[float, float]]:
    """Corners of a bar 2 * radius long and 2 * radius / 3 thick, turned by ``angle``."""
    x, y = centre
    half = radius / 3
    corners = [(-radius, -half), (radius, -half), (radius, half), (-radius, half)]
    cos, sin = math.cos(angle), math.sin(angle)
    return [(x + u * cos - v * sin, y + u * sin + v * cos) for u, v in corners]
