"""Data sources by name (`data.source`): one module per source, defining SOURCE; one registry line each.

Source modules stay light at import (options dataclasses and functions that import the heavy parts when
called), because the config reads their options before anything is built.

data/ lists its own general sources here and names no task: a higher layer registers its sources at import
(the synthetic tasks do in ``vlmtrain/tasks/__init__.py``, which ``vlmtrain/__init__.py`` imports), and so do
the synthetic kinds of a ``data.sources`` stream and of ``vlmtrain data`` commands.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# data.source -> module that defines SOURCE: the registered ones (register_source), then data's own
_GENERAL_SOURCES = {
    "jsonl": "vlmtrain.data.jsonl_source",
    "stream": "vlmtrain.data.stream_source",
}
SOURCES: dict[str, str] = dict(_GENERAL_SOURCES)

StreamKind = Callable[[dict[str, Any], int], Any]
STREAM_KINDS: dict[str, StreamKind] = {}
"""A ``data.sources`` entry's ``kind`` beyond data's own (jsonl, wds, hf) -> make(entry, seed) -> a source of
raw samples (e.g. an IndexedSource); filled by register_stream_kind."""
COMMAND_LINE_SOURCES: dict[str, Callable[[str], Any]] = {}
"""A prefix of a ``vlmtrain data`` SRC (e.g. ``shapes`` for ``shapes[:N]``, checked before paths) -> open(SRC)
-> a source of raw samples; filled by register_command_line_source."""


def register_source(name: str, module: str) -> None:
    """Make ``module`` (it defines SOURCE and stays light at import) the data source ``data.source=name``.
    Registered sources are listed before data's own general ones (jsonl, stream): that order is the order of
    the `data.source` choices and of the sources' options among DataConfig's keys."""
    for general in _GENERAL_SOURCES:
        del SOURCES[general]
    SOURCES[name] = module
    SOURCES.update(_GENERAL_SOURCES)


def register_stream_kind(kind: str, make: StreamKind) -> None:
    """Let a ``data.sources`` entry name ``kind``: ``make(entry, seed)`` opens it."""
    STREAM_KINDS[kind] = make


def register_command_line_source(prefix: str, open_source: Callable[[str], Any]) -> None:
    """Let a ``vlmtrain data`` SRC that starts with ``prefix`` be opened by ``open_source(SRC)``."""
    COMMAND_LINE_SOURCES[prefix] = open_source


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
    pairs: bool = False
    """Whether its samples may be preference pairs (raw samples, for `train.objective: dpo`)."""
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
