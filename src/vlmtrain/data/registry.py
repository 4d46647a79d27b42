"""Data sources by name (`data.source`): one module per source, defining SOURCE; one registry line each.

Source modules stay light at import (options dataclasses and functions that import the heavy parts when
called), because the config reads their options before anything is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# data.source -> module that defines SOURCE
SOURCES: dict[str, str] = {
    "addition": "vlmtrain.tasks.addition_source",
    "shapes": "vlmtrain.tasks.shapes_source",
    "shapes_scores": "vlmtrain.tasks.shapes_scores",
    "jsonl": "vlmtrain.data.jsonl_source",
    "stream": "vlmtrain.data.stream_source",
}


@dataclass(frozen=True)
class DataSource:
    """What a data source gives a run. ``build(cfg)`` returns a dict with ``train_dataset`` and
    ``eval_dataset`` (a dataset, a dict of named eval sets, or None) of raw samples; a source whose samples
    come tokenized (e.g. addition) also returns ``tokenizer``, ``data_collator`` and ``compute_metrics``,
    which the model kind then uses instead of its own."""

    name: str
    kinds: tuple[str, ...]
    """The model kinds this source can feed."""
    build: Callable[[Any], dict[str, Any]]
    options: type | None = None
    """A dataclass of this source's own `data.*` keys (merged into DataConfig), or None."""
    check_options: Callable[[Any], None] | None = None
    """check_options(data_config): validate this source's own keys (run on every config)."""
    check: Callable[[Any], None] | None = None
    """check(run_config): cross-section checks before any work (raise ConfigError)."""
    summary: Callable[[dict[str, Any], str], dict[str, float]] | None = None
    """summary(metrics, prefix) -> extra metrics computed from an evaluation's (e.g. group means)."""
    demo_report: Callable[[Any, dict[str, Any]], str] | None = None
    """demo_report(trainer, metrics) -> the text `vlmtrain demo` prints for this source."""
    untrained: Callable[[Any, int], dict[str, str]] | None = None
    """untrained(data_config, step) -> {eval set: why the training data has not asked its kind of question in
    steps 0 to step - 1}: a set at 0 there is by design (e.g. a warm-up curriculum), and the demo says so."""
    chance: Callable[[], dict[str, float]] | None = None
    """chance() -> {metric without its prefix: its value for random answers}, e.g. {'color_exact_match': 1/6}:
    the run report shows it next to the model's scores."""


def get_source(name: str) -> DataSource:
    return importlib.import_module(SOURCES[name]).SOURCE


def all_sources() -> list[DataSource]:
    return [get_source(name) for name in SOURCES]
