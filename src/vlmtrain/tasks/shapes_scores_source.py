"""data.source: shapes_scores (the dataset: :mod:`vlmtrain.tasks.shapes_scores`): its `data.*` option and the
training and held-out sets. Light at import, as every source module (the config reads the sources' options before
anything is built)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmtrain.data.registry import DataSource


@dataclass
class ShapesScoresOptions:
    """The shapes_scores task's own `data.*` keys."""

    blank_images: bool = False
    """(shapes_scores) Replace every image (train and eval) by an empty one of the same size, labels unchanged:
    the baseline that shows what the question text alone predicts."""


def build(cfg: Any) -> dict[str, Any]:
    """A training set and one held-out set (val split); both with blank images when data.blank_images."""
    from vlmtrain.tasks.shapes import BlankImages
    from vlmtrain.tasks.shapes_scores import COLOR_NAMES, ShapesScores, _color_names

    d = cfg.data
    if COLOR_NAMES != _color_names():
        raise RuntimeError(f"shapes_scores.COLOR_NAMES {COLOR_NAMES} is out of step with shapes.COLORS")
    train, evaluation = ShapesScores("train", d.num_train, seed=d.seed), ShapesScores("val", d.num_eval, seed=d.seed)
    if d.blank_images:
        train, evaluation = BlankImages(train), BlankImages(evaluation)
    return {"train_dataset": train, "eval_dataset": evaluation}


SOURCE = DataSource("shapes_scores", kinds=("hub_vlm",), build=build, options=ShapesScoresOptions)
