"""Reward pairs with images for a Hub VLM with a ``reward`` score head (models/objectives/heads.py): each pair becomes its
chosen and its rejected sample (:func:`pair_samples`), processed and laid out by the family's own processing
(data/hub_processing.py, data/hub_collate.py) as a pair batch: the B chosen samples, then the B rejected ones, with
one margin per pair as the head's label. What vlmtrain.RewardTrainer's VLM path and a YAML config's
`train.objective: reward` read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ConfigError
from .preference_vision import ROW_IMAGE_KEYS, ROW_TOKEN_KEYS, VISION_PREFIX, image_token_id
from .processing import SkipSample

HEAD = "reward"
"""RewardTrainer's head name."""


def message_text(content: Any) -> str:
    """A message's text: the string, or its text parts joined (image parts: the sample's images)."""
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def message_turns(messages: list[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Chat messages as vlmtrain's ``texts`` turns (each user message a turn, each assistant message its answer)."""
    turns: list[dict[str, str]] = []
    for m in messages:
        if m.get("role") == "user":
            turns.append({"user": message_text(m.get("content", ""))})
        elif m.get("role") == "assistant" and turns and "assistant" not in turns[-1]:
            turns[-1]["assistant"] = message_text(m.get("content", ""))
        else:
            raise ConfigError(f"a VLM reward pair's prompt has a {m.get('role')!r} message where vlmtrain's samples "
                              "take alternating user / assistant turns (no system turn yet).")
    return turns


def pair_samples(pair: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pair as two vlmtrain samples (the chosen, then the rejected answer to the same prompt, images and videos): TRL's
    layout (the images go first in the first user turn) or vlmtrain's own (the_cauldron ``texts`` whose last turn
    is the question alone: each answer becomes its assistant text)."""
    chosen, rejected, prompt = pair.get("chosen"), pair.get("rejected"), pair.get("prompt")
    if chosen is None or rejected is None:
        raise ConfigError(f"a reward pair without 'chosen' or 'rejected' (it has {sorted(pair)}).")
    if prompt is None and isinstance(pair.get("texts"), list):  # vlmtrain's own pair layout (data/pairs.py)
        turns = pair["texts"]
        return tuple({**{k: v for k, v in pair.items() if k in ("images", "videos", "video", "id")},  # type: ignore[return-value]
                      "texts": [*turns[:-1], {"user": turns[-1]["user"], "assistant": a}]} for a in (chosen, rejected))
    if prompt is None:
        if not isinstance(chosen, list):
            raise ConfigError("a VLM reward pair of plain strings needs a 'prompt' column (the answer's start "
                              "cannot be told from the prompt's).")
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    turns = message_turns(prompt) if isinstance(prompt, list) else [{"user": prompt}]
    answers = [message_text(a[-1]["content"]) if isinstance(a, list) else a for a in (chosen, rejected)]
    images = pair.get("images") or []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    videos = {k: pair[k] for k in ("videos", "video") if pair.get(k) is not None}  # (first, before the images)
    return tuple({"images": images, **videos, "texts": [*turns[:-1], {**turns[-1], "assistant": a}]}  # type: ignore[return-value]
                 for a in answers)


class VisionPairCollator:
    """Reward pairs with images as one pair batch for a Hub VLM with a ``reward`` head: the B chosen samples,
    then the B rejected ones, as the family's collator lays samples out, no LM targets, and ``labels_reward``
    (each pair's margin, 0 without). A pair whose chosen or rejected sample the processing skips (too long, a
    bad image, ...) is skipped whole and counted in ``skipped``. With ``one_vision_pass`` (the default) each pair's
    images are given once, as DPO's pair batches give them (data/preference_vision.py): the chosen samples' pixel
    inputs under ``vision_*`` and ``image_token_index`` naming, for each image token of the 2B rows, the feature
    token it shows (a rejected row shows its chosen row's), which the model encodes in one vision pass
    (models/objectives/vision_pairs.py)."""

    keeps_columns = True  # (it reads images and texts: the Trainer keeps every column)

    def __init__(self, hub_processor: Any, label_collate: Callable[[list[Any]], dict[str, Any]] | None = None,
                 one_vision_pass: bool = True) -> None:
        from .hub_collate import HubVLMCollator

        self.processor = hub_processor
        self.collate = HubVLMCollator(hub_processor)
        self.label_collate = label_collate or _margins
        self.one_vision_pass = one_vision_pass
        self.skipped: Counter[str] = Counter()

    def __call__(self, pairs: list[Mapping[str, Any]]) -> dict[str, Any]:
        chosen, rejected, kept = [], [], []
        for pair in pairs:
            try:
                c, r = (self.processor.process(s) for s in pair_samples(pair))
            except SkipSample as err:
                self.skipped[err.reason] += 1
                continue
            chosen.append(c)
            rejected.append(r)
            kept.append(pair)
        if not chosen:
            raise ConfigError(f"every reward pair of a batch was skipped ({dict(self.skipped)}): check the pairs' "
                              "images and lengths (max_length).")
        batch = self.collate(chosen + rejected)
        batch.pop("labels", None)  # the reward head's loss alone: no LM targets
        if self.one_vision_pass:
            batch = self._images_once(batch, chosen)
        return {**batch, **self.label_collate(kept)}

    def _images_once(self, batch: dict[str, Any], chosen: list[Any]) -> dict[str, Any]:
        """``batch`` with each pair's images once (see the class docstring); a batch without images, with videos,
        or whose rejected rows do not show their chosen rows' image tokens, as it is."""
        pixel_keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor)
                      and k not in ("input_ids", "attention_mask", *ROW_TOKEN_KEYS) and not k.startswith("labels")]
        if not pixel_keys or any("video" in k for k in pixel_keys):
            return batch
        shown = (batch["input_ids"] == image_token_id(self.processor.processor)).sum(dim=1)
        per_chosen, per_rejected = shown.chunk(2)
        if not torch.equal(per_chosen, per_rejected):
            return batch
        images = self.collate(chosen)  # (the chosen samples' pixel inputs: each pair's images once)
        out = {k: v for k, v in batch.items() if k not in pixel_keys or k in ROW_IMAGE_KEYS}
        out.update({VISION_PREFIX + k: images[k] for k in pixel_keys})
        out["image_token_index"] = torch.arange(int(per_chosen.sum())).repeat(2)
        return out


def _margins(pairs: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """RewardTrainer's head label: each pair's TRL ``margin`` (0 without)."""
    return {f"labels_{HEAD}": torch.tensor([float(p.get("margin") or 0.0) for p in pairs], dtype=torch.float32)}
