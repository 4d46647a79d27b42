"""Fast tests for the synthetic shapes-VQA source: determinism, disjoint splits, correct answers, JSONL."""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from collections import Counter

import pytest

from vlmtrain.data.cauldron import read_cauldron_jsonl, write_cauldron_jsonl
from vlmtrain.tasks.shapes import (
    ANSWERS,
    COLORS,
    DEFAULT_QTYPES,
    MULTI_IMAGE_QTYPES,
    PLURALS,
    QTYPES,
    SHAPES,
    SINGLE_IMAGE_QTYPES,
    ShapesVQA,
    answer_word,
    is_multi_image,
    render_scene,
)

SINGULAR = {v: k for k, v in PLURALS.items()}


@pytest.fixture(scope="module")
def train_items() -> list[dict]:
    ds = ShapesVQA("train", num_samples=2000, seed=0)
    return [ds[i] for i in range(len(ds))]


def _image_hashes(items: list[dict]) -> set[str]:
    return {hashlib.sha256(img.tobytes()).hexdigest() for it in items for img in it["images"]}


def _oracle(qtype: str, question: str, scenes: list[list[tuple]]) -> str:
    """Re-derive the answer from the scene metadata, independently of the generator."""
    if qtype == "color":
        shape = re.fullmatch(r"What color is the (\w+)\?", question)[1]
        (obj,) = [o for o in scenes[0] if o[0] == shape]  # must be unique
        return obj[1]
    if qtype == "shape":
        color = re.fullmatch(r"What shape is the (\w+) object\?", question)[1]
        (obj,) = [o for o in scenes[0] if o[1] == color]
        return obj[0]
    if qtype == "count":
        m = re.fullmatch(r"How many (\w+) are there\?", question)
        if m[1] == "shapes":
            return str(len(scenes[0]))
        return str(sum(o[0] == SINGULAR[m[1]] for o in scenes[0]))
    if qtype == "position":
        m = re.fullmatch(r"Relative to the (\w+), is the (\w+) left or right\?", question)
        (a,) = [o for o in scenes[0] if o[0] == m[2]]  # each named shape must be unique in the scene
        (b,) = [o for o in scenes[0] if o[0] == m[1]]
        assert abs(a[2] - b[2]) >= 64 / 6, "position pairs must be clearly separated"
        return f"{m[2]} " + ("left" if a[2] < b[2] else "right")  # the named object, then its side
    if qtype == "side":
        (a,) = [o for o in scenes[0] if o[0] == re.fullmatch(r"Is the (\w+) left or right\?", question)[1]]
        assert a[2] < 32 - 4 or a[2] > 32 + 4, "objects never straddle the middle"
        return f"{a[0]} " + ("left" if a[2] < 32 else "right")
    if qtype == "multi_count":
        shape = SINGULAR[re.fullmatch(r"Which image has more (\w+)\?", question)[1]]
        c1, c2 = (sum(o[0] == shape for o in s) for s in scenes)
        assert c1 != c2
        return "first" if c1 > c2 else "second"
    if qtype == "multi_color":
        color = re.fullmatch(r"Which image has an? (\w+) shape\?", question)[1]
        h1, h2 = (any(o[1] == color for o in s) for s in scenes)
        return {(True, False): "first", (False, True): "second", (True, True): "both"}.get((h1, h2), "neither")
    raise AssertionError(qtype)


def test_schema_and_answers_are_correct(train_items: list[dict]) -> None:
    for it in train_items:
        assert set(it) == {"images", "texts", "qtype", "turn_qtypes", "id", "scene"}
        assert it["turn_qtypes"] == [it["qtype"]]
        assert len(it["images"]) == len(it["scene"]) == (2 if is_multi_image(it["qtype"]) else 1)
        assert all(img.mode == "RGB" and img.size == (64, 64) for img in it["images"])
        (turn,) = it["texts"]
        assert answer_word(it["qtype"], turn["assistant"]) in ANSWERS[it["qtype"]]
        assert _oracle(it["qtype"], turn["user"], it["scene"]) == turn["assistant"], it["id"]


def test_scenes_are_valid_and_match_pixels(train_items: list[dict]) -> None:
    for it in train_items[:300]:
        for scene, img in zip(it["scene"], it["images"]):
            assert 1 <= len(scene) <= 4
            cells = set()
            for shape, color, x, y, size in scene:
                assert shape in SHAPES and color in COLORS and 12 <= size <= 14
                # Each object lies inside one 16px cell of the 4x4 grid, one object per cell: no overlap.
                cell = (x // 16, y // 16)
                assert cell not in cells
                cells.add(cell)
                for centre, start in ((x, cell[0] * 16), (y, cell[1] * 16)):
                    assert start < centre - size / 2 and centre + size / 2 < start + 16
                # The centre of every shape is filled with its colour.
                assert max(abs(a - b) for a, b in zip(img.getpixel((x, y)), COLORS[color])) <= 30


def test_deterministic_by_seed_and_index() -> None:
    a, b = ShapesVQA("train", 50, seed=3), ShapesVQA("train", 50, seed=3)
    c = ShapesVQA("train", 50, seed=4)
    clone = pickle.loads(pickle.dumps(a))  # what a DataLoader worker gets
    for i in [0, 7, 49, 7]:
        x, y, z = a[i], b[i], clone[i]
        assert x["texts"] == y["texts"] == z["texts"] and x["scene"] == y["scene"] == z["scene"]
        assert [im.tobytes() for im in x["images"]] == [im.tobytes() for im in y["images"]]
        assert [im.tobytes() for im in x["images"]] == [im.tobytes() for im in z["images"]]
    assert a[-1]["id"] == "train-49"
    differ = sum(a[i]["images"][0].tobytes() != c[i]["images"][0].tobytes() for i in range(50))
    assert differ >= 48
    with pytest.raises(IndexError):
        a[50]


def test_splits_never_share_an_image(train_items: list[dict]) -> None:
    train = _image_hashes(train_items)
    test = _image_hashes([ShapesVQA("test", 500, seed=0)[i] for i in range(500)])
    val = _image_hashes([ShapesVQA("val", 300, seed=1)[i] for i in range(300)])  # other seed too
    assert len(test) > 550 and len(val) > 300
    assert not train & test and not train & val and not val & test


def test_qtype_fractions(train_items: list[dict]) -> None:
    counts = Counter(it["qtype"] for it in train_items)
    assert set(counts) == set(DEFAULT_QTYPES)  # side questions only when asked for
    n = len(train_items)
    multi = sum(counts[q] for q in MULTI_IMAGE_QTYPES) / n
    assert 0.21 < multi < 0.29
    for q in DEFAULT_QTYPES:
        expected = 0.25 / 2 if is_multi_image(q) else 0.75 / 4
        assert abs(counts[q] / n - expected) < 0.04, (q, counts[q])
    only = ShapesVQA("val", 100, qtypes=["position", "multi_color"], multi_image_fraction=0.5)
    assert {only[i]["qtype"] for i in range(100)} == {"position", "multi_color"}
    assert {ShapesVQA(qtypes=["count"], multi_image_fraction=1.0)[i]["qtype"] for i in range(20)} == {"count"}
    assert all(len(ShapesVQA(multi_image_fraction=0.0)[i]["images"]) == 1 for i in range(50))


def test_answer_balance(train_items: list[dict]) -> None:
    side = ShapesVQA("train", 300, seed=0, qtypes=["side"])
    items = train_items + [side[i] for i in range(len(side))]
    for qtype in QTYPES:
        answers = Counter(answer_word(qtype, it["texts"][0]["assistant"]) for it in items if it["qtype"] == qtype)
        total = sum(answers.values())
        assert set(answers) == set(ANSWERS[qtype]), qtype
        uniform = 1 / len(ANSWERS[qtype])
        for answer, count in answers.items():
            assert abs(count / total - uniform) < 0.5 * uniform, (qtype, answer, count, total)


def test_multi_question_samples() -> None:
    """Extra turns ask other questions about the same image(s); every answer is right; the first turn, the
    images and the scene are those of the one-question sample with the same index."""
    one = ShapesVQA("train", 300, seed=2, multi_image_fraction=0.3)
    many = ShapesVQA("train", 300, seed=2, multi_image_fraction=0.3, questions_per_sample=4)
    turn_types = Counter()
    for i in range(len(many)):
        a, b = one[i], many[i]
        assert b["texts"][0] == a["texts"][0] and b["scene"] == a["scene"] and b["qtype"] == a["qtype"]
        assert len(b["texts"]) == len(b["turn_qtypes"]) and 2 <= len(b["texts"]) <= 4
        assert len({t["user"] for t in b["texts"]}) == len(b["texts"])  # no question twice
        for qtype, turn in zip(b["turn_qtypes"], b["texts"]):
            assert is_multi_image(qtype) == is_multi_image(b["qtype"])
            assert _oracle(qtype, turn["user"], b["scene"]) == turn["assistant"], (b["id"], turn)
        turn_types.update(b["turn_qtypes"][1:])
    assert set(turn_types) == set(DEFAULT_QTYPES)  # every type shows up as an extra turn


def test_side_questions_and_their_warmup() -> None:
    """Side questions are right and balanced; side_fraction of the position questions become side questions
    (all of them during the warm-up, which follows get_item_at_step's step), and extra turns ask them too."""
    side = ShapesVQA("val", 300, seed=1, qtypes=["side"])
    lone = 0
    for it in (side[i] for i in range(len(side))):
        assert it["qtype"] == "side" and len(it["images"]) == 1
        assert _oracle("side", it["texts"][0]["user"], it["scene"]) == it["texts"][0]["assistant"], it["id"]
        lone += len(it["scene"][0]) == 1
    assert 0.4 < lone / len(side) < 0.6  # half of them ask about a lone object

    ds = ShapesVQA("train", 800, seed=3, multi_image_fraction=0.0, side_fraction=0.25, side_warmup_steps=10,
                   questions_per_sample=3)
    plain = ShapesVQA("train", 800, seed=3, multi_image_fraction=0.0, questions_per_sample=3)

    def first_types(step: int) -> Counter:
        return Counter(ds.get_item_at_step(i, step)["qtype"] for i in range(len(ds)))

    assert ds.follows_step and not plain.follows_step
    warm = first_types(0)
    assert warm["position"] == 0 and 0.2 < warm["side"] / len(ds) < 0.3
    assert first_types(9) == warm  # still warming up
    assert Counter(ds[i]["qtype"] for i in range(len(ds))) == warm  # ds[i]: the item at step 0
    after, extra = first_types(10), Counter()
    assert 0.25 * 0.15 < after["side"] / len(ds) < 0.25 * 0.35
    assert abs(after["side"] + after["position"] - warm["side"]) < 0.05 * len(ds)
    for i in range(len(ds)):
        it = ds.get_item_at_step(i, 10)
        if it["qtype"] not in ("side", "position"):  # the same draw as without side questions
            assert it["texts"][0] == plain[i]["texts"][0] and it["scene"] == plain[i]["scene"]
        for qtype, turn in zip(it["turn_qtypes"], it["texts"]):
            assert _oracle(qtype, turn["user"], it["scene"]) == turn["assistant"], (it["id"], turn)
        extra.update(it["turn_qtypes"][1:])
    assert extra["side"] > 0.05 * len(ds)
    with pytest.raises(ValueError, match="side_fraction"):
        ShapesVQA(side_fraction=1.5)


def test_lookup_warmup_asks_only_lookups_about_several_objects() -> None:
    """During lookup_warmup_steps only look-up types are asked (no count), colour and shape ones about 2-4 objects
    (answers stay right); after it the items are exactly those of a dataset without the warm-up."""
    kw = dict(multi_image_fraction=0.4, questions_per_sample=3, side_fraction=0.25, side_warmup_steps=20)
    ds = ShapesVQA("train", 600, seed=2, lookup_warmup_steps=10, **kw)
    plain = ShapesVQA("train", 600, seed=2, **kw)
    assert ds.follows_step and ShapesVQA("train", 4, lookup_warmup_steps=1).follows_step
    turns, sizes = Counter(), Counter()
    for i in range(len(ds)):
        it = ds.get_item_at_step(i, 9)
        turns.update(it["turn_qtypes"])
        if it["qtype"] in ("color", "shape"):
            sizes[len(it["scene"][0])] += 1
        for qtype, turn in zip(it["turn_qtypes"], it["texts"]):
            assert _oracle(qtype, turn["user"], it["scene"]) == turn["assistant"], (it["id"], turn)
    assert set(turns) <= {"color", "shape", "side", "position", "multi_color", "multi_count"}  # no count
    assert min(turns[q] for q in ("color", "shape", "side", "multi_color", "multi_count")) > 0.1 * len(ds)
    assert min(sizes) == 2 and sum(sizes.values()) > 0.3 * len(ds)
    assert all(ds.get_item_at_step(i, 10)["texts"] == plain.get_item_at_step(i, 10)["texts"] for i in range(100))
    assert Counter(q for i in range(len(ds)) for q in ds.get_item_at_step(i, 10)["turn_qtypes"])["count"] > 0
    with pytest.raises(ValueError, match="warm-up steps"):
        ShapesVQA(lookup_warmup_steps=-1)


def test_qtype_weights_shift_the_mix_and_keep_answers_right() -> None:
    """qtype_weights draws first and extra turns' types by weight within their group; answers stay right, the
    images of single-image items are untouched, and weights of 1 give exactly the unweighted items."""
    kw = dict(multi_image_fraction=0.5, questions_per_sample=3)
    plain = ShapesVQA("train", 800, seed=4, **kw)
    heavy = ShapesVQA("train", 800, seed=4, qtype_weights={"multi_count": 3.0}, **kw)
    first, turns = {"plain": Counter(), "heavy": Counter()}, {"plain": Counter(), "heavy": Counter()}
    for i in range(len(plain)):
        for name, it in (("plain", plain[i]), ("heavy", heavy[i])):
            first[name][it["qtype"]] += 1
            turns[name].update(it["turn_qtypes"])
            for qtype, turn in zip(it["turn_qtypes"], it["texts"]):
                assert _oracle(qtype, turn["user"], it["scene"]) == turn["assistant"], (it["id"], turn)
    share = {n: c["multi_count"] / (c["multi_count"] + c["multi_color"]) for n, c in first.items()}
    assert abs(share["plain"] - 0.5) < 0.07 and abs(share["heavy"] - 0.75) < 0.07, share
    assert turns["heavy"]["multi_count"] > 1.25 * turns["plain"]["multi_count"]
    assert sum(first["heavy"][q] for q in SINGLE_IMAGE_QTYPES) == sum(first["plain"][q] for q in SINGLE_IMAGE_QTYPES)
    ones = ShapesVQA("train", 50, seed=4, qtype_weights={q: 1.0 for q in QTYPES}, **kw)
    assert all(ones[i]["texts"] == plain[i]["texts"] for i in range(50))
    for bad in ({"colour": 2.0}, {"count": 0.0}):
        with pytest.raises(ValueError, match="qtype_weights"):
            ShapesVQA(qtype_weights=bad)


def test_image_size_and_bad_arguments() -> None:
    item = ShapesVQA("test", 5, image_size=96, qtypes=["multi_count"])[0]
    assert [im.size for im in item["images"]] == [(96, 96), (96, 96)]
    assert render_scene([("circle", "red", 32, 32, 16)]).getpixel((32, 32)) == COLORS["red"]
    for kwargs in [{"split": "dev"}, {"qtypes": ["colour"]}, {"qtypes": []}, {"multi_image_fraction": 2.0},
                   {"questions_per_sample": 0}]:
        with pytest.raises(ValueError):
            ShapesVQA(**kwargs)
    with pytest.raises(ValueError):
        is_multi_image("nope")


def test_jsonl_round_trip(tmp_path) -> None:
    ds = ShapesVQA("val", 12, seed=5, multi_image_fraction=0.5)
    path = write_cauldron_jsonl(ds, str(tmp_path / "out"), name="shapes")
    assert path == str(tmp_path / "out" / "shapes.jsonl")
    with open(path) as f:
        raw = f.read()
    assert str(tmp_path) not in raw  # image paths are relative to the JSONL file
    # Moving the whole folder keeps it loadable.
    os.rename(tmp_path / "out", tmp_path / "moved")
    back = read_cauldron_jsonl(str(tmp_path / "moved" / "shapes.jsonl"))
    assert len(back) == len(ds)
    for i, got in enumerate(back):
        want = ds[i]
        assert got["texts"] == want["texts"] and got["qtype"] == want["qtype"] and got["id"] == want["id"]
        assert got["scene"] == want["scene"]
        assert [im.tobytes() for im in got["images"]] == [im.tobytes() for im in want["images"]]
