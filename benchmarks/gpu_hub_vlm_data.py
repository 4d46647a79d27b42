"""Data of benchmarks/gpu_hub_vlm.py: synthetic two-image samples and the collator transformers' users write."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch
from hub_vlm import HandWrittenCollator  # (beside this file)
from PIL import Image
from torch.utils.data import Dataset

WORDS = ("the image shows a red square next to blue circle and green triangle on white background while "
         "left right top bottom large small object scene count colour shape answer because first second").split()


# -- data -----------------------------------------------------------------------------------------------------
def write_samples(out: str, n: int, seed: int, tiny: bool) -> str:
    """``n`` two-image samples as a the_cauldron JSONL (absolute image paths, JPEG files): images 448-896 px a
    side (--smoke: 32-64), text of log-normal length (median ~200 tokens, capped at 4,096; --smoke: median 24,
    max 64) split a quarter question, three quarters answer. One byte is one token of this tokenizer."""
    rng = np.random.default_rng(seed)
    lo, hi, median, cap = (32, 64, 24, 64) if tiny else (448, 896, 200, 4096)
    os.makedirs(out, exist_ok=True)
    rows = []
    for i in range(n):
        paths = []
        for j in range(2):
            w, h = (int(x) for x in rng.integers(lo, hi + 1, size=2))
            base = rng.integers(0, 256, size=(1, 1, 3))
            pixels = (base + rng.normal(0, 40, size=(h // 8 + 1, w // 8 + 1, 3))).clip(0, 255).astype(np.uint8)
            path = os.path.join(out, f"{i}_{j}.jpg")
            Image.fromarray(pixels).resize((w, h), Image.BILINEAR).save(path, quality=90)
            paths.append(path)
        length = int(min(cap, max(8, rng.lognormal(math.log(median), 0.8))))
        text = " ".join(rng.choice(WORDS, size=length)).encode()[:length].decode()
        cut = max(1, length // 4)
        rows.append({"images": paths, "texts": [{"user": text[:cut].strip() or "describe",
                                                 "assistant": text[cut:].strip() or "ok"}]})
    data = os.path.join(out, "train.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return data


class JsonlSamples(Dataset):
    """The JSONL's rows in file order, images left as paths (decoded in the collator: in the loader's workers)."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]


class BatchedCollator(HandWrittenCollator):
    """What a transformers.Trainer user writes for Qwen3-VL (benchmarks/hub_vlm.py's collator: one batched
    processor call with padding, labels = the assistant answers + <|im_end|>), on rows whose images are paths:
    opened here, in the data-loader workers."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return super().__call__([{**row, "images": [Image.open(p).convert("RGB") for p in row["images"]]}
                                 for row in rows])
