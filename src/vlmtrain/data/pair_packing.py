"""Padding-free preference batches (DPOConfig's ``padding_free``): the 2B right-padded rows of a pair batch (B
chosen, then B rejected: data/preference.py, data/preference_vision.py) packed into one row without padding.

Each sequence keeps its own positions (restarting at 0: transformers' masking builds a block-diagonal causal
mask from them when no ``attention_mask`` is given, so no sequence attends to another); a family with
multimodal rotary positions (Qwen3-VL, Qwen2.5-VL: ``Family.rope_positions``) gets ``position_ids``
[4, 1, T] as in SFT packing (data/hub_packing.py): row 0 the restarting text positions, rows 1-3 each
sequence's own ``get_rope_index`` positions. ``sequence_index`` [1, T] says which of the 2B sequences each token
belongs to (the objective sums each answer's log-probs by it); ``completion_mask`` is 0 on each sequence's first
token (the previous sequence never predicts it). The sequences stay in the same order, so the image placeholder
tokens meet the features of ``image_token_index`` in the same order and the pair's images are still given once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

ROPE_KEYS = ("image_grid_thw",)
"""Per-row-image keys a sequence's multimodal rotary positions read."""
VIDEO_ROPE_KEYS = ("video_grid_thw", "second_per_grid_ts")
"""Per-row-video keys they read."""


def pack_pair_rows(batch: Mapping[str, Any], token_keys: Sequence[str] = (),
                   rope_positions: Callable[[dict[str, Any]], torch.Tensor] | None = None,
                   images_per_row: Sequence[int] | None = None, videos_per_row: Sequence[int] | None = None
                   ) -> dict[str, Any]:
    """The right-padded pair ``batch`` as one packed row (see the module docstring). ``token_keys``: per-token
    keys besides ``input_ids`` / ``completion_mask`` (Qwen's ``mm_token_type_ids``); ``rope_positions``: one
    sequence (``input_ids``, ``mm_token_type_ids``, its images' ``image_grid_thw``) -> its [3, n] positions;
    ``images_per_row``: each row's image count (which of ``image_grid_thw``'s rows are its images);
    ``videos_per_row`` likewise for its videos (``video_grid_thw``, ``second_per_grid_ts``)."""
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    per_token = ("input_ids", "completion_mask", *token_keys)
    out = {k: v for k, v in batch.items() if k not in (*per_token, "attention_mask")}
    for key in per_token:
        out[key] = torch.cat([batch[key][r, :n] for r, n in enumerate(lengths)])[None]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
    out["completion_mask"][0, starts] = 0
    out["sequence_index"] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    text = torch.cat([torch.arange(n) for n in lengths])[None]
    if rope_positions is None:
        out["position_ids"] = text
        return out
    image_starts = torch.tensor([0, *(images_per_row or [0] * len(lengths))]).cumsum(0).tolist()
    video_starts = torch.tensor([0, *(videos_per_row or [0] * len(lengths))]).cumsum(0).tolist()
    rope = []
    for r, n in enumerate(lengths):
        ids = batch["input_ids"][r, :n]
        item = {"input_ids": ids, "mm_token_type_ids": (batch["mm_token_type_ids"][r, :n]
                                                        if "mm_token_type_ids" in batch else torch.zeros_like(ids))}
        for keys, starts in ((ROPE_KEYS, image_starts), (VIDEO_ROPE_KEYS, video_starts)):
            for key in keys:
                if key in batch and starts[r + 1] > starts[r]:
                    item[key] = batch[key][starts[r]:starts[r + 1]]
        rope.append(torch.as_tensor(rope_positions(item)).reshape(3, n))
    out["position_ids"] = torch.cat([text, torch.cat(rope, dim=1)])[:, None]
    return out
