"""data.source: stream — data.sources (jsonl / wds / hf / shapes) read as one resumable stream."""

from __future__ import annotations

from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError

STREAM_KINDS = ("jsonl", "wds", "hf", "shapes")


def build(cfg: Any) -> dict[str, Any]:
    from vlmtrain.data.jsonl_source import eval_set
    from vlmtrain.data.streams import build_stream, config_filters

    d = cfg.data
    try:
        filters = config_filters(d.min_ratings, d.filter)
        return {"train_dataset": build_stream(d.sources or [], seed=d.seed, filters=filters),
                "eval_dataset": eval_set(cfg)}
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check(cfg: Any) -> None:
    d = cfg.data
    if not d.sources:
        raise ConfigError("data.source='stream' needs data.sources, e.g. [{kind: wds, path: 'shards/{000..009}.tar'}].")
    for i, spec in enumerate(d.sources):
        if not isinstance(spec, dict) or spec.get("kind") not in STREAM_KINDS:
            raise ConfigError(f"data.sources[{i}] needs kind: one of {list(STREAM_KINDS)}, got {spec!r}.")


SOURCE = DataSource("stream", kinds=("vlm", "hub_vlm", "causal_lm"), build=build, check=check, pairs=True)
