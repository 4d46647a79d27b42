"""Evaluation metrics of score heads with no user code (numpy only): accuracy and macro F1 per classification
head, accuracy and mean margin per reward head, MAE, RMSE, Pearson and Spearman per regression head. Samples without a head's label are left out."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .head_config import HeadConfig


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; NaN when either side is constant or there are fewer than 2 values."""
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    if x.size < 2:
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denom) if denom > 0 else float("nan")


def average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given the mean of the ranks they span."""
    _, inverse, counts = np.unique(np.asarray(x).ravel(), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    return ((ends - counts + 1 + ends) / 2.0)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman correlation: Pearson of the (tie-averaged) ranks."""
    return pearson(average_ranks(x), average_ranks(y))


def macro_f1(truth: np.ndarray, pred: np.ndarray) -> float:
    """Mean over the classes present in truth or predictions of each class's F1."""
    classes = np.union1d(truth, pred)
    scores = []
    for c in classes:
        tp = np.sum((pred == c) & (truth == c))
        fp = np.sum((pred == c) & (truth != c))
        fn = np.sum((pred != c) & (truth == c))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else float("nan")


def _binary_f1(truth: np.ndarray, pred: np.ndarray) -> float:
    tp, fp, fn = np.sum(pred & truth), np.sum(pred & ~truth), np.sum(~pred & truth)
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0


def _reward_metrics(name: str, rewards: Any, margins: Any) -> dict[str, float]:
    """A reward head's `<name>_accuracy` (chosen scored above rejected) and `<name>_margin` (mean chosen -
    rejected) over the pairs that have a margin; rewards [N, 2] (chosen, rejected) per pair."""
    rewards = np.asarray(rewards, dtype=np.float64)
    valid = np.isfinite(np.asarray(margins, dtype=np.float64).reshape(-1))
    if rewards.ndim != 2 or rewards.shape[-1] != 2 or not valid.any():
        return {}
    delta = rewards[valid, 0] - rewards[valid, 1]
    return {f"{name}_accuracy": float(np.mean(delta > 0)), f"{name}_margin": float(np.mean(delta))}


def compute_head_metrics(head_configs: Mapping[str, HeadConfig], predictions: Mapping[str, Any],
                         labels: Mapping[str, Any]) -> dict[str, float]:
    """`<name>_accuracy` and `<name>_f1` (macro; for bce heads the mean over outputs of binary F1) per
    classification head, `<name>_accuracy` and `<name>_margin` per reward head (over pairs), `<name>_mae`,
    `_rmse`, `_pearson`, `_spearman` per regression head (multi-output:
    over all values). `predictions[name]`: the head's logits [N, num_outputs]; `labels[name]`: as built by
    head_label_tensors (missing: -100 or NaN). A head without predictions, labels or labelled samples is left out."""
    out: dict[str, float] = {}
    for name, c in head_configs.items():
        if predictions.get(name) is None or labels.get(name) is None:
            continue
        if c.type == "reward":
            out.update(_reward_metrics(name, predictions[name], labels[name]))
            continue
        logits = np.asarray(predictions[name], dtype=np.float64).reshape(-1, c.num_outputs)
        if c.loss == "ce":
            truth = np.asarray(labels[name]).reshape(-1).astype(np.int64)
            valid = truth != -100
            if not valid.any():
                continue
            truth, pred = truth[valid], logits[valid].argmax(-1)
            out[f"{name}_accuracy"] = float(np.mean(pred == truth))
            out[f"{name}_f1"] = macro_f1(truth, pred)
            continue
        truth = np.asarray(labels[name], dtype=np.float64).reshape(-1, c.num_outputs)
        valid = np.isfinite(truth).all(-1)
        if not valid.any():
            continue
        truth, logits = truth[valid], logits[valid]
        if c.loss == "bce":
            positive, pred = truth >= 0.5, logits > 0
            out[f"{name}_accuracy"] = float(np.mean(positive == pred))
            out[f"{name}_f1"] = float(np.mean([_binary_f1(positive[:, k], pred[:, k]) for k in range(c.num_outputs)]))
            continue
        err = logits - truth
        out[f"{name}_mae"] = float(np.mean(np.abs(err)))
        out[f"{name}_rmse"] = float(np.sqrt(np.mean(err * err)))
        out[f"{name}_pearson"] = pearson(logits, truth)
        out[f"{name}_spearman"] = spearman(logits, truth)
    return out


def head_metrics(head_configs: Mapping[str, HeadConfig]) -> Callable[[Any], dict[str, float]]:
    """A compute_metrics for Trainer(compute_metrics=...): EvalPrediction.predictions / label_ids hold the
    heads' logits / labels in head order (a single array for a single head), as evaluation gives them."""
    names = list(head_configs)

    def compute_metrics(p: Any) -> dict[str, float]:
        preds, labels = p.predictions, p.label_ids
        preds = preds if isinstance(preds, (tuple, list)) else (preds,)
        labels = labels if isinstance(labels, (tuple, list)) else (labels,)
        return compute_head_metrics(head_configs, dict(zip(names, preds)), dict(zip(names, labels)))

    return compute_metrics
