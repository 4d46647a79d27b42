"""From the config's data section to a StreamingDataset: sources by kind, quality filters, custom hooks."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from vlmtrain.data.registry import STREAM_KINDS
from vlmtrain.data.sources import JsonlSource, StreamingDataset, WebDatasetSource

logger = logging.getLogger(__name__)
Filter = Callable[[dict[str, Any]], Any]


def min_ratings_filter(minimums: dict[str, float]) -> Filter:
    """Keep the_cauldron turns (or samples) whose ratings reach ``minimums`` (e.g. ``{"relevance": 3}``).

    A per-turn list ``<name>_ratings`` (one number per entry of ``texts``) trims the turns below the minimum;
    a scalar ``<name>_rating`` / ``<name>_ratings`` judges the whole sample. A sample without the field
    passes. Returns False (drop) when no turn is left, else the sample (trimmed if needed).
    """
    def min_ratings(sample: dict[str, Any]) -> Any:
        texts = sample.get("texts")
        keep = list(range(len(texts))) if isinstance(texts, list) else None
        for name, low in minimums.items():
            value = sample.get(f"{name}_ratings", sample.get(f"{name}_rating"))
            if value is None:
                continue
            if isinstance(value, (list, tuple)) and keep is not None:
                keep = [i for i in keep if i < len(value) and value[i] is not None and value[i] >= low]
            elif not isinstance(value, (list, tuple)) and value < low:
                return False
        if keep is None or len(keep) == len(texts):
            return True
        if not keep:
            return False
        trimmed = {k: v for k, v in sample.items() if not (k.endswith("_ratings") and isinstance(v, list))}
        trimmed["texts"] = [texts[i] for i in keep]
        return trimmed

    return min_ratings


def load_filter(spec: str) -> Filter:
    """The function named by ``package.module:function``; an error names what was not found."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"data.filter={spec!r}: cannot load it ({err})") from err
    if not callable(fn):
        raise ValueError(f"data.filter={spec!r} is not callable")
    return fn


def config_filters(min_ratings: dict[str, float] | None, custom: str | None) -> list[Filter]:
    filters: list[Filter] = []
    if min_ratings:
        filters.append(min_ratings_filter(min_ratings))
    if custom:
        filters.append(load_filter(custom))
    return filters


def make_source(spec: dict[str, Any], seed: int = 0) -> Any:
    """One source from a ``data.sources`` entry."""
    kind = spec["kind"]
    if kind == "jsonl":
        return JsonlSource(spec["path"], name=spec.get("name", "jsonl"))
    if kind == "wds":
        return WebDatasetSource(spec["path"], name=spec.get("name", "wds"))
    if kind == "hf":
        from vlmtrain.data.hf import hf_source

        return hf_source(spec)
    if kind in STREAM_KINDS:  # a higher layer's (e.g. the synthetic shapes task)
        return STREAM_KINDS[kind](spec, seed)
    raise ValueError(f"unknown source kind {kind!r}")


def build_stream(specs: Sequence[dict[str, Any]], seed: int = 0, filters: Sequence[Filter] = ()) -> StreamingDataset:
    """The training stream of ``data.sources``: sources that fail to load are logged and left out."""
    sources, weights, failures = [], [], []
    for i, spec in enumerate(specs):
        try:
            source = make_source(spec, seed)
            if not source.shards or (isinstance(source, JsonlSource) and not _any_record(source)):
                raise ValueError("it has no data")
        except Exception as err:  # noqa: BLE001 - any failure to open one source is reported, not fatal
            failures.append(f"data.sources[{i}] ({spec.get('kind')} {spec.get('path') or spec.get('name') or ''}): "
                            f"{type(err).__name__}: {err}")
            logger.error("skipping %s", failures[-1])
            continue
        sources.append(source)
        weights.append(float(spec.get("weight", 1.0)))
    if not sources:
        raise ValueError("no data source could be loaded:\n  " + "\n  ".join(failures))
    return StreamingDataset(sources, weights=weights, seed=seed, filters=filters)


def _any_record(source: JsonlSource) -> bool:
    """Whether any file of a JSONL source has a record (a non-blank line): an empty file is no data."""
    for path in source.shards:
        with open(path, "rb") as f:
            if any(line.strip() for line in f):
                return True
    return False
