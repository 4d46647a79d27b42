"""Preference pairs with images, as TRL 1.16's DPOTrainer reads them, batched so that each pair's images are
encoded once.

A sample is ``prompt`` / ``chosen`` / ``rejected`` (message lists whose user turns hold ``{"type": "image"}``
parts, or plain strings that already hold the processor's image placeholder) and ``images`` (or one ``image``).
:class:`VisionPreferenceCollator` renders each pair with the processor's chat template (the answer is what
prompt + answer renders beyond the prompt, as TRL splits it), runs the processor over the B prompts with their
images (one processor call: pixel inputs in the processor's own layout) and the tokenizer over the answers, and
lays the batch out as one forward of 2B rows: the B chosen rows, then the B rejected rows, each prompt + answer
(the prompt's image placeholder tokens included), right-padded. The pixel inputs are the B prompts' images,
once, under ``vision_<key>`` (``vision_pixel_values``, ``vision_image_grid_thw``, ...: what
``get_image_features`` takes); ``image_token_index`` says, for each image placeholder token of the 2B rows in
order, which token of the prompts' concatenated image features it shows, so that the model side
(models/objectives/vision_pairs.py) encodes the images once and gives each row its prompt's features.
Per-image processor outputs the language model reads for the rows' own positions (Qwen's ``image_grid_thw``,
for its multimodal rotary positions) come once per row image under their own name.

With ``padding_free`` the 2B rows are packed into one in the same order (data/pair_packing.py): as
``image_token_index`` names each placeholder token's source feature in row order, the vision inputs stay as
they are, and each sequence gets its own positions (Qwen's multimodal rotary positions from ``rope_positions``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .hub_messages import sample_videos
from .pair_packing import pack_pair_rows
from .preference import REF_LOGPS_COLUMNS, is_conversational
from .video import VideoClip, load_planned

VISION_PREFIX = "vision_"
"""The B prompts' pixel inputs (each image once) are batch keys ``vision_<processor key>``."""
ROW_IMAGE_KEYS = ("image_grid_thw",)
"""Per-image processor outputs the language model reads for each row's images besides their features."""
ROW_TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")
"""Per-token processor outputs of a prompt that extend over the rows (0 on answer tokens)."""
VIDEO_PREFIX = "videos_"
"""The B prompts' video inputs (each video once) are batch keys ``videos_<processor key>`` (what
``get_video_features`` takes: :data:`VIDEO_ENCODER_KEYS`)."""
VIDEO_ENCODER_KEYS = ("pixel_values_videos", "video_grid_thw")
ROW_VIDEO_KEYS = ("video_grid_thw", "second_per_grid_ts")
"""Per-video processor outputs the language model reads for each row's videos (Qwen's rotary positions)."""


def is_vision_pairs(sample: Mapping[str, Any]) -> bool:
    """Whether a pair carries images (an ``images`` or ``image`` column, as TRL decides a dataset is visual) or
    videos (``videos`` or ``video``: vlmtrain's layout, as SFT samples hold them)."""
    return any(k in sample for k in ("images", "image", "videos", "video"))


def _images_of(sample: Mapping[str, Any]) -> list[Any]:
    if "image" in sample and "images" not in sample:
        return [] if sample["image"] is None else [sample["image"]]
    return list(sample.get("images") or [])


def _parts(content: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _with_image_parts(messages: Sequence[Mapping[str, Any]], n_images: int, n_videos: int = 0
                      ) -> list[dict[str, Any]]:
    """Messages with list content; where no message has an image part, ``n_images`` image parts go first in the
    first user turn (TRL's convention for string content); so do ``n_videos`` video parts, before the images
    (as SFT places them)."""
    out = [{**m, "content": _parts(m.get("content") or "")} for m in messages]
    missing = [{"type": kind} for kind, n in (("video", n_videos), ("image", n_images))
               if not any(p.get("type") == kind for m in out for p in m["content"]) for _ in range(n)]
    if missing:
        first_user = next(i for i, m in enumerate(out) if m["role"] == "user")
        out[first_user]["content"] = missing + out[first_user]["content"]
    return out


def _common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def answer_has_images(sample: Mapping[str, Any]) -> bool:
    """Whether a pair's ``chosen`` or ``rejected`` messages hold an image part (TRL's message lists allow one in any
    turn): both answers answer one prompt, and the pair's images are that prompt's (encoded once for both)."""
    return any(isinstance(m, Mapping) and not isinstance(m.get("content"), str)
               and any(isinstance(p, Mapping) and p.get("type") == "image" for p in m.get("content") or [])
               for key in ("chosen", "rejected") if isinstance(sample.get(key), list) for m in sample[key])


ANSWER_IMAGES = ("an image in its 'chosen' or 'rejected' messages: the images of a pair belong to its prompt, "
                 "which both answers share; move them to the prompt's user turn")


def render_pair(sample: Mapping[str, Any], processor: Any) -> tuple[str, str, str]:
    """The prompt, chosen and rejected texts of a pair. A conversation is rendered by the processor's chat template
    (the prompt with the generation prompt, or continuing a final assistant turn); the prompt is then cut to what
    prompt + chosen and prompt + rejected start with, and each answer is the rest of its rendering."""
    for key in ("prompt", "chosen", "rejected"):
        if sample.get(key) is None:
            raise ConfigError(f"a preference pair without {key!r} (it has {sorted(sample)}): each pair needs "
                              "'prompt', 'chosen' and 'rejected'.")
    if not is_conversational(sample):
        return sample["prompt"], sample["chosen"], sample["rejected"]
    if answer_has_images(sample):
        raise ConfigError(f"a preference pair with {ANSWER_IMAGES}.")
    prompt = _with_image_parts(sample["prompt"], len(_images_of(sample)), len(sample_videos(sample)))
    chosen, rejected = _with_image_parts(sample["chosen"], 0), _with_image_parts(sample["rejected"], 0)
    ends_with_answer = prompt[-1]["role"] == "assistant"
    prompt_text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=not ends_with_answer,
                                                continue_final_message=ends_with_answer)
    with_chosen = processor.apply_chat_template(prompt + chosen, tokenize=False)
    with_rejected = processor.apply_chat_template(prompt + rejected, tokenize=False)
    prompt_text = _common_prefix(_common_prefix(prompt_text, with_chosen), with_rejected)
    return prompt_text, with_chosen[len(prompt_text):], with_rejected[len(prompt_text):]


def _placeholder_id(processor: Any, kind: str) -> int:
    """The id of the ``kind`` (image / video) placeholder token: the tokenizer's where it names one, else the
    processor's."""
    token_id = getattr(processor.tokenizer, f"{kind}_token_id", None)
    if token_id is None:
        token_id = getattr(processor, f"{kind}_token_id", None)
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(getattr(processor, f"{kind}_token"))
    return int(token_id)


def video_token_id(processor: Any) -> int:
    """The id of the token a video's features replace."""
    return _placeholder_id(processor, "video")


def image_token_id(processor: Any) -> int:
    """The id of the token the image features replace: the tokenizer's image token where it names one (Gemma 3's
    processor's own ``image_token`` is the start-of-image marker), else the processor's."""
    return _placeholder_id(processor, "image")


@dataclass
class VisionPreferenceCollator:
    """A batch of pairs with images as one forward of 2B rows (B chosen, then B rejected) whose images are each
    given once (see the module docstring). ``max_length`` cuts rows at the end (``keep_start``, the only mode
    TRL allows with images); a cut through a prompt's image placeholder tokens is an error naming it.
    ``image_token_id``: the token the model's image features replace (its config's; default
    :func:`image_token_id`). ``padding_free``: the rows packed into one (``rope_positions``: one sequence -> its
    [3, n] multimodal rotary positions, for a family that has them). ``video``: the family's video support
    (``Family.video(processor, settings)``) for pairs with ``videos`` (each a file, frames, or a decoded
    :class:`~vlmtrain.data.video.VideoClip`): each pair's videos decoded and given once, as its images are
    (``video_token_index``, ``videos_*``)."""

    processor: Any
    max_length: int | None = None
    image_token_id: int | None = None
    padding_free: bool = False
    rope_positions: Callable[[dict[str, Any]], torch.Tensor] | None = None
    video: Any = None

    def __call__(self, samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        tokenizer = self.processor.tokenizer
        texts = [render_pair(s, self.processor) for s in samples]
        images = [_images_of(s) for s in samples]
        clips = [self.clips(s) for s in samples]
        processor, videos = video_call(self.processor, self.video, [c for pair in clips for c in pair])
        prompts = processor(text=[t[0] for t in texts], images=images if any(images) else None,
                            padding=True, return_tensors="pt", add_special_tokens=False, **videos)
        answers = {side: tokenizer([t[i] for t in texts], add_special_tokens=False)["input_ids"]
                   for i, side in ((1, "chosen"), (2, "rejected"))}
        keep = prompts["attention_mask"].bool()
        prompt_ids = [row[m].tolist() for row, m in zip(prompts["input_ids"], keep)]
        token_keys = [k for k in ROW_TOKEN_KEYS if k in prompts]
        prompt_extra = {k: [row[m].tolist() for row, m in zip(prompts[k], keep)] for k in token_keys}
        rows = [(i, side) for side in ("chosen", "rejected") for i in range(len(samples))]
        width = max(len(prompt_ids[i]) + len(answers[side][i]) for i, side in rows)
        if self.max_length is not None:
            width = min(width, self.max_length)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batch = {"input_ids": torch.full((len(rows), width), pad, dtype=torch.long),
                 "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
                 "completion_mask": torch.zeros((len(rows), width), dtype=torch.long),
                 **{k: torch.zeros((len(rows), width), dtype=prompts[k].dtype) for k in token_keys}}
        for r, (i, side) in enumerate(rows):
            ids = (prompt_ids[i] + answers[side][i])[:width]
            n = len(ids)
            batch["input_ids"][r, :n] = torch.tensor(ids)
            batch["attention_mask"][r, :n] = 1
            batch["completion_mask"][r, len(prompt_ids[i]):n] = 1
            for k in token_keys:
                extra = prompt_extra[k][i][:n]
                batch[k][r, :len(extra)] = torch.tensor(extra)
        counts, video_counts = [len(im) for im in images], [len(c) for c in clips]
        self._index_images(batch, prompt_ids, counts, prompts, video_counts)
        for key in REF_LOGPS_COLUMNS:  # (precompute_ref_log_probs: the reference's, one per pair)
            if key in samples[0]:
                batch[key] = torch.tensor([float(s[key]) for s in samples], dtype=torch.float32)
        return self.pack(batch, samples) if self.padding_free else batch

    def pack(self, batch: dict[str, torch.Tensor], samples: list[Mapping[str, Any]]) -> dict[str, Any]:
        """``batch``, this collator's padded layout of ``samples``, packed into one row (data/pair_packing.py)."""
        token_keys = [k for k in ROW_TOKEN_KEYS if k in batch]
        return pack_pair_rows(batch, token_keys, self.rope_positions, [len(_images_of(s)) for s in samples] * 2,
                              [len(sample_videos(s)) for s in samples] * 2)

    def clips(self, sample: Mapping[str, Any]) -> list[VideoClip]:
        """A pair's videos decoded to the frames the family's plan keeps (a VideoClip as it is)."""
        return decode_clips(sample, self.video, "a pair with videos (the collator's video)")

    def _index_images(self, batch: dict[str, torch.Tensor], prompt_ids: list[list[int]], counts: list[int],
                      prompts: Mapping[str, Any], video_counts: Sequence[int] = ()) -> None:
        """``image_token_index`` (each row placeholder token -> its prompt's feature token), the prompts' pixel
        inputs once under ``vision_*``, and the per-image keys the rows read (repeated per row image); the same
        for videos (``video_token_index``, ``videos_*``, the per-video keys)."""
        if not any(counts) and not any(video_counts):
            return
        if any(counts):
            image_id = self.image_token_id if self.image_token_id is not None else image_token_id(self.processor)
            batch["image_token_index"] = self._token_index(batch, prompt_ids, image_id)
        if any(video_counts):
            batch["video_token_index"] = self._token_index(batch, prompt_ids, video_token_id(self.processor))
        for key, value in prompts.items():
            if key in ("input_ids", "attention_mask", *ROW_TOKEN_KEYS):
                continue
            if key in VIDEO_ENCODER_KEYS:
                batch[VIDEO_PREFIX + key] = value
            elif key not in ROW_VIDEO_KEYS:
                batch[VISION_PREFIX + key] = value
            if key in ROW_IMAGE_KEYS:
                batch[key] = value[_row_items(counts)]
            elif key in ROW_VIDEO_KEYS:
                batch[key] = value[_row_items(video_counts)]

    def _token_index(self, batch: dict[str, torch.Tensor], prompt_ids: list[list[int]], image_id: int
                     ) -> torch.Tensor:
        """Each of the 2B rows' ``image_id`` placeholder tokens -> its prompt's feature token (among the B
        prompts' features in order); an error where ``max_length`` cut through them."""
        per_prompt = [sum(t == image_id for t in ids) for ids in prompt_ids]
        starts = torch.tensor([0, *per_prompt]).cumsum(0).tolist()
        b = len(prompt_ids)
        token_index = []
        for r in range(2 * b):
            i = r % b
            shown = int((batch["input_ids"][r] == image_id).sum())
            if shown != per_prompt[i]:
                raise ConfigError(f"max_length={self.max_length} cuts through the image tokens of a pair's prompt "
                                  f"({per_prompt[i]} image tokens, {shown} kept): raise max_length (or set it to "
                                  "None), or give that pair smaller or fewer images.")
            token_index += range(starts[i], starts[i] + per_prompt[i])
        return torch.tensor(token_index, dtype=torch.long)


def decode_clips(sample: Mapping[str, Any], video: Any, what: str) -> list[VideoClip]:
    """A sample's videos decoded to the frames (and size) the family's plan keeps; a VideoClip as it is. ``video``:
    the family's video support (``Family.video(processor, settings)``); None with videos is an error naming
    ``what`` holds them."""
    specs = sample_videos(sample)
    if specs and video is None:
        raise ConfigError(f"{what}, but no video support was given: videos train on a Hub VLM family that takes "
                          "video (Qwen3-VL, Qwen2.5-VL).")
    clips = []
    for spec in specs:
        if not isinstance(spec, VideoClip):
            spec, plan = load_planned(spec, video.settings, video.plan)
            spec.size = (plan.height, plan.width)
        clips.append(spec)
    return clips


def video_call(processor: Any, video: Any, clips: list[VideoClip]) -> tuple[Any, dict[str, Any]]:
    """The processor that expands ``clips``' placeholders and makes their pixels (the family's video processor
    attached, each clip resized as its plan says) and the call's video arguments (metadata: the timestamps);
    ``processor`` and {} without clips."""
    if not clips:
        return processor, {}
    return (video.attach(processor, [c.size for c in clips]),
            {"videos": [c.frames for c in clips], "video_metadata": [c.metadata() for c in clips]})


def _row_items(counts: Sequence[int]) -> torch.Tensor:
    """The index of each of the 2B rows' items (images or videos; row r shows pair r % B's) among the B pairs'."""
    b = len(counts)
    starts = torch.tensor([0, *counts]).cumsum(0).tolist()
    return torch.tensor([k for r in range(2 * b) for k in range(starts[r % b], starts[r % b + 1])], dtype=torch.long)
