"""data.source: shapes_scores — score-only samples for a Hub VLM with two heads, from the shapes generator.

Each sample is one rendered shapes scene and a question naming one of its shapes ("What color is the
triangle?", the shape unique in the scene), with no assistant turn, and two head labels:
``count`` (the number of objects in the scene, 1-4, a float for a regression head) and ``color`` (the index
in :data:`COLOR_NAMES` of the named shape's colour, for a classification head). Items are a pure function of
``(seed, split, index)``; train and val never share a scene (see :mod:`vlmtrain.tasks.shapes`).
``data.blank_images: true`` gives the baseline: the same questions and labels with empty images. The data
source itself (options, build): shapes_scores_source.py.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from torch.utils.data import Dataset

IMAGE_SIZE = 64
"""Pixels per side: a Qwen-style encoder with 8 px patches and merge 2 gives 16 image tokens, one per grid cell."""


class ShapesScores(Dataset):
    """Map-style score-only samples: ``{"images": [scene], "texts": [{"user": question}], "labels": {"count":
    float, "color": int}, "id", "scene"}``; item ``i`` is a pure function of (seed, split, i)."""

    def __init__(self, split: str = "train", num_samples: int = 1000, seed: int = 0,
                 image_size: int = IMAGE_SIZE) -> None:
        from vlmtrain.tasks.shapes_scenes import SPLIT_BUCKETS, _Generator

        if split not in SPLIT_BUCKETS:
            raise ValueError(f"unknown split {split!r}; expected one of {list(SPLIT_BUCKETS)}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.split, self.num_samples, self.seed, self.image_size = split, num_samples, seed, image_size
        self._gen = _Generator(split, image_size)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        from vlmtrain.tasks.shapes_scenes import render_scene

        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        digest = hashlib.sha256(f"shapes-scores-{self.seed}-{self.split}-{index}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        scenes, question, color = self._gen.color(rng)  # the named shape occurs once in the scene
        return {
            "images": [render_scene(scenes[0], self.image_size)],
            "texts": [{"user": question}],  # no assistant turn: score-only
            "labels": {"count": float(len(scenes[0])), "color": COLOR_NAMES.index(color)},
            "id": f"{self.split}-{index}",
            "scene": scenes,
        }


def _color_names() -> tuple[str, ...]:
    from vlmtrain.tasks.shapes_scenes import COLORS

    return tuple(COLORS)


COLOR_NAMES: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
"""Class index -> colour name of the ``color`` head (the order of :data:`vlmtrain.tasks.shapes.COLORS`)."""
