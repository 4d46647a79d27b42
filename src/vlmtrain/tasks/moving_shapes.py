"""Synthetic moving-shapes video QA: short clips drawn with PIL, questions that need more than one frame.

A sample is ``{"videos": [[frame, ...]], "texts": [{"user": question, "assistant": answer}], "qtype", "id",
"clip"}``: one video given as a list of PIL frames (a list of frame images is a valid ``videos`` entry), the
question after it. Two question types, four answers each (chance 0.25, answers balanced within a type):

- ``motion`` — "Which way does the square move?" (left / right / up / down): one square moves the same step
  every frame. Its *last* position is drawn from the same box whatever the direction, so the last frame alone
  says nothing about the answer.
- ``first_color`` — "Which color appears first?" (red / green / blue / yellow): a square or circle of one
  colour from the first frame on, another of a second colour joining it in the last half of the clip; the last
  frame shows both, so it narrows the answer to two colours (0.5 at best) and only the order tells which.

Baselines (:class:`BlankVideos`: background-only frames; :class:`StillVideos`: every frame replaced by the
clip's last frame) show that the answer needs the motion: a model that reads the clip falls to about chance on
blank clips, and to about 0.25 (motion) / at most 0.5 (first_color) on stills.

Every item is a pure function of ``(seed, split, index)``; splits never share a clip (a clip's split bucket is a
hash of its layout, independent of the seed, as in :mod:`vlmtrain.tasks.shapes`).
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from vlmtrain.tasks.shapes import BlankImages
from vlmtrain.tasks.shapes_scenes import BACKGROUND, COLORS, NUM_BUCKETS, SPLIT_BUCKETS

QTYPES = ("motion", "first_color")
ANSWERS: dict[str, tuple[str, ...]] = {
    "motion": ("left", "right", "up", "down"),
    "first_color": ("red", "green", "blue", "yellow"),
}
CHANCE = {q: 1 / len(a) for q, a in ANSWERS.items()}
STILL_BEST = {"motion": 0.25, "first_color": 0.5}
"""The best exact match a model can reach from the last frame alone (see the module docstring)."""
QUESTION = {"motion": "Which way does the square move?", "first_color": "Which color appears first?"}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
SHAPES = ("square", "circle", "triangle")
FRAME_SIZE = 64
"""Pixels per side of a frame: with Qwen's tiny test config (8 px patches, merge 2) 16 video tokens per pair of
frames."""
NUM_FRAMES = 4

# An object of a clip: (shape, colour, its top-left corner per frame as [(x, y) | None] - None: not shown, side px).
Obj = tuple[str, str, list[tuple[int, int] | None], int]


def _bucket(qtype: str, objects: list[Obj]) -> int:
    digest = hashlib.sha256(json.dumps([qtype, objects]).encode()).digest()
    return int.from_bytes(digest[:4], "big") % NUM_BUCKETS


def _motion(rng: random.Random, answer: str, frames: int, size: int) -> list[Obj]:
    side = size // 3
    step = max(1, size // 12)
    travel = step * (frames - 1)
    end = (rng.randint(travel, size - side - travel), rng.randint(travel, size - side - travel))
    dx, dy = DIRECTIONS[answer]
    path: list[tuple[int, int] | None] = [(end[0] - dx * step * (frames - 1 - t), end[1] - dy * step * (frames - 1 - t))
                                          for t in range(frames)]
    return [("square", rng.choice(ANSWERS["first_color"]), path, side)]


def _first_color(rng: random.Random, answer: str, frames: int, size: int) -> list[Obj]:
    side = size // 3
    second = rng.choice([c for c in ANSWERS["first_color"] if c != answer])
    t_second = rng.randint(frames // 2, frames - 1)  # the first shows from frame 0, the second in the last half
    while True:  # two places that do not overlap
        a = (rng.randint(0, size - side), rng.randint(0, size - side))
        b = (rng.randint(0, size - side), rng.randint(0, size - side))
        if abs(a[0] - b[0]) >= side or abs(a[1] - b[1]) >= side:
            break
    return [(rng.choice(SHAPES[:2]), color, [at if t >= start else None for t in range(frames)], side)
            for color, at, start in ((answer, a, 0), (second, b, t_second))]


def render_frame(objects: list[Obj], t: int, size: int) -> Image.Image:
    """Frame ``t`` of a clip: each object shown at frame ``t`` drawn on the light background."""
    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for shape, color, path, side in objects:
        if path[t] is None:
            continue
        x, y = path[t]
        box = (x, y, x + side - 1, y + side - 1)
        fill = COLORS[color]
        if shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(x + side // 2, y), (x, y + side - 1), (x + side - 1, y + side - 1)], fill=fill)
    return img


class MovingShapes(Dataset):
    """Map-style synthetic video QA (see the module docstring); item ``i`` is a pure function of (seed, split, i).

    ``qtypes``: the question types asked (default both, alternating by index, so each type has half the items
    and, within a type, balanced answers); ``num_frames`` frames of ``frame_size`` px per clip.
    """

    def __init__(self, split: str = "train", num_samples: int = 1000, seed: int = 0,
                 qtypes: list[str] | tuple[str, ...] | None = None, num_frames: int = NUM_FRAMES,
                 frame_size: int = FRAME_SIZE) -> None:
        if split not in SPLIT_BUCKETS:
            raise ValueError(f"unknown split {split!r}; expected one of {list(SPLIT_BUCKETS)}")
        qtypes = tuple(qtypes or QTYPES)
        bad = [q for q in qtypes if q not in QTYPES]
        if bad or num_samples < 0 or num_frames < 2 or frame_size < 16:
            raise ValueError(f"expected qtypes among {list(QTYPES)} (got {list(qtypes)}), num_samples >= 0 (got "
                             f"{num_samples}), num_frames >= 2 (got {num_frames}), frame_size >= 16 (got "
                             f"{frame_size})")
        self.split, self.num_samples, self.seed, self.qtypes = split, num_samples, seed, qtypes
        self.num_frames, self.frame_size = num_frames, frame_size

    def __len__(self) -> int:
        return self.num_samples

    def clip(self, index: int) -> tuple[str, str, list[Obj]]:
        """(qtype, answer, objects) of item ``index``."""
        qtype = self.qtypes[index % len(self.qtypes)]
        digest = hashlib.sha256(f"moving-shapes-{self.seed}-{self.split}-{index}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        answers = ANSWERS[qtype]  # balanced: every run of len(answers) items of a type asks each answer once
        answer = answers[(index // len(self.qtypes)) % len(answers)]
        make = _motion if qtype == "motion" else _first_color
        while True:
            objects = make(rng, answer, self.num_frames, self.frame_size)
            if _bucket(qtype, objects) in SPLIT_BUCKETS[self.split]:
                return qtype, answer, objects

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        qtype, answer, objects = self.clip(index)
        frames = [render_frame(objects, t, self.frame_size) for t in range(self.num_frames)]
        return {"videos": [frames], "texts": [{"user": QUESTION[qtype], "assistant": answer}], "qtype": qtype,
                "id": f"{self.split}-{index}", "clip": objects}


class BlankVideos(BlankImages):
    """The same samples with every frame replaced by the empty background (same size and count): what a model
    scores without seeing anything (about chance, answers being balanced)."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.dataset[index])
        sample["videos"] = [[Image.new("RGB", f.size, BACKGROUND) for f in frames] for frames in sample["videos"]]
        return sample


class StillVideos(BlankVideos):
    """The same samples with every frame replaced by the clip's last frame: a single frame, no motion (about
    :data:`STILL_BEST` at best)."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.dataset[index])
        sample["videos"] = [[frames[-1].copy() for _ in frames] for frames in sample["videos"]]
        return sample
