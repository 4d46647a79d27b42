"""Issue 47's learning proof: the shipped configs/qwen3vl-tiny-video.yaml trains a tiny random-init Qwen3-VL
(built offline) on moving_shapes through `vlmtrain demo`, and the held-out answers need the motion: >= 0.90 exact
match (chance 0.25), while the same model on blank clips stays near chance and on stills (every frame the clip's
last) near what one frame allows (0.25 for motion, at most 0.5 for first_color)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from vlmtrain import run
from vlmtrain.models.families import get_family

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen3vl-tiny-video.yaml"


@pytest.mark.slow
def test_tiny_qwen3vl_learns_the_motion_in_moving_shapes(tmp_path, capsys):
    pretrained = get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny-qwen3vl"), seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as OMP_NUM_THREADS=1: one thread trains, the loader worker renders beside it)
    start = time.perf_counter()
    try:  # the shipped config unchanged, only its paths moved into tmp_path
        metrics = run.demo(output_dir=str(tmp_path / "run"), config=str(CONFIG),
                           overrides={"model.pretrained": pretrained})
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\nmoving_shapes learning check: {seconds:.0f} s; " + ", ".join(
            f"{k} {metrics[k]:.3f}" for k in sorted(metrics) if k.endswith("exact_match")))
    assert metrics["global_step"] == 1400
    assert metrics["eval_video_exact_match"] >= 0.90, metrics
    for q in ("motion", "first_color"):
        assert metrics[f"eval_{q}_exact_match"] >= 0.85, metrics
        assert metrics[f"blank_{q}_exact_match"] <= 0.40, metrics
    assert metrics["still_motion_exact_match"] <= 0.40, metrics
    assert metrics["still_first_color_exact_match"] <= 0.65, metrics
