"""Window packing: a stream of samples -> a stream of full rows of ``pack_length`` tokens (fill >= 0.97).

Packing one batch's own samples (:class:`~vlmtrain.data.vlm_collate.VLMCollator` with ``pack_length``)
keeps a step's samples exactly but leaves the last row of every batch part empty. :class:`PackedDataset`
instead processes ``window`` consecutive samples at a time, packs them together (the same knapsack and
per-sample masking, :mod:`vlmtrain.data.packing`) and yields the rows one by one, so
``per_device_train_batch_size`` counts rows of ``pack_length`` tokens and a step holds as many samples
as fit. Only each window's last row is partial.

Resume is exact and costs one window: the state is the underlying stream's state at the start of the
current window plus the number of its rows already yielded; a resumed reader re-reads that window (never
more), re-packs it identically and skips those rows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from vlmtrain.data.packing import check_fits_row, pack_items, pack_lengths, pack_stats, vision_patches
from vlmtrain.data.processing import SkipSample, sample_name
from vlmtrain.data.sources import drop_counts, is_counts_only


class PackedDataset(IterableDataset):
    """Rows packed from ``stream`` (an iterable dataset with ``state_dict``/``load_state_dict``, e.g.
    :class:`~vlmtrain.data.sources.StreamingDataset`), ``window`` samples at a time.

    ``process`` turns a raw sample into ``input_ids``/``labels`` (+ ``pixel_values`` for a VLM) and may raise
    :class:`SkipSample`; the counts ride on the next row's ``skipped``. Each row is a dict: ``input_ids``,
    ``labels``, ``position_ids`` [pack_length], ``pixel_values`` [images, 3, S, S] (VLM), ``skipped``,
    ``skipped_keys`` and ``pack_stats`` (a one-row layout record); :func:`collate_rows` stacks them. With
    ``keep_items`` a row instead holds ``items``, the processed samples placed in it (in row order), for a
    collator that lays rows out itself (a Hub VLM's ``collate_rows``); ``pad_token_id`` is then unused.
    """

    def __init__(self, stream: Any, process: Callable[[dict[str, Any]], dict[str, Any]], pack_length: int,
                 pad_token_id: int | None, window: int = 256, max_images_per_pack: int | None = None,
                 keep_items: bool = False, max_patches_per_pack: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if max_patches_per_pack is not None and (max_images_per_pack is not None or not keep_items):
            raise ValueError("max_patches_per_pack (a Hub VLM's rows, keep_items) replaces max_images_per_pack")
        self.stream, self.process, self.pack_length = stream, process, pack_length
        self.pad_token_id, self.window, self.max_images_per_pack = pad_token_id, window, max_images_per_pack
        self.max_patches_per_pack = max_patches_per_pack
        self.keep_items = keep_items
        self._window_start: dict[str, Any] | None = None
        self._rows_done = 0
        self._resume: tuple[dict[str, Any], int] | None = None

    def set_epoch(self, epoch: int) -> None:
        if self._resume is not None and self._resume[0].get("epoch", epoch) != epoch:
            # a checkpoint's place in an epoch that ended unread (its last batch was partial: the loader had nothing
            # left to ask for), as the stream forgets its own
            self._resume = None
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip = 0
        if self._resume is not None:
            start, skip = self._resume
            self.stream.load_state_dict(start)
            self._resume = None
        samples = iter(self.stream)
        while True:
            self._window_start, self._rows_done = None, 0
            start = self.stream.state_dict()  # the stream's place before this window (live, same process)
            items, skipped, keys = self._take_window(samples)
            if not items and not skipped:
                return
            self._window_start = start
            for row in self._rows(items, skipped, keys)[skip:]:
                self._rows_done += 1
                yield row
            self._rows_done = 0
            skip = 0

    def _take_window(self, samples: Iterator[dict[str, Any]]) -> tuple[list[dict], Counter[str], list[str]]:
        items, skipped, keys = [], Counter(), []
        for _ in range(self.window):
            sample = next(samples, None)
            if sample is None:
                break
            skipped.update(drop_counts(sample))
            if is_counts_only(sample):  # the end of a stream: its counts, no sample
                continue
            try:
                item = self.process(sample)
            except SkipSample as err:
                skipped[err.reason] += 1
                keys.append(f"{sample_name(sample)} ({err.reason})")
                continue
            if "pixel_values" in item and not self.keep_items:  # views (tiles) occupy image-token runs
                item = {**item, "num_images": item["pixel_values"].shape[0]}
            check_fits_row(item, self.pack_length, self.max_patches_per_pack, f"sample {sample_name(sample)}")
            items.append(item)
        return items, skipped, keys

    def _rows(self, items: list[dict], skipped: Counter[str], keys: list[str]) -> list[dict[str, Any]]:
        if not items:  # a window of bad samples only: one empty row carries the counts
            return [{"skipped": dict(skipped), "skipped_keys": keys, "pack_stats": pack_stats(0, 0, 0, 0, 0)}]
        if self.keep_items:
            lengths = [len(it["input_ids"]) for it in items]
            images = [int(it.get("num_images", 0) or 0) for it in items]
            if self.max_patches_per_pack is not None:  # (the second resource: vision patches, not images)
                bins = pack_lengths(lengths, self.pack_length, [vision_patches(it) for it in items],
                                    self.max_patches_per_pack)
            else:
                bins = pack_lengths(lengths, self.pack_length, images, self.max_images_per_pack)
            return [{"items": [items[i] for i in members], "skipped": dict(skipped) if r == 0 else {},
                     "skipped_keys": keys if r == 0 else [],
                     "pack_stats": pack_stats(len(members), sum(lengths[i] for i in members), 1, self.pack_length,
                                              sum(images[i] for i in members))}
                    for r, members in enumerate(bins)]
        batch, bins = pack_items(items, self.pack_length, self.pad_token_id, self.max_images_per_pack)
        vlm = any("pixel_values" in it for it in items)
        rows: list[dict[str, Any]] = []
        for r, members in enumerate(bins):
            pixels = [items[i]["pixel_values"] for i in members] if vlm else []
            row = {"input_ids": batch["input_ids"][r], "labels": batch["labels"][r],
                   "position_ids": batch["position_ids"][r],
                   "skipped": dict(skipped) if r == 0 else {}, "skipped_keys": keys if r == 0 else [],
                   "pack_stats": pack_stats(len(members), sum(len(items[i]["input_ids"]) for i in members), 1,
                                            self.pack_length, sum(int(p.shape[0]) for p in pixels))}
            if vlm:
                row["pixel_values"] = torch.cat(pixels)
            rows.append(row)
        return rows

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._window_start is None:  # between windows: the stream's own place is exact
            return {"window_start": self.stream.state_dict(), "rows_done": 0}
        return {"window_start": self._window_start, "rows_done": self._rows_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = (state["window_start"], int(state["rows_done"]))


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack :class:`PackedDataset` rows into a batch (skipped counts and layout records summed)."""
    skipped: Counter[str] = Counter()
    keys: list[str] = []
    layout: Counter[str] = Counter()
    for row in rows:
        skipped.update(row.get("skipped", {}))
        keys += row.get("skipped_keys", [])
        layout.update(row["pack_stats"])
    real = [row for row in rows if "input_ids" in row]
    batch: dict[str, Any] = {"skipped": dict(skipped), "skipped_keys": keys, "pack_stats": dict(layout)}
    if not real:
        return batch
    for key in ("input_ids", "labels", "position_ids"):
        batch[key] = torch.stack([row[key] for row in real])
    if "pixel_values" in real[0]:
        batch["pixel_values"] = torch.cat([row["pixel_values"] for row in real])
    return batch


class RowCollator:
    """Collates :class:`PackedDataset` rows for training (``collate``, default :func:`collate_rows`); evaluation
    and prediction use ``eval_collator`` (samples padded one per row), what :meth:`without_packing` returns."""

    # Takes whole samples (rows of PackedDataset): vlmtrain.Trainer never trims their columns, whatever
    # remove_unused_columns says (vlmtrain/compat/columns.py).
    keeps_columns = True

    def __init__(self, eval_collator: Any, collate: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None
                 ) -> None:
        self.eval_collator = eval_collator
        self.collate = collate or collate_rows

    def without_packing(self) -> Any:
        return self.eval_collator

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return self.collate(rows)
