"""Preference pairs with images for a Hub VLM's `train.objective: dpo` (YAML config): each pair, in vlmtrain's
own layout or TRL's (data/pairs.py), is checked and turned into TRL 1.16's vision DPO layout (message lists,
the pair's images loaded once, first in the first user turn), and a batch is laid out by the same
:class:`~vlmtrain.data.preference_vision.VisionPreferenceCollator` as vlmtrain.DPOTrainer's: one processor call
over the B prompts with their images, each pair's images once (the objective's one vision pass per pair)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
from .hub_messages import build_messages, check_texts, sample_videos
from .pairs import ANSWERS, carry_ref_logps, check_pair
from .preference_vision import ANSWER_IMAGES, VisionPreferenceCollator, answer_has_images
from .processing import SkipSample, load_image, process_or_skip


def vision_pair(sample: Mapping[str, Any], max_images: int) -> dict[str, Any]:
    """A raw pair as TRL's vision layout with its images loaded (SkipSample for a bad pair, an unreadable image,
    or more than ``max_images`` images); its ``videos`` kept as they are."""
    check_pair(sample)
    if answer_has_images(sample):
        raise SkipSample("placeholder_in_assistant", ANSWER_IMAGES)
    images = sample.get("images") or ([sample["image"]] if sample.get("image") is not None else [])
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(images) > max_images:
        raise SkipSample("too_many_images", f"{len(images)} images > data.max_images={max_images}")
    loaded = [load_image(im) for im in images]
    extra = {"labels": sample["labels"]} if sample.get("labels") is not None else {}  # (score heads' labels)
    videos = sample_videos(sample)
    if videos:
        extra["videos"] = videos
    if "prompt" in sample:
        return {**{k: sample[k] for k in ("prompt", *ANSWERS)}, "images": loaded, **extra}
    return {"prompt": _own_prompt(sample, len(loaded)),
            **{k: [{"role": "assistant", "content": sample[k]}] for k in ANSWERS}, "images": loaded, **extra}


def _own_prompt(sample: Mapping[str, Any], n_images: int) -> list[dict[str, Any]]:
    """The messages of an own-layout pair's turns, its images placed as SFT places a sample's
    (data/hub_messages.py): at their ``<image>`` placeholders, else first in the first user turn; a placeholder
    count other than ``n_images``, or one in an answer, is a SkipSample."""
    turns = [(t["user"], t.get("assistant")) for t in sample["texts"]]
    for key in ANSWERS:  # (each answer checked as the last turn's)
        check_texts([*turns[:-1], (turns[-1][0], sample[key])], n_images, None)
    messages = build_messages(turns, [None] * n_images)
    # (image parts as TRL's: the pair's images are its "images", in order)
    return [{**m, "content": [{"type": "image"} if b["type"] == "image" else b for b in m["content"]]}
            for m in messages]


class FittingPairCollator:
    """Pairs with images -> one pair batch of ``layout`` (a VisionPreferenceCollator that pads: B chosen rows, then
    B rejected rows; cut at its ``max_length``, keep_start), less the pairs whose prompt fills ``max_length`` (no
    answer token left, or its image tokens cut: skipped and counted as ``prompt_fills_max_length``, as TRL drops
    such text pairs); packed into one row afterwards with ``padding_free``. ``process``: a sample -> the pair the
    layout reads (SkipSample for a bad one). Skips ride in the batch as the Trainer's bookkeeping keys
    (``report_always``: also when none)."""

    keeps_columns = True  # (it reads the raw pairs: the Trainer keeps every column)
    report_always = False

    def __init__(self, layout: VisionPreferenceCollator, padding_free: bool = False) -> None:
        self.layout, self.padding_free = layout, padding_free
        self.skipped: Counter[str] = Counter()

    def process(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        return dict(sample)

    def check(self, sample: Mapping[str, Any]) -> None:
        """A SkipSample where ``sample`` would not train: its processing skips it, or its prompt fills
        ``max_length`` (what precompute_ref_log_probs leaves out before its pass)."""
        if not self._fits(self.process(sample)):
            raise SkipSample("prompt_fills_max_length", f"the prompt fills max_length={self.layout.max_length}")

    def _batch(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return self.layout(items)

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        skipped: Counter[str] = Counter()
        keys: list[str] = []
        items = [carry_ref_logps(it, s) for it, s in
                 ((process_or_skip(self.process, s, self.skipped, skipped, keys), s) for s in samples)
                 if it is not None]
        batch = self._laid_out(items, skipped) if items else None
        if batch is not None and not skipped and not self.report_always:
            return batch
        bookkeeping = {"skipped": dict(+skipped), "skipped_keys": keys}
        return {**batch, **bookkeeping} if batch is not None else bookkeeping

    def _laid_out(self, items: list[dict[str, Any]], skipped: Counter[str]) -> dict[str, Any] | None:
        """The batch of ``items`` less the pairs whose prompt fills ``max_length``; those are found pair by pair
        only in a batch that has one."""
        try:
            batch = self._batch(items)
            if self.layout.max_length is None or batch["completion_mask"].sum(dim=1).all():
                return self._packed(batch, items)
        except ConfigError:  # (a cut through a prompt's image tokens)
            pass
        kept = [it for it in items if self._fits(it)]
        for _ in range(len(items) - len(kept)):
            self.skipped["prompt_fills_max_length"] += 1
            skipped["prompt_fills_max_length"] += 1
        return self._packed(self._batch(kept), kept) if kept else None

    def _packed(self, batch: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
        return self.layout.pack(batch, items) if self.padding_free else batch

    def _fits(self, item: dict[str, Any]) -> bool:
        try:
            return bool(self.layout([item])["completion_mask"].sum(dim=1).all())
        except ConfigError:
            return False


class HubPairCollator(FittingPairCollator):
    """Raw pairs with images (vlmtrain's layout or TRL's) -> a FittingPairCollator's pair batch, each pair checked
    and turned into TRL's vision layout first (:func:`vision_pair`). Score heads beside DPO: ``label_check`` (a
    pair's ``labels`` -> SkipSample for a bad one) and ``label_collate`` (the pairs' ``labels`` ->
    ``labels_<head>`` tensors, one row per pair). ``video``: the family's video support (a pair's videos decoded
    once, when it is processed; a pair with videos is skipped as ``video_unsupported`` without it).
    ``padding_free`` (data.packing): the batch packed into one row once its pairs are checked (``rope_positions``:
    as VisionPreferenceCollator's)."""

    report_always = True

    def __init__(self, processor: Any, max_length: int | None, max_images: int,
                 label_check: Callable[[Any], None] | None = None,
                 label_collate: Callable[[list[Any]], dict[str, Any]] | None = None, video: Any = None,
                 padding_free: bool = False, rope_positions: Callable[[dict[str, Any]], Any] | None = None) -> None:
        # (the layout pads: the checks read each row; the batch is packed after them)
        super().__init__(VisionPreferenceCollator(processor, max_length, video=video, rope_positions=rope_positions),
                         padding_free)
        self.processor, self.tokenizer, self.max_images = processor, processor.tokenizer, max_images
        self.label_check, self.label_collate = label_check, label_collate

    def process(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        if self.label_check is not None:
            self.label_check(sample.get("labels"))
        pair = vision_pair(sample, self.max_images)
        if "videos" in pair and self.layout.video is None:
            raise SkipSample("video_unsupported", "a pair with videos, for a family without video support")
        if "videos" in pair:
            pair["videos"] = self.layout.clips(pair)  # (decoded here: a bad clip is this pair's skip)
        return pair

    def _batch(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.layout(items)
        if self.label_collate is not None:
            batch.update(self.label_collate([it.get("labels") for it in items]))
        return batch

    def token_ids(self, item: Mapping[str, Any]) -> dict[str, list[int]]:
        """A processed pair's ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` as its batch row lays them out
        (the prompt's image tokens expanded): what `vlmtrain data inspect --config` shows."""
        batch = self.layout([dict(item)])
        rows = {}
        for r, side in enumerate(ANSWERS):
            ids, kept, answer = (batch[k][r] for k in ("input_ids", "attention_mask", "completion_mask"))
            rows[f"{side}_ids"] = ids[answer.bool()].tolist()
            rows["prompt_ids"] = ids[kept.bool() & ~answer.bool()].tolist()
        return rows
