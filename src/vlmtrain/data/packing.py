"""Packing: several samples per fixed-length row, each sample seeing only itself.

A batch's samples are placed into rows of ``pack_length`` tokens by a best-fit-decreasing knapsack
(optionally with a cap on images per row). Each sample keeps its own positions (they restart at 0),
its first label is -100 (no target crosses a boundary) and no ``attention_mask`` is passed: the
decoder derives a block-diagonal causal mask from the restarting ``position_ids`` (transformers'
masking utilities do this for SDPA / eager / flex; flash-attention varlen uses them as cu_seqlens).
They do so only without a KV cache, so packed batches carry ``use_cache=False``.
:func:`check_packing` proves that on the actual model before a run relies on it.

Packing rearranges the samples of one batch and nothing else: the loss (mean over real targets),
the sampler, the data order and so exact resume are exactly those of the padded batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def pack_lengths(lengths: Sequence[int], capacity: int, images: Sequence[int] | None = None,
                 max_images: int | None = None) -> list[list[int]]:
    """Group item indices into bins of at most ``capacity`` tokens (and ``max_images`` images).

    Best-fit decreasing over both resources: items by decreasing size (tokens / capacity, plus
    images / max_images under an image cap), each into the open bin it leaves with the least room
    (the two normalized remainders summed), else a new bin. Deterministic (ties keep input order);
    bins come out ordered by their first item's index and list their items in index order, so a
    packed batch reads in the sampler's order.
    """
    images = list(images) if images is not None else [0] * len(lengths)
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"item {i} has {n} tokens, more than the pack length {capacity}; "
                             f"set max_length <= pack_length so such samples are dropped as too_long.")
        if max_images is not None and images[i] > max_images:
            raise ValueError(f"item {i} has {images[i]} images, more than max_images_per_pack={max_images}.")
    img_cap = float("inf") if max_images is None else max_images
    img_weight = 0.0 if max_images is None else 1.0 / max(max_images, 1)
    order = sorted(range(len(lengths)), key=lambda i: (-(lengths[i] / capacity + images[i] * img_weight), i))
    bins: list[list[int]] = []
    room: list[int] = []
    room_images: list[float] = []
    for i in order:
        best, best_slack = -1, 0.0
        for b in range(len(bins)):
            if room[b] >= lengths[i] and room_images[b] >= images[i]:
                slack = (room[b] - lengths[i]) / capacity + (
                    (room_images[b] - images[i]) * img_weight if max_images is not None else 0.0)
                if best < 0 or slack < best_slack:
                    best, best_slack = b, slack
        if best < 0:
            bins.append([])
            room.append(capacity)
            room_images.append(img_cap)
            best = len(bins) - 1
        bins[best].append(i)
        room[best] -= lengths[i]
        room_images[best] -= images[i]
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def pack_items(items: Sequence[dict[str, Any]], pack_length: int, pad_token_id: int,
               max_images_per_pack: int | None = None,
               bins: list[list[int]] | None = None) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Pack processed items (``input_ids``, ``labels``; ``num_images`` optional) into [rows, pack_length].

    Returns the tensors (``input_ids``, ``labels``, ``position_ids``) and each row's items in the order
    they appear (read row by row, the order their images must follow). Padding at the end of a row is
    its own run of positions (so it forms its own block) with labels -100. ``bins``: a placement already
    computed by :func:`pack_lengths` for these items.
    """
    lengths = [int(len(it["input_ids"])) for it in items]
    if bins is None:
        images = [int(it.get("num_images", 0) or 0) for it in items]
        bins = pack_lengths(lengths, pack_length, images, max_images_per_pack)
    rows = len(bins)
    input_ids = torch.full((rows, pack_length), pad_token_id, dtype=torch.long)
    labels = torch.full((rows, pack_length), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((rows, pack_length), dtype=torch.long)
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            n = lengths[i]
            input_ids[r, at:at + n] = torch.as_tensor(items[i]["input_ids"], dtype=torch.long)
            labels[r, at:at + n] = torch.as_tensor(items[i]["labels"], dtype=torch.long)
            labels[r, at] = IGNORE_INDEX  # the previous sample's last token never predicts this one
            position_ids[r, at:at + n] = torch.arange(n)
            at += n
        position_ids[r, at:] = torch.arange(pack_length - at)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}, bins


def vision_patches(item: dict[str, Any]) -> int:
    """A processed Hub VLM sample's vision patches (Qwen-VL: the sum over ``image_grid_thw`` and
    ``video_grid_thw`` of t x h x w)."""
    grids = [item.get(k) for k in ("image_grid_thw", "video_grid_thw")]
    return sum(int(torch.as_tensor(g).reshape(-1, 3).prod(-1).sum()) for g in grids if g is not None)


def check_fits_row(item: dict[str, Any], pack_length: int | None, max_patches_per_pack: int | None,
                   name: str = "a sample") -> None:
    """A sample one packed row cannot hold, in tokens (over ``pack_length``) or vision patches (over
    ``max_patches_per_pack``), is a ValueError naming it (``name``) and the setting; None: no limit."""
    patches = vision_patches(item)
    for what, size, cap, key in (("tokens", len(item["input_ids"]), pack_length, "pack_length"),
                                 ("vision patches", patches, max_patches_per_pack, "max_patches_per_pack")):
        if cap is not None and size > cap:
            raise ValueError(f"{name} has {size} {what}, more than data.{key}={cap}: one sample must fit one packed "
                             f"row.")


MIN_FILL_GAIN = 0.05


def worth_packing(lengths: Sequence[int], rows: int, pack_length: int, min_gain: float = MIN_FILL_GAIN) -> bool:
    """Whether packing ``lengths`` into ``rows`` rows raises the batch's fill by at least ``min_gain`` over
    padding to the longest sample. Near-uniform lengths pad densely already, and padded rows keep the
    cheaper causal-only attention (a packed row attends over the whole row length behind its mask)."""
    total = sum(lengths)
    return total / (rows * pack_length) >= total / (len(lengths) * max(lengths)) + min_gain


def pack_stats(num_samples: int, real_tokens: int, rows: int, row_length: int, images: int) -> dict[str, int]:
    """What a collator reports about a batch's layout (the Trainer logs fill, padding, images per row)."""
    return {"samples": num_samples, "tokens": real_tokens, "rows": rows, "capacity": rows * row_length,
            "images": images}


@torch.no_grad()
def check_packing(model: torch.nn.Module, vocab_size: int, lengths: Sequence[int] = (5, 3)) -> float:
    """Largest |logit difference| between short random sequences run packed in one row and run alone.

    Packing relies on the decoder turning restarting ``position_ids`` into a per-sample mask; a model
    that ignores them would let packed samples see each other. Run this once on the real model (it
    costs one forward of a few tokens): a result above ~1e-4 means packing is not safe for it.
    """
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        gen = torch.Generator().manual_seed(0)
        image_token = getattr(getattr(model, "config", None), "image_token_id", None)
        seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
        if image_token is not None:  # text only: a stray image placeholder would need pixel values
            seqs = [torch.where(s == image_token, (s + 1) % vocab_size, s) for s in seqs]
        ids = torch.cat(seqs)[None].to(device)
        pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        packed = _logits(model(input_ids=ids, position_ids=pos, use_cache=False))[0]
        worst, at = 0.0, 0
        for s in seqs:
            alone = _logits(model(input_ids=s[None].to(device), attention_mask=torch.ones_like(s)[None].to(device),
                                  use_cache=False))[0]
            worst = max(worst, float((packed[at:at + len(s)].float() - alone.float()).abs().max()))
            at += len(s)
        return worst
    finally:
        model.train(was_training)


def _logits(out: Any) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out.logits


class PackingCollator:
    """Packs tokenized samples (``input_ids``, optional ``labels``; lists or 1-D tensors) for a plain LM.

    A batch is packed only when that raises its fill by ``min_fill_gain`` (:func:`worth_packing`); else
    it is padded. Packed training batches are ``input_ids`` / ``labels`` / ``position_ids`` of shape [rows, pack_length],
    ``use_cache=False`` (a transformers LM only builds the per-sample mask without a cache) and
    ``pack_stats``; samples without ``labels`` are trained on every token. Evaluation and
    prediction use ``padding_collator`` (what :meth:`without_packing` returns), so predictions stay
    one row per sample. A sample longer than ``pack_length`` is an error naming it.
    """

    @property
    def keeps_columns(self) -> bool:
        """Whether vlmtrain.Trainer leaves the samples' columns alone (remove_unused_columns does not apply): as
        the padding collator says (packing itself reads only input_ids and labels)."""
        return bool(getattr(self.padding_collator, "keeps_columns", False))

    def __init__(self, pack_length: int, pad_token_id: int, padding_collator: Any = None,
                 min_fill_gain: float = MIN_FILL_GAIN) -> None:
        if pack_length < 2:
            raise ValueError(f"pack_length must be >= 2, got {pack_length}")
        self.pack_length, self.pad_token_id = pack_length, int(pad_token_id)
        self.padding_collator, self.min_fill_gain = padding_collator, min_fill_gain

    def without_packing(self) -> Any:
        if self.padding_collator is None:
            from vlmtrain.data.collate import DefaultCollator

            return DefaultCollator(self.pad_token_id)
        return self.padding_collator

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        if not samples:
            raise ValueError("Cannot collate an empty list of samples.")
        items = []
        for s in samples:
            ids = torch.as_tensor(s["input_ids"], dtype=torch.long)
            labels = torch.as_tensor(s["labels"], dtype=torch.long) if "labels" in s else ids
            items.append({"input_ids": ids, "labels": labels})
        lengths = [len(it["input_ids"]) for it in items]
        bins = pack_lengths(lengths, self.pack_length)
        if not worth_packing(lengths, len(bins), self.pack_length, self.min_fill_gain):
            batch = dict(self.without_packing()(samples))
            batch["pack_stats"] = pack_stats(len(items), sum(lengths), len(items), max(lengths), 0)
            return batch
        batch: dict[str, Any]
        batch, _ = pack_items(items, self.pack_length, self.pad_token_id)
        batch["use_cache"] = False
        batch["pack_stats"] = pack_stats(len(items), sum(lengths), len(bins), self.pack_length, 0)
        return batch
