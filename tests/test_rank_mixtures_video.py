"""Ranks whose micro-batches differ in modality: rank 0 gets only video samples (frame lists), rank 1 an image
sample then a text-only one (2 gloo ranks, per-device batch 1, ddp_timeout 30 so a collective mismatch fails fast
instead of hanging). A tiny Qwen3-VL, LoRA with a trained projector under DDP and a full fine-tune under FSDP (each
vision block its own unit: a rank that called its tower a different number of times would gather out of step):
2 training steps and an evaluation finish, and the final weights (fp32; SGD, and AdamW with weight decay where the
second step has no image or video on any rank) and the eval loss equal a 1-process run over the same global
samples; the vision tower and projector learn from rank 0's videos.
(tests/test_rank_mixtures_vision.py does the same for image / text-only ranks; its worker and checks are reused.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from tests import preloaded
from tests.test_rank_mixtures_vision import OPTIMIZERS, _config, _problem, suffix

ROOT = Path(__file__).resolve().parents[1]
CASES = ["qwen3_vl-ddp-lora", "qwen3_vl-fsdp-full"]


def _samples(tmp: Path, n: int, offset: int, text_from: int | None = None) -> list[dict]:
    """n samples: even index a 4-frame clip (frame PNGs), odd ones alternating an image and text only; from index
    ``text_from`` on, text only."""
    rng = np.random.default_rng(offset)
    out = []
    for i in range(n):
        k = offset + i
        sample = {"images": [], "texts": [{"user": f"What is sample {k}?", "assistant": f"It is {k} of them."}]}
        if text_from is not None and i >= text_from:
            pass
        elif i % 2 == 0:
            names = [f"clip{k}_{t}.png" for t in range(4)]
            for name in names:
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "RGB").save(tmp / name)
            sample["videos"] = [names]
        elif i % 4 == 1:
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "RGB").save(tmp / f"img{k}.png")
            sample["images"] = [f"img{k}.png"]
        out.append(sample)
    return out


def test_video_rank_and_image_or_text_rank_match_one_process(tmp_path, one_thread):
    from tests.rank_mixtures_vision_worker import run
    from vlmtrain.models.families import get_family

    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(s) + "\n" for s in _samples(tmp_path, 2, 100)))
    for optim in OPTIMIZERS:
        text_last = 2 if optim == "adamw" else None  # (step 2: global samples 2-3)
        (tmp_path / f"train{suffix(optim)}.jsonl").write_text(
            "".join(json.dumps(s) + "\n" for s in _samples(tmp_path, 4, 0, text_last)))
    checkpoints = {"qwen3_vl": get_family("qwen3_vl").build_tiny(str(tmp_path / "tiny-qwen3_vl"), seed=0)}

    def config(case: str, nproc: int, optim: str) -> str:
        """The image test's config, with the clips kept at their 32 x 32 frames (8 video tokens each)."""
        path = _config(tmp_path, case, checkpoints, nproc, optim)
        cfg = yaml.safe_load(path.read_text())
        cfg["data"].update(video_min_pixels=1024, max_length=160)
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    runs = [(c, optim) for optim in OPTIMIZERS for c in CASES]
    configs = [config(c, 2, optim) for c, optim in runs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    (tmp_path / "logs").mkdir()
    # the ranks: torchrun's rank environment, forked with their imports done (tests/preloaded.py; no launcher)
    _, output = preloaded.launch("tests.preloaded:run_script", [
        str(ROOT / "tests" / "rank_mixtures_vision_worker.py"), str(tmp_path), *configs], env, 2, tmp_path / "logs",
        timeout=600)
    for case, optim in runs:
        run(config(case, 1, optim), str(tmp_path))
    problems = {f"{case} ({optim})": _problem(tmp_path, case, output, optim) for case, optim in runs}
    assert not any(problems.values()), "\n".join(f"{c}: {p}" for c, p in problems.items() if p)
    for case, optim in runs:  # every clip trained and was evaluated (none skipped: they were the point)
        two = torch.load(tmp_path / f"{case}{suffix(optim)}-2.pt", weights_only=False)
        final = next(r for r in two["logs"] if "train_loss" in r)
        assert not any("skipped" in k for k in final) and not any("skipped" in k for k in two["eval"]), (final,
                                                                                                        two["eval"])
