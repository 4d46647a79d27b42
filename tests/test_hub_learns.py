"""Proof (short version) that a Hub VLM with two score heads learns through the CLI: a tiny random-init
Qwen3-VL trained on shapes_scores (count: regression, color: 6-way classification), see
configs/qwen3vl-tiny-score-heads.yaml and the README's "Hub VLMs: score heads" for the full-length numbers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3vl-tiny-score-heads.yaml"
NUM_EVAL = 200
STEPS = 200


def _blind_count_mae(num_eval: int, seed: int) -> float:
    """The held-out count MAE of the best image-blind constant (the labels' median): what blank images allow."""
    from vlmtrain.tasks.shapes_scores import ShapesScores

    counts = [s["labels"]["count"] for s in ShapesScores("val", num_eval, seed=seed)]
    median = statistics.median(counts)
    return sum(abs(c - median) for c in counts) / len(counts)


@pytest.mark.slow
def test_tiny_qwen3vl_two_heads_learn_through_cli(tmp_path: Path, one_thread: None) -> None:
    from vlmtrain.cli import main
    from vlmtrain.models.families import get_family

    pretrained = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny"), seed=0)
    out = tmp_path / "run"
    code = main(["train", "--config", str(CONFIG), "--model.pretrained", pretrained,
                 "--train.output_dir", str(out), "--train.max_steps", str(STEPS), "--train.eval_steps", str(STEPS),
                 "--train.logging_steps", "20", "--train.dataloader_num_workers", "0",
                 "--data.num_train", "8000", "--data.num_eval", str(NUM_EVAL)])
    assert code == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_logs = [r for r in records if "loss" in r and "learning_rate" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert train_logs and evals, records
    for name in ("count", "color"):  # every head's loss is logged in training and evaluation
        assert all(f"loss_{name}" in r for r in train_logs), train_logs[-1]
        assert f"eval_loss_{name}" in evals[-1], evals[-1]
    final = evals[-1]
    assert final["step"] == STEPS
    # Chance is 1/6 for colour (0.15-0.18 with blank images); 0.9 after the full config's 500 steps.
    assert final["eval_color_accuracy"] >= 0.35, final
    # Blank images allow at best the labels' median (MAE ~1.0; a model trained on blank images: 1.03-1.06).
    blind = _blind_count_mae(NUM_EVAL, seed=0)
    assert final["eval_count_mae"] <= 0.5 * blind, (final, blind)
    assert 0.8 < blind < 1.2  # the baseline itself: counts 1-4, about uniform
