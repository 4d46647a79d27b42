"""data.source: jsonl — one the_cauldron-schema JSONL file (image paths relative to the file)."""

from __future__ import annotations

import logging
from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)


def eval_set(cfg: Any) -> Any:
    """data.eval_file read as a list of samples (images stay paths), or None."""
    from vlmtrain.data.cauldron import read_cauldron_jsonl

    return read_cauldron_jsonl(cfg.data.eval_file, load_images=False) if cfg.data.eval_file else None


def build(cfg: Any) -> dict[str, Any]:
    from vlmtrain.data.cauldron import read_cauldron_jsonl
    from vlmtrain.data.sources import apply_filters
    from vlmtrain.data.streams import config_filters

    d = cfg.data
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
