"""Multi-image VLM collation: raw the_cauldron samples -> one padded batch, bad samples skipped and counted."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import torch

from vlmtrain.data.collate import pad_sequences
from vlmtrain.data.packing import MIN_FILL_GAIN, pack_items, pack_lengths, pack_stats, worth_packing
from vlmtrain.data.processing import IGNORE_INDEX, VLMProcessor, process_or_skip


class VLMCollator:
    """Processes and pads a list of raw samples (``{"images": [...], "texts": [...]}``).

    Returns tensors only:

    * ``input_ids`` / ``attention_mask`` / ``labels``: right-padded with pad id / 0 / -100;
    * ``pixel_values``: [N, 3, S, S], every encoder input of every kept sample in sample order (the
      order of the image placeholders, row-major); [0, 3, S, S] when the batch has no images;
    * ``prompt_input_ids`` / ``prompt_attention_mask``: the generation prompts, LEFT-padded so new
      tokens follow every prompt directly; ``prompt_pixel_values`` is ``pixel_values`` (a prompt holds
      all of its sample's images).

    With ``pack_length`` the training tensors are packed instead (:mod:`vlmtrain.data.packing`) when
    that raises the batch's fill by ``min_fill_gain`` (else padded as above; a negative gain always packs):
    ``input_ids`` / ``labels`` / ``position_ids`` of shape [rows, pack_length], no ``attention_mask``,
    and ``pixel_values`` in the order the samples appear in the rows; at most ``max_images_per_pack``
    images per row. The ``pack_stats`` entry (samples, real tokens, rows, capacity, images) lets the
    Trainer log fill ratio, padding fraction and images per row, packed or not.

    Samples raising :class:`SkipSample` are dropped and counted by reason: the batch's ``skipped``
    entry holds this batch's counts (so they reach the Trainer's log from DataLoader workers too; the
    Trainer keeps the key out of the model's forward), ``self.skipped`` the running total of this
    process; ``skipped_keys`` names each of them (``__key__`` or ``id``). Items already processed
    (dicts with ``input_ids``) pass through unchanged. If EVERY sample of a batch is bad, the batch
    holds only ``skipped``, ``skipped_keys`` and ``pack_stats``: the Trainer counts it and goes on
    (and stops when bad samples pass ``max_bad_sample_fraction``).
    """

    # Takes whole samples (it reads images and texts): vlmtrain.Trainer never trims their columns, whatever
    # remove_unused_columns says (vlmtrain/compat/columns.py).
    keeps_columns = True

    def __init__(self, processor: VLMProcessor, pack_length: int | None = None,
                 max_images_per_pack: int | None = None, min_fill_gain: float = MIN_FILL_GAIN) -> None:
        pad = processor.tokenizer.pad_token_id
        if pad is None:
            raise ValueError("VLMCollator needs a tokenizer with a pad token")
        if pack_length is not None and pack_length < processor.max_length:
            raise ValueError(f"pack_length={pack_length} is shorter than the processor's max_length="
                             f"{processor.max_length}: a sample that fits max_length must fit a pack.")
        if max_images_per_pack is not None and max_images_per_pack < processor.max_images:
            raise ValueError(f"max_images_per_pack={max_images_per_pack} is below max_images="
                             f"{processor.max_images}: a sample with max_images images must fit a pack.")
        self.processor = processor
        self.pack_length, self.max_images_per_pack = pack_length, max_images_per_pack
        self.min_fill_gain = min_fill_gain
        self.pad_token_id = int(pad)
        self.skipped: Counter[str] = Counter()

    def without_packing(self) -> VLMCollator:
        """The same collator with padding instead of packing (what evaluation and prediction use)."""
        if self.pack_length is None:
            return self
        other = copy.copy(self)
        other.pack_length = other.max_images_per_pack = None
        return other

    def _process(self, sample: Any, skipped: Counter[str], keys: list[str]) -> dict[str, Any] | None:
        return process_or_skip(self.processor.process, sample, self.skipped, skipped, keys)

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        if not samples:
            raise ValueError("Cannot collate an empty list of samples.")
        skipped: Counter[str] = Counter()
        keys: list[str] = []
        items = [it for it in (self._process(s, skipped, keys) for s in samples) if it is not None]
        cap = self.max_images_per_pack
        if items and self.pack_length is not None and cap is not None:  # tiles can take a sample past the cap
            over = sum(it["pixel_values"].shape[0] > cap for it in items)
            self.skipped["too_many_images"] += over
            skipped["too_many_images"] += over
            items = [it for it in items if it["pixel_values"].shape[0] <= cap]
        if not items:  # nothing for the model: the Trainer counts the drops and moves on to the next batch
            return {"skipped": dict(+skipped), "skipped_keys": keys, "pack_stats": pack_stats(0, 0, 0, 0, 0)}
        prompts = [torch.as_tensor(it["prompt_input_ids"], dtype=torch.long) for it in items]
        batch: dict[str, Any] = {}
        lengths = [len(it["input_ids"]) for it in items]
        # Views (tiles) are what occupy image-token runs, so they are what a pack's image cap counts.
        views = [it["pixel_values"].shape[0] for it in items]
        bins = pack_lengths(lengths, self.pack_length, views, self.max_images_per_pack) if self.pack_length else []
        if self.pack_length is not None and worth_packing(lengths, len(bins), self.pack_length, self.min_fill_gain):
            batch, bins = pack_items(items, self.pack_length, self.pad_token_id, bins=bins)
            order = [i for members in bins for i in members]
            rows, width = batch["input_ids"].shape
        else:
            order = list(range(len(items)))
            ids = [torch.as_tensor(it["input_ids"], dtype=torch.long) for it in items]
            labels = [torch.as_tensor(it["labels"], dtype=torch.long) for it in items]
            batch["input_ids"] = pad_sequences(ids, self.pad_token_id, side="right")
            batch["attention_mask"] = pad_sequences([torch.ones_like(t) for t in ids], 0, side="right")
            batch["labels"] = pad_sequences(labels, IGNORE_INDEX, side="right")
            rows, width = batch["input_ids"].shape
        batch["pixel_values"] = self._pixels([items[i] for i in order])
        prompt_pixels = batch["pixel_values"] if order == sorted(order) else self._pixels(items)
        n_images = int(batch["pixel_values"].shape[0])
        return {
            **batch,
            "prompt_input_ids": pad_sequences(prompts, self.pad_token_id, side="left"),
            "prompt_attention_mask": pad_sequences([torch.ones_like(t) for t in prompts], 0, side="left"),
            "prompt_pixel_values": prompt_pixels,
            "skipped": dict(+skipped),  # (+: without zero counts)
            "skipped_keys": keys,
            "pack_stats": pack_stats(len(items), sum(lengths), rows, width, n_images),
        }

    def _pixels(self, items: list[dict[str, Any]]) -> torch.Tensor:
        pixels = [it["pixel_values"] for it in items if it["pixel_values"].shape[0]]
        s = self.processor.image_size
        return torch.cat(pixels) if pixels else torch.zeros(0, 3, s, s)
