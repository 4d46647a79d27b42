"""data.source: jsonl — one the_cauldron-schema JSONL file (image paths relative to the file)."""

from __future__ import annotations

import logging
import os
from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)


def read_records(path: str, key: str) -> list[dict[str, Any]]:
    """Every record of the JSONL file ``path`` (the setting ``key`` names it), as the stream source reads it: named
    ``file:line`` (``__key__``, the name bad-sample messages give), image paths absolute, images left as paths
    (the processor opens them, skipping and counting a missing or corrupt one). A line that is not a JSON object
    stays in as a bad record, skipped and counted (``malformed_json``) where the batch is made. A file without any
    record is a ConfigError naming ``key`` and the path."""
    from vlmtrain.data.sources import JsonlSource

    source = JsonlSource(path)
    records = [sample for shard in range(len(source.shards)) for _, sample in source.read(shard, {})]
    if not records:
        raise ConfigError(f"{key}={path!r} holds no samples (the file has no record, only blank lines or none): "
                          f"point {key} at a JSONL file with one the_cauldron record per line.")
    return records


def existing_file(path: str, key: str) -> str:
    """``path`` if it is a file; else a ConfigError naming the config key and the path."""
    if not os.path.isfile(path):
        what = "is a directory, not a JSONL file" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"{key}: {path!r} {what} ({os.path.abspath(path)}).")
    return path


def eval_set(cfg: Any) -> Any:
    """data.eval_file read as a list of samples (images stay paths), or None."""
    if not cfg.data.eval_file:
        return None
    return read_records(existing_file(cfg.data.eval_file, "data.eval_file"), "data.eval_file")


def build(cfg: Any) -> dict[str, Any]:
    from vlmtrain.data.sources import apply_filters
    from vlmtrain.data.streams import config_filters

    d = cfg.data
    existing_file(d.train_file, "data.train_file")
    if d.eval_file:  # (before the training file is read: a typo in either fails at once)
        existing_file(d.eval_file, "data.eval_file")
    try:
        filters = config_filters(d.min_ratings, d.filter)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    train = read_records(d.train_file, "data.train_file")
    # Unreadable records stay (and are counted where the batch is made); filters judge readable ones only.
    kept = [s for s, reason in (apply_filters(filters, s) if not s.get("__bad__") else (s, None) for s in train)
            if reason is None]
    if not kept:
        raise ConfigError(f"data.filter / data.min_ratings dropped all {len(train)} samples of "
                          f"data.train_file={d.train_file!r}: loosen them or check the file.")
    if len(kept) < len(train):
        logger.warning("data filters dropped %d of %d training samples", len(train) - len(kept), len(train))
    return {"train_dataset": kept, "eval_dataset": eval_set(cfg)}


def check(cfg: Any) -> None:
    if not cfg.data.train_file:
        raise ConfigError("data.source='jsonl' needs data.train_file (a the_cauldron-schema JSONL file).")


SOURCE = DataSource("jsonl", kinds=("vlm", "hub_vlm", "causal_lm"), build=build, check=check, pairs=True)
