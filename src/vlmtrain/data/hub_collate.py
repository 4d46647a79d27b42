"""Hub VLM collation: raw the_cauldron samples -> one batch laid out as the family's model expects.

Per-sample tensors come from :class:`~vlmtrain.data.hub_processing.HubVLMProcessor`; how each key is batched
comes from the family's ``batch_layout`` (see :mod:`vlmtrain.models.families.base`). With ``pack_length``
training batches are packed instead (:mod:`vlmtrain.data.hub_packing`: whole samples per row, positions that
restart per sample, Qwen's multimodal positions computed per sample).
"""

from __future__ import annotations

import copy
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from vlmtrain.data.collate import pad_sequences
from vlmtrain.data.hub_packing import pack_hub_items, pad_images
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.data.packing import (
    MIN_FILL_GAIN,
    check_fits_row,
    pack_lengths,
    pack_stats,
    vision_patches,
    worth_packing,
)
from vlmtrain.data.processing import IGNORE_INDEX, process_or_skip

_PASS_THROUGH = ("num_images", "head_labels")


class HubVLMCollator:
    """Processes and batches a list of raw samples for a Hub VLM; bad samples are skipped and counted.

    * ``input_ids`` / ``attention_mask`` / ``labels`` and every ``pad``-layout key (Qwen's
      ``mm_token_type_ids``, Gemma 3's ``token_type_ids``): right-padded with the pad id / 0 / -100 /
      ``family.pad_values`` (default 0);
    * ``concat`` keys (Qwen's ``pixel_values``, ``image_grid_thw``): concatenated in sample order, which is
      placeholder order; ``pad_images`` keys: [B, max images, ...], zero-padded per sample; ``stack`` keys:
      stacked; a callable layout gets the list of per-sample tensors. A key only some samples have (a sample
      without images has no pixels) is built from those that have it (``pad_images``: zeros for the others);
    * ``prompt_*``: the generation prompts with the same layout, but LEFT-padded so new tokens follow directly
      (when the processor makes them; with ``eval_prompts`` only the evaluation twin, :meth:`without_packing`);
    * ``head_labels``: a list with each sample's ``labels`` dict (None where it has none), absent when no
      sample has one; with ``label_collate`` its output (a dict of tensors) is merged into the batch instead.
      A training batch with head labels (``labels_<name>``) but no LM target (every sample score-only) has no
      ``labels``: the model then computes no vocabulary logits (the evaluation twin, :meth:`without_packing`,
      keeps them, as ``score_only_labels`` says). The evaluation twin also keeps a head model's samples that
      have neither an answer nor a head label (training skips them as ``no_target``): they are scored, with
      no loss.

    With ``pack_length`` a training batch is packed (:func:`~vlmtrain.data.hub_packing.pack_hub_items`) when
    that raises its fill by ``min_fill_gain`` (:func:`~vlmtrain.data.packing.worth_packing`; else padded as
    above): rows of ``pack_length`` tokens without ``attention_mask``, ``position_ids`` restarting per sample
    ([4, rows, pack_length] for a family with ``rope_positions``, computed from ``model_config``), at most
    ``max_images_per_pack`` images per row; ``flatten`` joins the rows into one (flash-attention). Packing
    needs batches without head labels. :meth:`collate_rows` packs rows already placed by
    :class:`~vlmtrain.data.pack_stream.PackedDataset` (``data.pack_window``).

    Bookkeeping as :class:`~vlmtrain.data.vlm_collate.VLMCollator`: ``skipped`` (this batch's counts by
    reason), ``skipped_keys`` (each one's name), ``pack_stats`` (rows, capacity, real tokens, images); ``self.skipped``
    is the running total. Already-processed items (dicts with ``input_ids``) pass through. If every sample is bad the
    batch holds only the bookkeeping keys.
    """

    # Takes whole samples (it reads images and texts): vlmtrain.Trainer never trims their columns, whatever
    # remove_unused_columns says (vlmtrain/compat/columns.py).
    keeps_columns = True

    def __init__(self, hub_processor: HubVLMProcessor,
                 label_collate: Callable[[list[dict[str, Any] | None]], dict[str, torch.Tensor]] | None = None,
                 eval_prompts: bool = False, pack_length: int | None = None, model_config: Any = None,
                 max_images_per_pack: int | None = None, flatten: bool = False,
                 min_fill_gain: float = MIN_FILL_GAIN, pad_to_multiple_of: int | None = None,
                 max_patches_per_pack: int | None = None) -> None:
        pad = hub_processor.tokenizer.pad_token_id
        if pad is None:
            raise ValueError(f"HubVLMCollator needs a tokenizer with a pad token ({hub_processor.family.name})")
        self.processor = hub_processor
        self.family = hub_processor.family
        self.label_collate = label_collate
        self.pad_token_id = int(pad)
        self.skipped: Counter[str] = Counter()
        self.score_only_labels = False  # training batches: a score-only batch carries no `labels`
        if pack_length is not None and pack_length < hub_processor.max_length:
            raise ValueError(f"pack_length={pack_length} is shorter than max_length={hub_processor.max_length}: "
                             f"a sample that fits max_length must fit a packed row.")
        if pack_length is not None and self.family.rope_positions is not None and model_config is None:
            raise ValueError(f"packing {self.family.name} needs the model's config (its multimodal positions)")
        self.pack_length, self.model_config = pack_length, model_config
        self.max_images_per_pack, self.flatten, self.min_fill_gain = max_images_per_pack, flatten, min_fill_gain
        self.max_patches_per_pack = max_patches_per_pack
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1 or None, got {pad_to_multiple_of}")
        self.pad_to_multiple_of = pad_to_multiple_of
        evaluation = copy.copy(hub_processor)
        if eval_prompts:  # a prompt is a second processor call per sample: evaluation batches only
            evaluation.prompts = True
        if hub_processor.head_names:  # a model with heads scores unlabelled samples (no loss from them)
            evaluation.head_names = None
        if evaluation.prompts != hub_processor.prompts or evaluation.head_names != hub_processor.head_names:
            self._evaluation = HubVLMCollator(evaluation, label_collate, pad_to_multiple_of=pad_to_multiple_of)
        else:
            self._evaluation = copy.copy(self)
        # Evaluation keeps them: its batches line up label for label with the predictions (and generation).
        self._evaluation.score_only_labels = True
        self._evaluation.pack_length = None  # evaluation and prediction: one sample per row

    def without_packing(self) -> HubVLMCollator:
        """What evaluation and prediction use (padded, one sample per row, never packed): a twin of this collator
        that keeps score-only batches' all -100 `labels`, and with ``eval_prompts`` also the generation prompts,
        which training never reads."""
        return self._evaluation

    def _process(self, sample: Any, skipped: Counter[str], keys: list[str]) -> dict[str, Any] | None:
        return process_or_skip(self.processor.process, sample, self.skipped, skipped, keys)

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        if not samples:
            raise ValueError("Cannot collate an empty list of samples.")
        skipped: Counter[str] = Counter()
        keys: list[str] = []
        items = [it for it in (self._process(s, skipped, keys) for s in samples) if it is not None]
        if not items:  # nothing for the model: the Trainer counts the drops and moves on to the next batch
            return {"skipped": dict(+skipped), "skipped_keys": keys, "pack_stats": pack_stats(0, 0, 0, 0, 0)}
        if self.pack_length is not None:
            lengths = [int(len(it["input_ids"])) for it in items]
            if self.max_patches_per_pack is not None:  # (vision patches per row, not images)
                patches = [vision_patches(it) for it in items]
                check_fits_row(items[patches.index(max(patches))], None, self.max_patches_per_pack)
                bins = pack_lengths(lengths, self.pack_length, patches, self.max_patches_per_pack)
            else:
                bins = pack_lengths(lengths, self.pack_length, [int(it.get("num_images", 0)) for it in items],
                                    self.max_images_per_pack)
            if worth_packing(lengths, len(bins), self.pack_length, self.min_fill_gain):
                return {**self.pack(items, bins), "skipped": dict(+skipped), "skipped_keys": keys}
        batch = self.collate_items(items, side="right")
        if any("prompt_input_ids" in it for it in items):
            prompts = [{k[len("prompt_"):]: v for k, v in it.items() if k.startswith("prompt_")} for it in items]
            batch.update({f"prompt_{k}": v for k, v in self.collate_items(prompts, side="left").items()})
        heads = [it.get("head_labels") for it in items]
        if self.label_collate is not None:
            batch.update(self.label_collate(heads))
        elif any(h is not None for h in heads):
            batch["head_labels"] = heads
        if (not self.score_only_labels and "labels" in batch and any(k.startswith("labels_") for k in batch)
                and not (batch["labels"][:, 1:] != IGNORE_INDEX).any()):
            del batch["labels"]  # score-only samples: no LM target, so the model computes no vocabulary logits
        rows, width = batch["input_ids"].shape
        n_images = sum(int(it.get("num_images", 0)) for it in items)
        lengths = sum(int(len(it["input_ids"])) for it in items)
        return {**batch, "skipped": dict(+skipped), "skipped_keys": keys,
                "pack_stats": pack_stats(len(items), lengths, rows, width, n_images)}

    def pack(self, items: list[dict[str, Any]], bins: list[list[int]]) -> dict[str, Any]:
        """Processed items placed in rows (``bins``: item indices per row) -> a packed batch with ``pack_stats``."""
        self._check_packable(items)
        rope = None
        if self.family.rope_positions is not None:
            rope = functools.partial(self.family.rope_positions, self.model_config)
        batch = pack_hub_items(items, bins, self.pack_length, self.family, self.pad_token_id, rope, self.flatten)
        tokens = sum(int(len(it["input_ids"])) for it in items)
        images = sum(int(it.get("num_images", 0)) for it in items)
        batch["pack_stats"] = pack_stats(len(items), tokens, len(bins), self.pack_length, images)
        return batch

    def _check_packable(self, items: list[dict[str, Any]]) -> None:
        if any(it.get("head_labels") is not None for it in items):
            raise ValueError("packed Hub VLM batches cannot carry head labels (score heads pool one token per "
                             "row); set data.packing: false for a model with heads.")

    def collate_rows(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Rows of :class:`~vlmtrain.data.pack_stream.PackedDataset` (``keep_items``: each row's processed items,
        placed by its window's knapsack) -> one packed batch; skipped counts summed."""
        skipped: Counter[str] = Counter()
        keys: list[str] = []
        for row in rows:
            skipped.update(row.get("skipped", {}))
            keys += row.get("skipped_keys", [])
        groups = [row["items"] for row in rows if row.get("items")]
        bookkeeping = {"skipped": dict(skipped), "skipped_keys": keys}
        if not groups:
            return {**bookkeeping, "pack_stats": pack_stats(0, 0, 0, 0, 0)}
        items = [it for group in groups for it in group]
        bins, at = [], 0
        for group in groups:
            bins.append(list(range(at, at + len(group))))
            at += len(group)
        return {**self.pack(items, bins), **bookkeeping}

    def collate_items(self, items: list[dict[str, Any]], side: str = "right") -> dict[str, Any]:
        """Batch per-sample tensors by the family's layout (``side``: where 'pad' keys are padded)."""
        layout = self.family.batch_layout
        pad_values = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX,
                      **self.family.pad_values}
        names = [k for k in dict.fromkeys(k for it in items for k in it)
                 if not k.startswith("prompt_") and k not in _PASS_THROUGH]
        batch: dict[str, Any] = {}
        for key in names:
            values = [it.get(key) for it in items]
            present = [torch.as_tensor(v) for v in values if v is not None]
            how = "pad" if key in ("input_ids", "attention_mask", "labels") else layout.get(key)
            if how is None:  # undeclared: per-token if as long as input_ids, else stacked
                same = all(v is not None and v.ndim >= 1 and len(v) == len(it["input_ids"])
                           for v, it in zip(values, items))
                how = "pad" if same else "stack"
            if callable(how):
                batch[key] = how(present)
            elif how == "concat":
                batch[key] = torch.cat(present)
            elif how == "pad":
                if len(present) != len(items):
                    raise ValueError(f"per-token key {key!r} is missing from some samples")
                batch[key] = pad_sequences(present, pad_values.get(key, 0), side=side,
                                           multiple=self.pad_to_multiple_of)
            elif how == "pad_images":
                batch[key] = pad_images(values, present[0])
            elif how == "stack":
                if len(present) != len(items):
                    raise ValueError(f"key {key!r} (layout 'stack') is missing from some samples")
                batch[key] = torch.stack(present)
            else:
                raise ValueError(f"family {self.family.name!r}: unknown batch layout {how!r} for key {key!r}")
        return batch
