"""Multi-image VLM collation: raw the_cauldron samples -> one padded batch, bad samples skipped and counted."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from vlmtrain.data.collate import pad_sequences
from vlmtrain.data.processing import IGNORE_INDEX, SkipSample, VLMProcessor

logger = logging.getLogger(__name__)


class VLMCollator:
    """Processes and pads a list of raw samples (``{"images": [...], "texts": [...]}``).

    Returns tensors only:

    * ``input_ids`` / ``attention_mask`` / ``labels``: right-padded with pad id / 0 / -100;
    * ``pixel_values``: [N, 3, S, S], every encoder input of every kept sample in sample order (the
      order of the image placeholders, row-major); [0, 3, S, S] when the batch has no images;
    * ``prompt_input_ids`` / ``prompt_attention_mask``: the generation prompts, LEFT-padded so new
      tokens follow every prompt directly; ``prompt_pixel_values`` is ``pixel_values`` (a prompt holds
      all of its sample's images).

    Samples raising :class:`SkipSample` are dropped and counted by reason: the batch's ``skipped``
    entry holds this batch's counts (so they reach the Trainer's log from DataLoader workers too; the
    Trainer keeps the key out of the model's forward), ``self.skipped`` the running total of this
    process. Items already processed (dicts with ``input_ids``) pass through unchanged. If EVERY
    sample of a batch is bad, a ``ValueError`` naming the reasons is raised: an empty batch would
    silently break the step.
    """

    def __init__(self, processor: VLMProcessor) -> None:
        pad = processor.tokenizer.pad_token_id
        if pad is None:
            raise ValueError("VLMCollator needs a tokenizer with a pad token")
        self.processor = processor
        self.pad_token_id = int(pad)
        self.skipped: Counter[str] = Counter()

    def _process(self, sample: Any, skipped: Counter[str]) -> dict[str, Any] | None:
        if isinstance(sample, Mapping) and "input_ids" in sample:
            return dict(sample)
        try:
            return self.processor.process(sample)
        except SkipSample as err:
            if not self.skipped[err.reason]:  # warn once per reason, then only count
                logger.warning("skipping bad sample (%s); further ones are only counted", err)
            self.skipped[err.reason] += 1
            skipped[err.reason] += 1
            return None

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        if not samples:
            raise ValueError("Cannot collate an empty list of samples.")
        skipped: Counter[str] = Counter()
        items = [it for it in (self._process(s, skipped) for s in samples) if it is not None]
        if not items:
            raise ValueError(f"every sample of the batch ({len(samples)}) was skipped; reasons so far: "
                             f"{dict(self.skipped)}")
        ids = [torch.as_tensor(it["input_ids"], dtype=torch.long) for it in items]
        labels = [torch.as_tensor(it["labels"], dtype=torch.long) for it in items]
        prompts = [torch.as_tensor(it["prompt_input_ids"], dtype=torch.long) for it in items]
        s = self.processor.image_size
        pixels = [it["pixel_values"] for it in items if it["pixel_values"].shape[0]]
        pixel_values = torch.cat(pixels) if pixels else torch.zeros(0, 3, s, s)
        return {
            "input_ids": pad_sequences(ids, self.pad_token_id, side="right"),
            "attention_mask": pad_sequences([torch.ones_like(t) for t in ids], 0, side="right"),
            "labels": pad_sequences(labels, IGNORE_INDEX, side="right"),
            "pixel_values": pixel_values,
            "prompt_input_ids": pad_sequences(prompts, self.pad_token_id, side="left"),
            "prompt_attention_mask": pad_sequences([torch.ones_like(t) for t in prompts], 0, side="left"),
            "prompt_pixel_values": pixel_values,
            "skipped": dict(skipped),
        }
