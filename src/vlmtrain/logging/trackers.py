"""The trackers report_to can name: a new tracker is one module with a TrackerCallback and one line here."""

from __future__ import annotations

import warnings
from typing import Any

from .mlflow import MLflowCallback
from .tensorboard import TensorBoardCallback
from .tracker import TrackerCallback
from .trackio import TrackioCallback
from .wandb import WandbCallback

TRACKERS: dict[str, type[TrackerCallback]] = {
    "tensorboard": TensorBoardCallback,
    "wandb": WandbCallback,
    "mlflow": MLflowCallback,
    "trackio": TrackioCallback,
}


def tracker_callbacks(args: Any) -> list[TrackerCallback]:
    """The trackers args.report_to asks for (`all`: every installed one). A named tracker that is not
    installed is a warning with the pip command; training goes on with the others."""
    report_to = list(args.report_to)
    names = [n for n in TRACKERS if n in report_to or "all" in report_to]
    trackers = []
    for name in names:
        cls = TRACKERS[name]
        if cls.available():
            trackers.append(cls.from_args(args))
        elif name in report_to:
            warnings.warn(f"report_to includes '{name}' but {cls.requires} is not installed: {cls.install_hint()}. "
                          f"Training goes on without {name} (metrics.jsonl is always written).", stacklevel=2)
    return trackers
