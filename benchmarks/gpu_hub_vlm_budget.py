"""The "vlmtrain budget" contender of benchmarks/gpu_hub_vlm.py: token-budget micro-batches (docs/hub-vlms.md).

One packed row of --budget-tokens T tokens per step (data.packing, data.pack_window W, data.pack_length T,
per_device_train_batch_size 1), the vision tower's input padded to --budget-patches P patches
(data.max_patches_per_pack), text attention per document and vision attention over all images in one call
(model.attn_implementation: varlen_torch). Every step has the same shapes. A step holds as many samples as fit
in T tokens (other samples than the batches of the other contenders: its first batch and step-1 loss are its
own; benchmarks/budget_fill.py measures its fill on this data without a GPU).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

NAME = "vlmtrain budget"
PATCHES_PER_TOKEN = 3.25
"""P = this x T by default: image tokens are 74.5% of this data's tokens, 4 patches each; token fill 0.971 at
window 256 (budget_fill.py, docs/hub-vlms.md)."""
AVERAGE_SAMPLE_TOKENS = {"tiny": 100, "2b": 1185, "8b": 1185}
"""Tokens per sample of this data (budget_fill.py; tiny: --smoke), to write enough samples for its steps."""


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--budget-tokens", type=int, default=None, help=f"{NAME}: tokens per step, T "
                   "(data.pack_length; default 16384, --smoke 1024)")
    p.add_argument("--budget-patches", type=int, default=None, help=f"{NAME}: vision patches per step, P "
                   f"(data.max_patches_per_pack; default {PATCHES_PER_TOKEN} x T, at least 2 images of the "
                   "largest size)")
    p.add_argument("--pack-window", type=int, default=256, help=f"{NAME}: samples packed together "
                   "(data.pack_window; default 256)")


def tokens(opts: argparse.Namespace) -> int:
    return opts.budget_tokens or (1024 if opts.smoke else 16384)


def samples_needed(opts: argparse.Namespace, size: str) -> int:
    """Samples to write so that this contender's --steps rows (plus one window) never run out."""
    per_step = math.ceil(tokens(opts) / AVERAGE_SAMPLE_TOKENS[size] * 1.25)
    return per_step * opts.steps + opts.pack_window


def config(opts: argparse.Namespace, max_image_patches: int) -> tuple[dict[str, Any], dict[str, Any], str]:
    """(data keys, train keys, model.attn_implementation) of the contender's vlmtrain config."""
    t = tokens(opts)
    patches = opts.budget_patches or max(int(PATCHES_PER_TOKEN * t) // 4 * 4, 2 * max_image_patches)
    data = {"packing": True, "pack_window": opts.pack_window, "pack_length": t, "max_length": min(8192, t),
            "max_patches_per_pack": patches, "max_images": 2}
    return data, {"per_device_train_batch_size": 1}, "varlen_torch"


def max_image_patches(processor: Any) -> int:
    """Patches of the largest image the processor makes (its max_pixels over the patch area)."""
    ip = processor.image_processor
    return int(ip.size["longest_edge"]) // ip.patch_size ** 2
