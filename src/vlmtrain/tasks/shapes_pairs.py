"""data.source: shapes_pairs — one coloured shape in a 64 px scene (the shapes task's drawing,
:mod:`vlmtrain.tasks.shapes_scenes`) and a colour or shape question, as preference pairs for the two-stage
preference demo: ``chosen`` is the right answer, ``rejected`` a wrong one of the same kind. With
``train.objective: sft`` the same questions come as conversations answered right (stage 1); with dpo or reward
as pairs (stage 2, and the reward-head variant). One object, so that a tiny random-init model learns to read it
in a few hundred steps on CPU. The data source itself (build, chance, the demo report): shapes_pairs_source.py."""

from __future__ import annotations

import hashlib
import random
from typing import Any

from torch.utils.data import Dataset

PAIR_QTYPES = ("color",)
"""The question types asked: each has a wrong answer of its own kind (another colour or shape)."""
QUESTIONS = {"color": "What color is the shape?", "shape": "What shape is it?"}


class ShapesPairs(Dataset):
    """Item ``i``: one shape of one colour in a 64 px image (the shapes task's grid cells and split buckets: no
    scene in two splits) and a :data:`PAIR_QTYPES` question, the types alternating by index and the answers
    balanced within each type; as a pair ``{"images", "texts": [{"user": question}], "chosen": truth,
    "rejected": a wrong answer of its kind, "qtype", "id"}``, with ``pairs=False`` as an SFT sample (``texts:
    [{"user", "assistant": truth}]``). A pure function of (seed, split, i)."""

    def __init__(self, split: str, num_samples: int, seed: int = 0, pairs: bool = True,
                 qtypes: tuple[str, ...] = PAIR_QTYPES) -> None:
        self.split, self.num_samples, self.seed, self.pairs, self.qtypes = split, num_samples, seed, pairs, qtypes

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Any]:
        from vlmtrain.tasks.shapes_scenes import (
            ANSWERS,
            COLORS,
            SHAPES,
            SPLIT_BUCKETS,
            render_scene,
            scene_bucket,
        )

        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        qtype = self.qtypes[index % len(self.qtypes)]
        answer = ANSWERS[qtype][(index // len(self.qtypes)) % len(ANSWERS[qtype])]
        digest = hashlib.sha256(f"shapes-pairs-{self.seed}-{self.split}-{index}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        shape, color = (rng.choice(SHAPES), answer) if qtype == "color" else (answer, rng.choice(tuple(COLORS)))
        while True:  # a large shape near the centre: every image token sees some of it
            scene = [(shape, color, 32 + rng.randint(-4, 4), 32 + rng.randint(-4, 4), rng.randint(36, 52))]
            if scene_bucket(scene, 64) in SPLIT_BUCKETS[self.split]:
                break
        sample = {"images": [render_scene(scene, 64)], "qtype": qtype, "id": f"{self.split}-{index}"}
        if not self.pairs:
            return {**sample, "texts": [{"user": QUESTIONS[qtype], "assistant": answer}]}
        rejected = rng.choice([a for a in ANSWERS[qtype] if a != answer])
        return {**sample, "texts": [{"user": QUESTIONS[qtype]}], "chosen": answer, "rejected": rejected}
