"""Synthetic shapes VQA: coloured shapes drawn with PIL and short-answer questions about them.

Samples follow the_cauldron schema (``{"images": [...], "texts": [{"user", "assistant"}]}``) plus
``qtype``, ``id`` and ``scene`` (per image, a list of ``(shape, color, x, y, size)``: centre and
extent in pixels), so every answer can be re-derived from the metadata.

Every item is a pure function of ``(seed, split, index)``: any index can be produced alone, in any
worker, and gives the same pixels and text. Splits never share an image: a scene's split bucket is
a hash of its layout (independent of the seed), and a scene is re-drawn until it lands in the
requested split's buckets (train 0-7, val 8, test 9 of 10).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

# The scene vocabulary, drawing and questions live in shapes_scenes; the public names are re-exported here.
from vlmtrain.tasks.shapes_scenes import (  # noqa: F401
    ANSWERS,
    BACKGROUND,
    CHANCE,
    COLORS,
    DEFAULT_QTYPES,
    MULTI_IMAGE_QTYPES,
    PLURALS,
    QTYPES,
    SHAPES,
    SINGLE_IMAGE_QTYPES,
    SPLIT_BUCKETS,
    _Generator,
    answer_word,
    is_multi_image,
    render_scene,
    scene_questions,
    where_answer,
)

# What the lookup warm-up asks: each names an object, a colour or a shape that must be found among the others
# (multi_count: the named shape, in each image). Counting all shapes of an image joins after it.
LOOKUP_QTYPES = ("color", "shape", "position", "side", "multi_color", "multi_count")


def bad_qtype_weights(weights: dict[str, float] | None) -> dict[str, float]:
    """The entries of ``weights`` that are not a question type with a weight > 0."""
    return {q: w for q, w in (weights or {}).items() if q not in QTYPES or not w > 0}


class ShapesVQA(Dataset):
    """Map-style synthetic VQA over coloured shapes; item ``i`` is a pure function of (seed, split, i).

    ``multi_image_fraction`` of the items (in expectation) ask about two images (``multi_count``,
    ``multi_color``); the rest ask about one (``color``, ``shape``, ``count``, ``position``), the
    types within each group drawn uniformly, or by ``qtype_weights`` (relative weights, default 1: the first
    question's type and each extra turn's type are drawn with them). ``qtypes`` restricts the types; if it holds only one
    group, every item comes from that group. Answers are single words from ``ANSWERS[qtype]``,
    balanced within each type, except that side and position answers name the object first ("circle left":
    :func:`where_answer`; :func:`answer_word` gives the side). Splits ``train``/``val``/``test`` never share an image, whatever the
    seeds (see the module docstring).

    With ``questions_per_sample`` > 1 a sample is a multi-turn conversation: after its first question
    (the balanced one above) come up to that many in all, drawn from every question of its group
    (single or multi image) that the scene answers unambiguously (:func:`scene_questions`), no
    question twice. More answers per rendered image train a small model faster; keep evaluation sets
    at 1. ``qtype`` is the first question's type; ``turn_qtypes`` lists every turn's.

    ``side_fraction`` of the position questions are asked as absolute ``side`` questions instead ("Is
    the circle left or right?"), and extra turns draw from side questions too; for the first
    ``side_warmup_steps`` training steps every position question is a side one. A small model trained
    from scratch learns relative position only after it learned to read one named object's x this way.
    The warm-up makes an item depend on the training step too: ``follows_step`` is then True, and
    the Trainer's sampler asks for :meth:`get_item_at_step` with the step each position of the data
    order feeds (see vlmtrain.data.step_data), so worker processes and resumes see the same items.
    ``ds[i]`` is item ``i`` at step 0.
    """

    def __init__(
        self,
        split: str = "train",
        num_samples: int = 1000,
        seed: int = 0,
        image_size: int = 64,
        multi_image_fraction: float = 0.25,
        qtypes: list[str] | None = None,
        questions_per_sample: int = 1,
        side_fraction: float = 0.0,
        side_warmup_steps: int = 0,
        lookup_warmup_steps: int = 0,
        qtype_weights: dict[str, float] | None = None,
    ) -> None:
        if split not in SPLIT_BUCKETS:
            raise ValueError(f"unknown split {split!r}; expected one of {list(SPLIT_BUCKETS)}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if image_size < 32:
            raise ValueError(f"image_size must be >= 32 so that shapes stay recognizable, got {image_size}")
        if not 0.0 <= multi_image_fraction <= 1.0:
            raise ValueError(f"multi_image_fraction must be in [0, 1], got {multi_image_fraction}")
        if questions_per_sample < 1:
            raise ValueError(f"questions_per_sample must be >= 1, got {questions_per_sample}")
        if not 0.0 <= side_fraction <= 1.0 or side_warmup_steps < 0 or lookup_warmup_steps < 0:
            raise ValueError(f"side_fraction must be in [0, 1] and the warm-up steps >= 0, got {side_fraction}, "
                             f"{side_warmup_steps} and {lookup_warmup_steps}")
        qtypes = list(DEFAULT_QTYPES) if qtypes is None else list(qtypes)
        unknown = [q for q in qtypes if q not in QTYPES]
        if unknown or not qtypes:
            raise ValueError(f"qtypes must be a non-empty subset of {list(QTYPES)}, got {qtypes}")
        self.split, self.num_samples, self.seed = split, num_samples, seed
        self.image_size, self.multi_image_fraction = image_size, multi_image_fraction
        self.qtypes, self.questions_per_sample = qtypes, questions_per_sample
        self._single = [q for q in QTYPES if q in qtypes and not is_multi_image(q)]
        self._multi = [q for q in QTYPES if q in qtypes and is_multi_image(q)]
        self.side_fraction, self.side_warmup_steps = side_fraction, side_warmup_steps
        self.lookup_warmup_steps = lookup_warmup_steps
        bad = bad_qtype_weights(qtype_weights)
        if bad:
            raise ValueError(f"qtype_weights must map question types ({list(QTYPES)}) to weights > 0, got {bad}")
        self.qtype_weights = dict(qtype_weights or {})
        self._gen = _Generator(split, image_size)

    @property
    def follows_step(self) -> bool:
        """True with a warm-up: an item then depends on the training step it feeds."""
        return self.side_warmup_steps > 0 or self.lookup_warmup_steps > 0

    def __len__(self) -> int:
        return self.num_samples

    def _rng(self, index: int) -> random.Random:
        digest = hashlib.sha256(f"shapes-vqa-{self.seed}-{self.split}-{index}".encode()).digest()
        return random.Random(int.from_bytes(digest[:8], "big"))

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get_item_at_step(index, 0)

    def _draw(self, rng: random.Random, qtypes: list[str]) -> str:
        """A question type from ``qtypes``, by ``qtype_weights`` (uniform when none applies)."""
        weights = [self.qtype_weights.get(q, 1.0) for q in qtypes]
        if len(set(weights)) == 1:
            return rng.choice(qtypes)  # the draw of the unweighted dataset: its items stay what they were
        return rng.choices(qtypes, weights=weights)[0]

    def qtypes_asked_before(self, step: int) -> set[str]:
        """The question types that training items of steps 0 to ``step - 1`` can ask, as a first question or an
        extra turn (:meth:`get_item_at_step` draws them; a warm-up leaves some out at first)."""
        kinds = {False} if self.multi_image_fraction <= 0 else {True} if self.multi_image_fraction >= 1 else {False, True}
        asked: set[str] = set()
        for at in {0, self.lookup_warmup_steps, self.side_warmup_steps}:  # what an item asks changes only there
            if not 0 <= at < step:
                continue
            for multi in kinds:
                group = (self._multi if multi else self._single) or self._single or self._multi
                if at < self.lookup_warmup_steps:
                    group = [q for q in group if q in LOOKUP_QTYPES] or group
                first = set(group)
                sides = "position" in group and (self.side_fraction > 0 or self.side_warmup_steps > 0)
                if sides:
                    warmup = at < self.side_warmup_steps
                    first |= {"side"} if warmup or self.side_fraction > 0 else set()
                    first -= {"position"} if warmup or self.side_fraction >= 1 else set()
                extra = set(group) | ({"side"} if sides else set()) if self.questions_per_sample > 1 else set()
                asked |= first | extra
        return asked

    def get_item_at_step(self, index: int, step: int) -> dict[str, Any]:
        """Item ``index`` as the training step ``step`` (optimizer steps done before it) sees it."""
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        index %= self.num_samples
        rng = self._rng(index)
        multi = rng.random() < self.multi_image_fraction
        group = (self._multi if multi else self._single) or self._single or self._multi
        lookup = step < self.lookup_warmup_steps
        if lookup:
            group = [q for q in group if q in LOOKUP_QTYPES] or group
        qtype = self._draw(rng, group)
        sides = "position" in group and (self.side_fraction > 0 or self.side_warmup_steps > 0)
        if sides and qtype == "position":
            warmup = step < self.side_warmup_steps
            qtype = "side" if rng.random() < (1.0 if warmup else self.side_fraction) else qtype
        several = {"min_objects": 2} if lookup and qtype in ("color", "shape") else {}
        scenes, question, answer = getattr(self._gen, qtype)(rng, **several)
        turns, turn_qtypes = [{"user": question, "assistant": answer}], [qtype]
        if self.questions_per_sample > 1:
            # A type first (uniformly among those with questions left), then one of its questions: types with
            # many candidate questions (multi_color has one per colour) do not crowd out the rest.
            group = group + ["side"] if sides and "side" not in group else group
            extra = {q: [qa for qa in scene_questions(q, scenes, self.image_size) if qa[0] != question]
                     for q in group}
            for _ in range(self.questions_per_sample - 1):
                left = [q for q in group if extra[q]]
                if not left:
                    break
                q = self._draw(rng, left)
                user, assistant = extra[q].pop(rng.randrange(len(extra[q])))
                turns.append({"user": user, "assistant": assistant})
                turn_qtypes.append(q)
        return {
            "images": [render_scene(s, self.image_size) for s in scenes],
            "texts": turns,
            "qtype": qtype,
            "turn_qtypes": turn_qtypes,
            "id": f"{self.split}-{index}",
            "scene": scenes,
        }


class BlankImages(Dataset):
    """The same samples with every image replaced by an empty scene (background only, same size).

    What a model scores without seeing the shapes: with balanced answers, a model that really reads
    the images falls to about chance here (``CHANCE``), while a model that learned shortcuts from
    the question text would not.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = dict(self.dataset[index])
        sample["images"] = [Image.new("RGB", img.size, BACKGROUND) for img in sample["images"]]
        return sample
