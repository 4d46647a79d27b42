"""`vlmtrain sync RUN_DIR --to TRACKER`: replay a run's metrics.jsonl into a tracker after the fact (a run
trained without it, offline, or whose tracker failed)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

from ..errors import ConfigError
from .tracker import numeric_metrics, row_step
from .trackers import TRACKERS

_NON_FINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}  # how metrics.jsonl writes them


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    """metrics.jsonl's complete rows, non-finite values back as floats."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path} does not exist: sync needs a run directory (train.output_dir) with metrics.jsonl.")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            rows.append({k: _NON_FINITE.get(v, v) if isinstance(v, str) else v for k, v in row.items()})
    return rows


def _train_config(run_dir: str) -> dict[str, Any]:
    """The run's resolved `train` section (config.yaml), or {} for a run without one."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return {}
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    return config.get("train") or {}


def sync_run(run_dir: str, to: str, project: str | None = None, run_name: str | None = None) -> tuple[str, int]:
    """Send every row of run_dir/metrics.jsonl, at its step, to a new run of tracker `to`. The project and run
    name default to the run's config.yaml (train.project, train.run_name), else huggingface and run_dir's
    name. Returns (tracker run id, rows sent)."""
    if to not in TRACKERS:
        raise ConfigError(f"--to {to!r} is not a tracker; choose one of {', '.join(TRACKERS)}.")
    cls = TRACKERS[to]
    if not cls.available():
        raise ConfigError(f"{cls.requires} is not installed: {cls.install_hint()}.")
    rows, train = read_rows(run_dir), _train_config(run_dir)
    args = SimpleNamespace(  # what from_args reads of TrainingArguments
        output_dir=run_dir, run_name=run_name or train.get("run_name") or os.path.basename(os.path.normpath(run_dir)),
        project=project or train.get("project") or "huggingface", trackio_space_id=train.get("trackio_space_id"),
        trackio_bucket_id=train.get("trackio_bucket_id"), to_dict=lambda: train)
    tracker = cls.from_args(args)
    run_id = tracker.start(None)
    tracker.run_id = run_id
    for row in rows:
        metrics = numeric_metrics(row)
        if metrics:
            tracker.write(row_step(row, 0), metrics)
    tracker.finish()
    return run_id, len(rows)
