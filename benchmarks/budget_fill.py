"""Fill of token-budget micro-batches on benchmarks/gpu_hub_vlm.py's long-tailed two-image data (CPU, no model).

The GPU benchmark's samples (gpu_hub_vlm_data.write_samples: two JPEG images 448-896 px a side, log-normal text
with median ~200 tokens, at most 4,096) are processed by its Qwen3-VL processor (patch 16, merge 2, at most
1,024 tokens per image) with vlmtrain's HubVLMProcessor (max_length 8,192), then packed exactly as a run with
``data.packing: true, data.pack_window: W, data.pack_length: T, data.max_patches_per_pack: P`` and
``per_device_train_batch_size: 1`` packs them: vlmtrain.data.pack_stream.PackedDataset over the processed samples
in file order, one row per step. Printed per (T, P, W): rows, token fill (real tokens / (rows x T): text + image
tokens, the benchmark's "fill") and patch fill (real patches / (rows x P): how much of the padded vision input is
real). No GPU, no model: lengths only.

    python benchmarks/budget_fill.py                        # 1,024 samples: about 2 minutes on 2 cores
    python benchmarks/budget_fill.py --samples 2048 --tokens 16384 --patch-ratio 3.25 --window 256
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_hub_vlm_parts as parts  # noqa: E402

from vlmtrain.data.hub_processing import HubVLMProcessor  # noqa: E402
from vlmtrain.data.pack_stream import PackedDataset  # noqa: E402
from vlmtrain.data.packing import vision_patches  # noqa: E402


class Items:
    """Processed samples as a stream with the state PackedDataset keeps (a position)."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items, self.at = items, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while self.at < len(self.items):
            self.at += 1
            yield self.items[self.at - 1]

    def state_dict(self) -> dict[str, int]:
        return {"at": self.at}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.at = state["at"]


def lengths(samples: int, seed: int, out: str) -> list[dict[str, Any]]:
    """Each sample's token count and image grid (what packing reads), processed as a vlmtrain run does."""
    data = parts.write_samples(os.path.join(out, "data"), samples, seed, tiny=False)
    hub = HubVLMProcessor(parts.processor_for("2b"), parts.FAMILY, max_length=8192, max_images=2, prompts=False)
    items = []
    for row in parts.JsonlSamples(data).rows:
        item = hub.process(row)
        items.append({"input_ids": torch.empty(len(item["input_ids"]), dtype=torch.uint8),
                      "image_grid_thw": item["image_grid_thw"]})
    return items


def fill(items: list[dict[str, Any]], tokens: int, patches: int | None, window: int) -> dict[str, float]:
    ds = PackedDataset(Items(items), lambda it: it, tokens, pad_token_id=None, window=window, keep_items=True,
                       max_patches_per_pack=patches)
    rows = [row for row in ds if row.get("items")]
    real = sum(row["pack_stats"]["tokens"] for row in rows)
    seen = sum(vision_patches(it) for row in rows for it in row["items"])
    assert sum(len(row["items"]) for row in rows) == len(items)
    return {"rows": len(rows), "fill": real / (len(rows) * tokens),
            "patch_fill": seen / (len(rows) * patches) if patches else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384], help="T: data.pack_length")
    p.add_argument("--patch-ratio", type=float, nargs="+", default=[3.0, 3.25, 3.5, 4.0], help="P = this x T, "
                   "rounded down to a multiple of 4 (data.max_patches_per_pack; each run also without P)")
    p.add_argument("--window", type=int, nargs="+", default=[64, 256, 1024], help="W: data.pack_window")
    opts = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="budget_fill_") as out:
        items = lengths(opts.samples, opts.seed, out)
    n = torch.tensor([len(it["input_ids"]) for it in items], dtype=torch.float64)
    pt = torch.tensor([vision_patches(it) for it in items], dtype=torch.float64)
    print(f"{len(items)} samples (benchmarks/gpu_hub_vlm.py's data, seed {opts.seed}): tokens per sample median "
          f"{n.median():.0f}, mean {n.mean():.0f}, max {n.max():.0f}; image tokens {pt.sum() / 4 / n.sum():.1%} of "
          f"all; vision patches per sample mean {pt.mean():.0f}, max {pt.max():.0f}")
    print(f"{'T':>6} {'P':>7} {'W':>5} {'rows':>5} {'token fill':>10} {'patch fill':>10}")
    for tokens in opts.tokens:
        for patches in [int(r * tokens) // 4 * 4 for r in opts.patch_ratio] + [None]:
            for window in opts.window:
                r = fill(items, tokens, patches, window)
                print(f"{tokens:>6} {patches or '-':>7} {window:>5} {r['rows']:>5} {r['fill']:>10.3f} "
                      f"{r['patch_fill']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
