"""End to end through the CLI, as a user runs it: train, checkpoint, resume, evaluate, predict; and the
addition example's promise (>= 95% held-out exact match)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmtrain import run
from vlmtrain.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "addition-tiny.yaml"


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "vlmtrain", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_cli_trains_checkpoints_resumes_and_predicts(tmp_path):
    out = tmp_path / "run"
    common = ["--config", str(CONFIG), "--train.output_dir", str(out), "--data.num_train", "2000",
              "--data.num_eval", "50", "--train.per_device_train_batch_size", "32", "--train.logging_steps", "10",
              "--train.eval_steps", "20", "--train.save_steps", "20", "--train.disable_tqdm", "true"]
    _cli("train", *common, "--train.max_steps", "40")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-40"]
    assert (out / "config.yaml").is_file()
    assert load_run_config(out / "config.yaml").train.max_steps == 40

    _cli("train", *common, "--train.max_steps", "60", "--train.resume_from_checkpoint", "true")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in rows if "loss" in r]
    assert train_steps == [10, 20, 30, 40, 50, 60]  # the resumed run continued at 40, nothing twice
    assert [r["step"] for r in rows if "eval_loss" in r] == [20, 40, 60]
    assert all("eval_exact_match" in r for r in rows if "eval_loss" in r)
    # save_total_limit: 2 keeps the newest two.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-40", "checkpoint-60"]

    stdout = _cli("eval", *common, "--checkpoint", str(out / "checkpoint-60")).stdout
    metrics = json.loads(stdout[stdout.index("\n{\n"):])  # the JSON the command prints after the log lines
    assert metrics["eval_loss"] == pytest.approx(rows[-2]["eval_loss"], rel=1e-5)
    texts = _cli("predict", *common, "--checkpoint", str(out)).stdout.splitlines()[-50:]
    assert all(t.isdigit() for t in texts), texts
    answer = _cli("generate", "--checkpoint", str(out), "--prompt", "12+34=", "--max-new-tokens", "4").stdout
    assert answer.strip().isdigit()


@pytest.mark.slow
def test_addition_example_reaches_95_percent_on_held_out_sums(tmp_path):
    cfg = load_run_config(CONFIG, {"train.output_dir": str(tmp_path), "train.disable_tqdm": True})
    metrics = run.train(cfg)
    assert metrics["global_step"] == cfg.train.max_steps
    assert metrics["eval_exact_match"] >= 0.95, metrics


@pytest.mark.slow
def test_vlm_demo_learns_shapes_vqa_from_the_images(tmp_path, capsys):
    """`vlmtrain demo` (configs/shapes-tiny.yaml, ~10 min on 2 cores): held-out single-/multi-image exact match
    at issue 16's targets (0.90 / 0.80, relative position 0.75), and every group at chance once the images are
    blanked: the answers come from the pixels.

    Measured at one torch thread, as under xdist (conftest; the thread count changes the floating point), seeds 0,
    on a 2-core machine (2026-11-24, the config of screening-log section (f)): single 0.954 (position 0.850, count
    0.970), multi 0.877 (multi_count 0.810); blank 0.198 / 0.375."""
    from vlmtrain.tasks.shapes import CHANCE, MULTI_IMAGE_QTYPES, SINGLE_IMAGE_QTYPES

    # Only the final evaluation: evaluations during training do not change it (same losses step for step with
    # and without them, checked on 60 steps of this config). On CI the saving was within noise (1,473 vs 1,475 s).
    metrics = run.demo(output_dir=str(tmp_path), overrides={"train.eval_strategy": "no"})
    assert metrics["eval_single_image_exact_match"] >= 0.90, metrics
    assert metrics["eval_multi_image_exact_match"] >= 0.80, metrics
    assert metrics["eval_position_exact_match"] >= 0.75, metrics
    for q in ("color", "shape", "count"):
        assert metrics[f"eval_{q}_exact_match"] >= 0.95, metrics
    for group, qtypes in (("single_image", SINGLE_IMAGE_QTYPES), ("multi_image", MULTI_IMAGE_QTYPES)):
        chance = sum(CHANCE[q] for q in qtypes) / len(qtypes)
        assert metrics[f"blank_{group}_exact_match"] <= chance + 0.15, metrics
    assert metrics["blank_position_exact_match"] <= 0.65 and metrics["blank_side_exact_match"] <= 0.65, metrics
    printed = capsys.readouterr().out
    for needle in ("position", "multi_color", "blank images", "single-image (mean)", str(tmp_path)):
        assert needle in printed
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert sorted(tmp_path.glob("checkpoint-*"))
