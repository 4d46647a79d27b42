"""GRPO prompts with videos (vlmtrain's layout, as DPO's pairs and SFT samples hold them: a ``videos`` list or one
``video`` per row, each a file, a list of frame images, or a decoded :class:`~vlmtrain.data.video.VideoClip`), for
the Hub VLM families with video support (Qwen3-VL, Qwen2.5-VL).

Each group's videos are decoded once (data/preference_vision.decode_clips, as DPO's pairs: to the frames and size
the family's plan keeps under the ``data.video_*`` settings) and processed with its prompt and images in one processor call (grpo_vision.py's
``encode_groups``: the video placeholders expanded, Qwen3-VL's timestamps written). :class:`GroupVideos` keeps each
group's video pixel inputs once and gives the rows of a slice, as for images, the groups' inputs once
(``videos_pixel_values_videos``, ``videos_video_grid_thw``: one ``get_video_features`` call per rollout and per
training forward, models/objectives/vision_pairs.py), ``video_token_index`` (each row's video placeholder token ->
its group's feature token) and each row's per-video keys (``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``)
for the language model's multimodal rotary positions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.hub_messages import sample_videos
from ..data.preference_vision import (
    ROW_VIDEO_KEYS,
    VIDEO_ENCODER_KEYS,
    VIDEO_PREFIX,
    video_token_id,
)
from ..data.video import VideoClip, VideoSettings
from ..errors import ConfigError
from .dpo import _family

VIDEO_COLUMNS = ("video", "videos")
VIDEO_KEYS = (*VIDEO_ENCODER_KEYS, *ROW_VIDEO_KEYS)
"""A prompt's video outputs of the processor, kept per group by :class:`GroupVideos` (never image inputs)."""


def has_videos(sample: Mapping[str, Any]) -> bool:
    """Whether a dataset's rows carry videos (a ``videos`` or ``video`` column)."""
    return any(k in sample for k in VIDEO_COLUMNS)


def check_video_support(sample: Mapping[str, Any], model: str | nn.Module) -> None:
    """A dataset with videos needs a model (an object, or a path whose config is read: before the model loads)
    whose family has video support (its ``video`` hook): refused in one line naming the family (or model type)."""
    column = next((k for k in VIDEO_COLUMNS if k in sample), None)
    if column is None:
        return
    family = _family(model)
    if getattr(family, "video", None) is not None:
        return
    what = f"the {family.name} family" if family is not None else "the model (not a Hub VLM family)"
    raise ConfigError(f"the dataset has a {column!r} column, but {what} has no video support in vlmtrain: GRPO with "
                      "videos runs on Qwen3-VL and Qwen2.5-VL; give frames as images, or use one of those models.")


def video_support(model: nn.Module, processor: Any, settings: VideoSettings | None = None) -> Any:
    """The model's family's video support for ``processor`` under ``settings`` (default: the families' own
    defaults; a run config's: its ``data.video_*`` keys)."""
    return _family(model).video(processor, settings or VideoSettings())


def same_videos(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two rows give the same videos (a decoded clip: the same object, or the same frames and indices)."""
    x, y = sample_videos(a), sample_videos(b)

    def same(u: Any, v: Any) -> bool:
        if u is v:
            return True
        if isinstance(u, VideoClip) or isinstance(v, VideoClip):
            return (isinstance(u, VideoClip) and isinstance(v, VideoClip) and u.indices == v.indices
                    and u.size == v.size and torch.equal(u.frames, v.frames))
        return bool(u == v)

    return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))


def feature_token_index(rows: Sequence[int], tokens: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """The groups of ``rows`` (each row's group) that have placeholder tokens (``tokens``: per group), in order,
    each once, and each row's placeholder tokens -> those groups' feature tokens (encoded once, in that order)."""
    groups = [g for g in dict.fromkeys(rows) if tokens[g]]
    first = dict(zip(groups, torch.tensor([0] + [tokens[g] for g in groups]).cumsum(0).tolist()))
    index = [k for g in rows if tokens[g] for k in range(first[g], first[g] + tokens[g])]
    return groups, torch.tensor(index, dtype=torch.long)


@dataclass
class GroupVideos:
    """Each group's videos processed once: ``encoder`` (its ``get_video_features`` inputs, {} without videos),
    ``per_video`` (its per-video keys the language model reads for a row's positions) and ``tokens`` (its video
    placeholder tokens)."""

    encoder: list[dict[str, torch.Tensor]] = field(default_factory=list)
    per_video: list[dict[str, torch.Tensor]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, processor: Any, processed: Mapping[str, Any]) -> None:
        """One group's processor outputs (its prompt's ``input_ids`` and, with videos, their keys)."""
        has = any(k in processed for k in VIDEO_KEYS)
        self.encoder.append({k: processed[k] for k in VIDEO_ENCODER_KEYS if has})
        self.per_video.append({k: torch.as_tensor(processed[k]) for k in ROW_VIDEO_KEYS if has and k in processed})
        self.tokens.append(int((processed["input_ids"][0] == video_token_id(processor)).sum()) if has else 0)

    def inputs(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """The video keys of rows whose groups are ``rows``: the groups' video inputs once (``videos_*``), each
        row's placeholder tokens -> those groups' feature tokens, and each row's per-video keys; {} without
        videos."""
        groups, index = feature_token_index(rows, self.tokens)
        if not groups:
            return {}
        out = {VIDEO_PREFIX + k: torch.cat([self.encoder[g][k] for g in groups]) for k in VIDEO_ENCODER_KEYS}
        out["video_token_index"] = index
        for key in self.per_video[groups[0]]:
            out[key] = torch.cat([self.per_video[g][key] for g in rows if self.tokens[g]])
        return out
