"""data.source: moving_shapes — synthetic video QA (:mod:`vlmtrain.tasks.moving_shapes`) for a Hub VLM with video
support (Qwen3-VL, Qwen2.5-VL): one eval set per question type, and a demo report beside blank-video and
single-frame (still) baselines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError


@dataclass
class MovingShapesOptions:
    """The moving_shapes task's own `data.*` keys."""

    clip_frames: int = 4
    """(moving_shapes) Frames per synthetic clip (>= 2)."""
    clip_size: int = 64
    """(moving_shapes) Pixels per side of a synthetic clip's frames (>= 16)."""
    clip_qtypes: list[str] | None = None
    """(moving_shapes) Question types asked, among motion and first_color (null: both, half each)."""


def check_options(data: Any) -> None:
    from vlmtrain.tasks.moving_shapes import QTYPES

    if data.clip_frames < 2 or data.clip_size < 16:
        raise ConfigError(f"data.clip_frames must be >= 2 and data.clip_size >= 16, got {data.clip_frames} and "
                          f"{data.clip_size}.")
    bad = [q for q in data.clip_qtypes or () if q not in QTYPES]
    if bad or (data.clip_qtypes is not None and not data.clip_qtypes):
        raise ConfigError(f"data.clip_qtypes must name question types among {list(QTYPES)}, got {data.clip_qtypes}.")


def _dataset(d: Any, split: str, n: int, qtypes: Any = None) -> Any:
    from vlmtrain.tasks.moving_shapes import MovingShapes

    return MovingShapes(split, n, seed=d.seed, qtypes=qtypes or d.clip_qtypes, num_frames=d.clip_frames,
                        frame_size=d.clip_size)


def build(cfg: Any) -> dict[str, Any]:
    """Training clips (both question types, or data.clip_qtypes), and one held-out set (val split) of
    data.num_eval clips per question type (eval_<type>_exact_match)."""
    from vlmtrain.tasks.moving_shapes import QTYPES

    d = cfg.data
    evals = {q: _dataset(d, "val", d.num_eval, [q]) for q in d.clip_qtypes or QTYPES}
    return {"train_dataset": _dataset(d, "train", d.num_train), "eval_dataset": evals}


def summary(metrics: dict[str, Any], prefix: str = "eval") -> dict[str, float]:
    """The mean exact match over the question types evaluated (each set has the same size)."""
    from vlmtrain.tasks.moving_shapes import QTYPES

    values = [metrics[f"{prefix}_{q}_exact_match"] for q in QTYPES if f"{prefix}_{q}_exact_match" in metrics]
    return {f"{prefix}_video_exact_match": sum(values) / len(values)} if values else {}


def chance() -> dict[str, float]:
    from vlmtrain.tasks.moving_shapes import CHANCE

    return {f"{q}_exact_match": p for q, p in CHANCE.items()} | {"video_exact_match": 0.25}


def baselines(trainer: Any) -> dict[str, float]:
    """Exact match on the same held-out clips with blank frames (``blank_*`` keys) and with every frame
    replaced by the clip's last one (``still_*``), with their means over the question types."""
    from vlmtrain.tasks.moving_shapes import BlankVideos, StillVideos

    out: dict[str, float] = {}
    for prefix, wrap in (("blank", BlankVideos), ("still", StillVideos)):
        metrics = trainer.evaluate({q: wrap(ds) for q, ds in trainer.eval_dataset.items()}, metric_key_prefix=prefix)
        out.update(metrics | summary(metrics, prefix))
    return out


def table(metrics: dict[str, Any]) -> str:
    """Held-out exact match per question type and their mean: the model, on blank clips, on stills, chance."""
    from vlmtrain.tasks.moving_shapes import CHANCE, QTYPES, STILL_BEST

    def cell(key: str) -> str:
        return f"{metrics.get(key, float('nan')):>8.3f}"

    rows = [f"  {'held-out exact match':<22}{'model':>8}{'blank':>8}{'still':>8}{'chance':>8}{'still best':>11}"]
    names = [q for q in QTYPES if f"eval_{q}_exact_match" in metrics] + ["video"]
    for q in names:
        best = STILL_BEST.get(q, float("nan"))
        rows.append(f"  {q + (' (mean)' if q == 'video' else ''):<22}{cell(f'eval_{q}_exact_match')}"
                    f"{cell(f'blank_{q}_exact_match')}{cell(f'still_{q}_exact_match')}"
                    f"{CHANCE.get(q, 0.25):>8.3f}{best:>11.3f}")
    return "\n".join(rows)


def demo_report(trainer: Any, metrics: dict[str, Any]) -> str:
    """The table of :func:`table`, after evaluating the blank and still baselines (added to ``metrics``)."""
    if not isinstance(trainer.eval_dataset, dict):
        return ""
    metrics.update(summary(metrics))
    metrics.update(baselines(trainer))
    return table(metrics)


SOURCE = DataSource("moving_shapes", kinds=("hub_vlm",), build=build, options=MovingShapesOptions,
                    check_options=check_options, summary=summary, demo_report=demo_report, chance=chance)
