"""The moving_shapes synthetic video task: pure items, balanced answers, disjoint splits, answers that need more
than one frame (the last frame says nothing about the motion's direction; it shows both colours of a first_color
clip), its baselines and its config keys."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import yaml

from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.tasks.moving_shapes import ANSWERS, DIRECTIONS, BlankVideos, MovingShapes, StillVideos, _motion


def _pixels(sample: dict) -> list[np.ndarray]:
    return [np.asarray(f) for f in sample["videos"][0]]


def test_items_are_pure_balanced_and_splits_share_no_clip():
    train, again = MovingShapes("train", 64, seed=3), MovingShapes("train", 64, seed=3)
    for i in (0, 7, 63):
        assert train[i]["texts"] == again[i]["texts"] and train[i]["clip"] == again[i]["clip"]
        assert all(np.array_equal(a, b) for a, b in zip(_pixels(train[i]), _pixels(again[i])))
    samples = [train[i] for i in range(64)]
    assert all(len(s["videos"]) == 1 and len(s["videos"][0]) == 4 and s["videos"][0][0].size == (64, 64)
               for s in samples)
    for q in ANSWERS:
        counts = Counter(s["texts"][0]["assistant"] for s in samples if s["qtype"] == q)
        assert set(counts) == set(ANSWERS[q]) and len(set(counts.values())) == 1, (q, counts)
    val = {repr(MovingShapes("val", 100, seed=s)[i]["clip"]) for s in (0, 3) for i in range(100)}
    assert not val & {repr(MovingShapes("train", 200, seed=3)[i]["clip"]) for i in range(200)}


def test_the_last_frame_does_not_tell_the_motion_and_shows_both_colours():
    for seed in range(50):  # the same draws for every direction: the same last position, other first ones
        paths = [_motion(random.Random(seed), d, 4, 64)[0][2] for d in ANSWERS["motion"]]
        assert len({p[-1] for p in paths}) == 1 and len({p[0] for p in paths}) == 4
        assert all(0 <= v <= 64 - 64 // 3 for p in paths for xy in p for v in xy)  # always whole in the frame
    ds = MovingShapes("train", 8, qtypes=["motion"])
    for i in range(len(ds)):
        (_, _, path, _), = ds[i]["clip"]
        dx, dy = DIRECTIONS[ds[i]["texts"][0]["assistant"]]
        assert (path[-1][0] - path[0][0]) * dx > 0 or (path[-1][1] - path[0][1]) * dy > 0
    colors = MovingShapes("train", 40, qtypes=["first_color"])
    for i in range(len(colors)):
        first, second = colors[i]["clip"]
        assert first[1] == colors[i]["texts"][0]["assistant"] != second[1]
        assert first[2][0] is not None and second[2][0] is None and second[2][-1] is not None


def test_blank_and_still_baselines_keep_questions_and_frame_count():
    ds = MovingShapes("val", 4)
    for wrap in (BlankVideos, StillVideos):
        for i in range(4):
            sample = wrap(ds)[i]
            assert sample["texts"] == ds[i]["texts"] and len(sample["videos"][0]) == 4
    blank, still = _pixels(BlankVideos(ds)[0]), _pixels(StillVideos(ds)[0])
    assert len({f.tobytes() for f in blank}) == 1 and len(np.unique(blank[0].reshape(-1, 3), axis=0)) == 1
    assert all(np.array_equal(f, _pixels(ds[0])[-1]) for f in still)


def test_options_are_checked(tmp_path):
    cfg = {"model": {"kind": "hub_vlm", "pretrained": "x"}, "data": {"source": "moving_shapes"},
           "train": {"output_dir": str(tmp_path)}}
    path = tmp_path / "c.yaml"
    for data, match in (({"clip_frames": 1}, "data.clip_frames"), ({"clip_qtypes": ["colour"]}, "data.clip_qtypes")):
        path.write_text(yaml.safe_dump({**cfg, "data": {**cfg["data"], **data}}))
        with pytest.raises(ConfigError, match=match):
            load_run_config(str(path))
