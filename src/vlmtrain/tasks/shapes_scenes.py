"""Scenes of the synthetic shapes VQA: objects, their layout in split buckets, drawing, and the
questions a scene answers (the wording shared by every question generator). See :mod:`vlmtrain.tasks.shapes`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter

from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (235, 200, 20),
    "purple": (145, 55, 190),
    "orange": (250, 140, 20),
}
BACKGROUND = (240, 240, 240)
SINGLE_IMAGE_QTYPES = ("color", "shape", "count", "position")
MULTI_IMAGE_QTYPES = ("multi_count", "multi_color")
# "side" ("Is the circle left or right?": which half of the image) is absolute position: a stepping stone
# to relative position, asked only in place of some position questions (ShapesVQA's side_fraction) or alone.
QTYPES = SINGLE_IMAGE_QTYPES + MULTI_IMAGE_QTYPES + ("side",)
DEFAULT_QTYPES = SINGLE_IMAGE_QTYPES + MULTI_IMAGE_QTYPES
MAX_OBJECTS = 4
GRID = 4  # objects sit in cells of a GRID x GRID grid (see _Generator)
ANSWERS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "count": ("1", "2", "3", "4"),
    "position": ("left", "right"),
    "side": ("left", "right"),
    "multi_count": ("first", "second"),
    "multi_color": ("first", "second", "both", "neither"),
}
CHANCE = {q: 1 / len(a) for q, a in ANSWERS.items()}  # answers are balanced within each type
SPLIT_BUCKETS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}
NUM_BUCKETS = 10
_SUPERSAMPLE = 4  # draw at 4x and box-downsample: smooth, deterministic edges

Obj = tuple[str, str, int, int, int]  # shape, color, centre x, centre y, size (px)
Scene = list[Obj]


# Question wording, shared by the per-type generators and scene_questions (the extra turns).
QUESTION = {
    "color": "What color is the {shape}?",
    "shape": "What shape is the {color} object?",
    "count_all": "How many shapes are there?",
    "count": "How many {shapes} are there?",
    # The named object first where the side question has it, so that its side lookup carries over.
    "position": "Relative to the {b}, is the {a} left or right?",
    "side": "Is the {a} left or right?",
    "multi_count": "Which image has more {shapes}?",
    "multi_color": "Which image has {article} {color} shape?",
}
# Where-questions are answered with the named object, then its side ("circle left"); the other types with one
# word from ANSWERS. The side word is then predicted at the noun's own position, where the look-up of that
# object needs nothing more: with a one-word answer it needed the noun brought to the answer position first,
# which a 3-layer decoder learned on some seeds only (configs/shapes-tiny.md).
WHERE_ANSWER = "{a} {side}"


def where_answer(a: str, side: str) -> str:
    """The answer to a side or position question about object ``a`` whose side is ``side`` (left/right)."""
    return WHERE_ANSWER.format(a=a, side=side)


def answer_word(qtype: str, answer: str) -> str:
    """The part of an answer that is one of ``ANSWERS[qtype]`` (the side of a where-answer)."""
    return answer.rsplit(" ", 1)[-1] if qtype in ("position", "side") else answer


def position_margin(image_size: int) -> float:
    """Position questions name two objects whose centres are at least this many pixels apart in x."""
    return image_size / 6


def half(obj: Obj, image_size: int) -> str:
    """Which half of the image an object's centre is in (objects never straddle the middle): a side answer."""
    return "left" if obj[2] < image_size / 2 else "right"


def _multi_color_question(color: str) -> str:
    return QUESTION["multi_color"].format(article="an" if color[0] in "aeiou" else "a", color=color)


def is_multi_image(qtype: str) -> bool:
    """True for question types that come with two images."""
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; expected one of {list(QTYPES)}")
    return qtype in MULTI_IMAGE_QTYPES


def scene_bucket(scene: Scene, image_size: int) -> int:
    """Split bucket (0..9) of a scene: a hash of its layout, independent of object order and seed."""
    key = json.dumps([image_size, sorted(list(o) for o in scene)])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % NUM_BUCKETS


def render_scene(scene: Scene, image_size: int = 64) -> Image.Image:
    """Draw a scene as an RGB image of ``image_size`` x ``image_size`` pixels."""
    k = _SUPERSAMPLE
    img = Image.new("RGB", (image_size * k, image_size * k), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for shape, color, x, y, size in scene:
        cx, cy, h = x * k, y * k, size * k / 2
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse([cx - h, cy - h, cx + h, cy + h], fill=fill)
        elif shape == "square":
            s = 0.9 * h  # a touch smaller, so squares do not look heavier than circles
            draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fill)
        elif shape == "triangle":
            draw.polygon([(cx, cy - h), (cx + h, cy + h), (cx - h, cy + h)], fill=fill)
        elif shape == "cross":
            t = 0.36 * h
            draw.rectangle([cx - h, cy - t, cx + h, cy + t], fill=fill)
            draw.rectangle([cx - t, cy - h, cx + t, cy + h], fill=fill)
        else:
            raise ValueError(f"unknown shape {shape!r}")
    return img.resize((image_size, image_size), Image.Resampling.BOX)


class _Generator:
    """Draws scenes and questions for one (split, image_size); all randomness comes from ``rng``.

    Objects sit in distinct cells of a ``GRID`` x ``GRID`` grid, each jittered inside its cell: a
    scene is still one of ~10^9 layouts, but an object never straddles two image tokens of a
    pixel-shuffled 64px/8px-patch encoder, which is what lets a tiny encoder trained from scratch
    learn shapes within minutes on CPU.
    """

    def __init__(self, split: str, image_size: int) -> None:
        self.buckets = SPLIT_BUCKETS[split]
        self.size = image_size
        self.cell = image_size // GRID
        self.min_size, self.max_size = round(0.75 * self.cell), self.cell - 2
        self.margin = position_margin(image_size)

    def layout(self, rng: random.Random, attrs: list[tuple[str, str]]) -> Scene:
        """Place objects with these (shape, color) in random distinct cells, re-drawn until in-split."""
        for _ in range(10_000):
            scene = self._place(rng, attrs)
            if scene_bucket(scene, self.size) in self.buckets:
                return scene
        raise RuntimeError(f"could not lay out {attrs} in a {self.size}px image")

    def _place(self, rng: random.Random, attrs: list[tuple[str, str]]) -> Scene:
        scene: Scene = []
        for (shape, color), cell in zip(attrs, rng.sample(range(GRID * GRID), len(attrs))):
            size = rng.randint(self.min_size, self.max_size)
            lo, hi = (size + 1) // 2 + 1, self.cell - (size + 1) // 2 - 1  # 1px clear of the cell's edges
            x0, y0 = (cell % GRID) * self.cell, (cell // GRID) * self.cell
            scene.append((shape, color, x0 + rng.randint(lo, hi), y0 + rng.randint(lo, hi), size))
        return scene

    @staticmethod
    def attrs(rng: random.Random, n: int, shapes=SHAPES, colors=tuple(COLORS)) -> list[tuple[str, str]]:
        return [(rng.choice(shapes), rng.choice(colors)) for _ in range(n)]

    def _with_unique(self, rng: random.Random, by: int,
                     min_objects: int = 1) -> tuple[list[tuple[str, str]], tuple[str, str]]:
        """Objects for one image and one of them whose shape (by=0) or colour (by=1) occurs only once."""
        while True:
            attrs = self.attrs(rng, rng.randint(min_objects, MAX_OBJECTS))
            counts = Counter(a[by] for a in attrs)
            unique = [a for a in attrs if counts[a[by]] == 1]
            if unique:
                return attrs, rng.choice(unique)

    def color(self, rng: random.Random, min_objects: int = 1) -> tuple[list[Scene], str, str]:
        attrs, (shape, color) = self._with_unique(rng, by=0, min_objects=min_objects)
        return [self.layout(rng, attrs)], QUESTION["color"].format(shape=shape), color

    def shape(self, rng: random.Random, min_objects: int = 1) -> tuple[list[Scene], str, str]:
        attrs, (shape, color) = self._with_unique(rng, by=1, min_objects=min_objects)
        return [self.layout(rng, attrs)], QUESTION["shape"].format(color=color), shape

    def count(self, rng: random.Random) -> tuple[list[Scene], str, str]:
        k = rng.randint(1, MAX_OBJECTS)
        if rng.random() < 0.5:
            return [self.layout(rng, self.attrs(rng, k))], QUESTION["count_all"], str(k)
        target = rng.choice(SHAPES)
        others = [s for s in SHAPES if s != target]
        attrs = self.attrs(rng, k, shapes=(target,)) + self.attrs(rng, rng.randint(0, MAX_OBJECTS - k), others)
        rng.shuffle(attrs)
        return [self.layout(rng, attrs)], QUESTION["count"].format(shapes=PLURALS[target]), str(k)

    def position(self, rng: random.Random) -> tuple[list[Scene], str, str]:
        answer = rng.choice(ANSWERS["position"])
        while True:
            scene = self.layout(rng, self.attrs(rng, rng.randint(2, MAX_OBJECTS)))
            counts = Counter(o[0] for o in scene)
            unique = [o for o in scene if counts[o[0]] == 1]  # objects are named by shape: it must be unique
            pairs = [(a, b) for a in unique for b in unique if a[2] + self.margin <= b[2]]
            if pairs:
                break
        a, b = rng.choice(pairs)  # a is left of b
        if answer == "right":
            a, b = b, a
        return [scene], QUESTION["position"].format(a=a[0], b=b[0]), where_answer(a[0], answer)

    def side(self, rng: random.Random) -> tuple[list[Scene], str, str]:
        answer = rng.choice(ANSWERS["side"])
        # Half about a lone object (the x of the whole image is the answer: an easy start). A knife edge in the
        # demo: with a quarter its seed never learned side questions; with half, seed 1 never learned to look
        # named shapes up (colour 0.7), and learned both with a quarter.
        n = 1 if rng.random() < 0.5 else rng.randint(2, MAX_OBJECTS)
        while True:
            scene = self.layout(rng, self.attrs(rng, n))
            counts = Counter(o[0] for o in scene)
            named = [o for o in scene if counts[o[0]] == 1 and half(o, self.size) == answer]
            if named:
                break
        a = rng.choice(named)[0]
        return [scene], QUESTION["side"].format(a=a), where_answer(a, answer)

    def multi_count(self, rng: random.Random) -> tuple[list[Scene], str, str]:
        target = rng.choice(SHAPES)
        others = [s for s in SHAPES if s != target]
        less = rng.randint(0, MAX_OBJECTS - 1)
        more = rng.randint(less + 1, MAX_OBJECTS)
        scenes = []
        for c in (more, less):
            attrs = self.attrs(rng, c, shapes=(target,))
            attrs += self.attrs(rng, rng.randint(max(0, 1 - c), MAX_OBJECTS - c), shapes=others)
            rng.shuffle(attrs)
            scenes.append(self.layout(rng, attrs))
        answer = rng.choice(ANSWERS["multi_count"])
        if answer == "second":
            scenes.reverse()
        return scenes, QUESTION["multi_count"].format(shapes=PLURALS[target]), answer

    def multi_color(self, rng: random.Random) -> tuple[list[Scene], str, str]:
        color = rng.choice(tuple(COLORS))
        others = tuple(c for c in COLORS if c != color)
        answer = rng.choice(ANSWERS["multi_color"])
        has = {"first": (True, False), "second": (False, True), "both": (True, True), "neither": (False, False)}
        scenes = []
        for with_color in has[answer]:
            n = rng.randint(1, MAX_OBJECTS)
            if with_color:
                attrs = self.attrs(rng, 1, colors=(color,)) + self.attrs(rng, n - 1)
                rng.shuffle(attrs)
            else:
                attrs = self.attrs(rng, n, colors=others)
            scenes.append(self.layout(rng, attrs))
        return scenes, _multi_color_question(color), answer


def scene_questions(qtype: str, scenes: list[Scene], image_size: int = 64) -> list[tuple[str, str]]:
    """Every (question, answer) of type ``qtype`` that has one right answer for these scenes.

    What the extra turns of a multi-question sample are drawn from: single-image types look at
    ``scenes[0]``, multi-image types compare ``scenes[0]`` and ``scenes[1]``; position questions need
    the two objects' centres :func:`position_margin` apart in x.
    """
    scene, margin = scenes[0], position_margin(image_size)
    shapes, colors = Counter(o[0] for o in scene), Counter(o[1] for o in scene)
    if qtype == "color":
        return [(QUESTION["color"].format(shape=o[0]), o[1]) for o in scene if shapes[o[0]] == 1]
    if qtype == "shape":
        return [(QUESTION["shape"].format(color=o[1]), o[0]) for o in scene if colors[o[1]] == 1]
    if qtype == "count":
        return [(QUESTION["count_all"], str(len(scene)))] + [
            (QUESTION["count"].format(shapes=PLURALS[shape]), str(n)) for shape, n in sorted(shapes.items())]
    if qtype == "position":
        unique = [o for o in scene if shapes[o[0]] == 1]
        return [(QUESTION["position"].format(a=a[0], b=b[0]), where_answer(a[0], "left" if a[2] < b[2] else "right"))
                for a in unique for b in unique if abs(a[2] - b[2]) >= margin]
    if qtype == "side":
        return [(QUESTION["side"].format(a=o[0]), where_answer(o[0], half(o, image_size)))
                for o in scene if shapes[o[0]] == 1]
    if qtype == "multi_count":
        c1, c2 = (Counter(o[0] for o in s) for s in scenes)
        return [(QUESTION["multi_count"].format(shapes=PLURALS[shape]), "first" if c1[shape] > c2[shape] else "second")
                for shape in SHAPES if c1[shape] != c2[shape]]
    if qtype == "multi_color":
        answers = {(True, False): "first", (False, True): "second", (True, True): "both", (False, False): "neither"}
        return [(_multi_color_question(color),
                 answers[tuple(any(o[1] == color for o in s) for s in scenes)])
                for color in COLORS]
    raise ValueError(f"unknown qtype {qtype!r}; expected one of {list(QTYPES)}")
