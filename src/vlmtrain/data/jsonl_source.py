"""data.source: jsonl — one the_cauldron-schema JSONL file (image paths relative to the file)."""

from __future__ import annotations

import logging
import os
from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)


def existing_file(path: str, key: str) -> str:
    """``path`` if it is a file; else a ConfigError naming the config key and the path."""
    if not os.path.isfile(path):
        what = "is a directory, not a JSONL file" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"{key}: {path!r} {what} ({os.path.abspath(path)}).")
    return path


def eval_set(cfg: Any) -> Any:
    """data.eval_file read as a list of samples (images stay paths), or None."""
    from vlmtrain.data.cauldron import read_cauldron_jsonl

    if not cfg.data.eval_file:
        return None
    return read_cauldron_jsonl(existing_file(cfg.data.eval_file, "data.eval_file"), load_images=False)


def build(cfg: Any) -> dict[str, Any]:
    from vlmtrain.data.cauldron import read_cauldron_jsonl
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
    # Images stay paths: the processor opens them, skipping (and counting) missing or corrupt ones.
    train = read_cauldron_jsonl(d.train_file, load_images=False)
    kept = [s for s, reason in (apply_filters(filters, s) for s in train) if reason is None]
    if len(kept) < len(train):
        logger.warning("data filters dropped %d of %d training samples", len(train) - len(kept), len(train))
    return {"train_dataset": kept, "eval_dataset": eval_set(cfg)}


def check(cfg: Any) -> None:
    if not cfg.data.train_file:
        raise ConfigError("data.source='jsonl' needs data.train_file (a the_cauldron-schema JSONL file).")


SOURCE = DataSource("jsonl", kinds=("vlm", "hub_vlm", "causal_lm"), build=build, check=check)
