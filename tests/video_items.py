"""Processed Qwen-VL video samples built by hand, for tests of what happens after processing (batching, packing,
positions, FLOPs, rank mixtures): the text of a sample processed by HubVLMProcessor with a marker where the
video goes, the marker replaced by the family's video tokens, and the frames patchified as Qwen's video
processors lay them out (temporal_patch_size frames per patch, merge x merge patches per token).
"""

from __future__ import annotations

import numpy as np
import torch

from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.data.processing import IGNORE_INDEX
from vlmtrain.models.families.qwen_common import VIDEO_PAD, VISION_END, VISION_START

MARKER = "@@VIDEO@@"


def frames(seed: int, count: int = 4, size: int = 32) -> np.ndarray:
    """``count`` random frames [T, H, W, 3] uint8."""
    return np.random.default_rng(seed).integers(0, 256, (count, size, size, 3), dtype=np.uint8)


def patchify(clip: np.ndarray, processor) -> tuple[torch.Tensor, list[int]]:
    """uint8 frames [T, H, W, 3] -> (pixel_values_videos [t*h*w, C*tps*ps*ps], [t, h, w]); T padded to a multiple
    of the temporal patch size with the last frame, normalized by the image processor's mean / std."""
    ip = processor.image_processor
    ps, merge, tps = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    x = torch.as_tensor(clip).float().div(255).permute(0, 3, 1, 2)  # T, C, H, W
    if len(x) % tps:
        x = torch.cat([x, x[-1:].expand(tps - len(x) % tps, -1, -1, -1)])
    mean, std = torch.tensor(ip.image_mean).view(1, 3, 1, 1), torch.tensor(ip.image_std).view(1, 3, 1, 1)
    x = (x - mean) / std
    t, c, h, w = len(x) // tps, x.shape[1], x.shape[2] // ps, x.shape[3] // ps
    x = x.reshape(t, tps, c, h // merge, merge, ps, w // merge, merge, ps)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, c * tps * ps * ps)
    return x.contiguous(), [t, h, w]


def video_item(hub: HubVLMProcessor, sample: dict, clip: np.ndarray, fps: float = 2.0) -> dict:
    """``sample`` (no videos; its first user text starts with nothing of its own) processed by ``hub`` with ``clip``
    as a video before its first user text: Qwen3-VL's layout (per temporal patch ``<t seconds>`` then
    vision_start, its tokens, vision_end) or Qwen2.5-VL's (one vision_start ... vision_end run, and
    second_per_grid_ts)."""
    texts = [dict(t) for t in sample["texts"]]
    texts[0]["user"] = MARKER + texts[0]["user"]
    item = hub.process({**sample, "texts": texts})
    tok = hub.tokenizer
    pixels, (t, h, w) = patchify(clip, hub.processor)
    merge = hub.processor.image_processor.merge_size
    per_frame = h * w // merge**2
    start, end, pad = (tok.convert_tokens_to_ids(x) for x in (VISION_START, VISION_END, VIDEO_PAD))
    tps = hub.processor.image_processor.temporal_patch_size
    if hub.family.name == "qwen3_vl":
        ids: list[int] = []
        for i in range(t):
            stamp = (i * tps + (i * tps + tps - 1)) / 2 / fps
            ids += tok.encode(f"<{stamp:.1f} seconds>", add_special_tokens=False) + [start] + [pad] * per_frame + [end]
    else:
        ids = [start] + [pad] * (t * per_frame) + [end]
    marker = tok.encode(MARKER, add_special_tokens=False)
    n = len(ids)
    out = dict(item)
    for prefix in ("", "prompt_") if "prompt_input_ids" in item else ("",):
        old = item[f"{prefix}input_ids"].tolist()
        at = next(i for i in range(len(old)) if old[i:i + len(marker)] == marker)

        def splice(value: torch.Tensor, fill: int, at: int = at) -> torch.Tensor:
            return torch.cat([value[:at], torch.full((n,), fill, dtype=value.dtype), value[at + len(marker):]])

        out[f"{prefix}input_ids"] = torch.tensor(old[:at] + ids + old[at + len(marker):])
        out[f"{prefix}attention_mask"] = splice(item[f"{prefix}attention_mask"], 1)
        if not prefix:
            out["labels"] = splice(item["labels"], IGNORE_INDEX)
        types = splice(item[f"{prefix}mm_token_type_ids"], 0)
        types[at:at + n][torch.tensor(ids) == pad] = 2
        out[f"{prefix}mm_token_type_ids"] = types
        for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
            out.pop(f"{prefix}{key}", None)
        out[f"{prefix}pixel_values_videos"] = pixels
        out[f"{prefix}video_grid_thw"] = torch.tensor([[t, h, w]])
        if hub.family.name == "qwen2_5_vl":
            out[f"{prefix}second_per_grid_ts"] = torch.tensor([tps / fps])
    return out
