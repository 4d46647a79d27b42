"""Hub VLM samples as chat messages: where each image goes, which texts are refused, what a processor error means.

A sample's user texts may place its images with the literal placeholder ``<image>`` (one per image, in
order, in any user turn) and its videos with ``<video>``: each user text is split into text, image and video
content blocks at its placeholders. A kind without any placeholder goes first in the first user turn (videos,
then images). The family's chat template then
renders each image block as the model's own image tokens where it stands.

Refused per sample (:class:`~vlmtrain.data.processing.SkipSample` reasons): a placeholder count that differs
from the image count (``placeholder_mismatch``; for videos ``video_placeholder_mismatch``), a placeholder in an assistant text
(``placeholder_in_assistant``: images belong to user turns), and a literal special token of the tokenizer
(``<|im_end|>``, ``<|vision_start|>``, ...) in any text (``control_token_in_text``: it would be tokenized as
that control token, not as text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

from vlmtrain.data.processing import SkipSample, load_image, skip_unreadable
from vlmtrain.data.sources import VIDEO_EXTENSIONS

IMAGE_PLACEHOLDER = "<image>"
"""The literal string that places an image in a user text (as LLaVA / LLaMA-Factory datasets write it)."""
VIDEO_PLACEHOLDER = "<video>"
"""The literal string that places a video in a user text."""
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


def _text_block(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def count_placeholders(turns: list[tuple[str, str | None]], placeholder: str = IMAGE_PLACEHOLDER) -> int:
    """Number of ``placeholder`` (default ``<image>``) in the user texts of ``turns``."""
    return sum(user.count(placeholder) for user, _ in turns)


def _block(kind: str, item: Any) -> dict[str, Any]:
    return {"type": kind, kind: item}


def build_messages(turns: list[tuple[str, str | None]], images: list[Any],
                   videos: list[Any] | None = None) -> list[dict[str, Any]]:
    """Content-block messages: each turn a user message and, when its assistant text is not None, an assistant
    message. Where the user texts hold ``<image>`` (``<video>``) placeholders, each image (video) sits where its
    placeholder is; a kind without any placeholder goes first in the first user message, videos before images,
    each in order. A placeholder count other than the number of its items is a ValueError."""
    videos = list(videos or [])
    items = {IMAGE_PLACEHOLDER: ("image", images), VIDEO_PLACEHOLDER: ("video", videos)}
    placed = {p: count_placeholders(turns, p) for p in items}
    for p, (kind, values) in items.items():
        if placed[p] and placed[p] != len(values):
            raise ValueError(f"{placed[p]} {p} placeholders for {len(values)} {kind}s")
    used = dict.fromkeys(items, 0)
    messages: list[dict[str, Any]] = []
    for i, (user, assistant) in enumerate(turns):
        blocks: list[dict[str, Any]] = []
        if i == 0:
            blocks += [_block("video", v) for v in videos if not placed[VIDEO_PLACEHOLDER]]
            blocks += [_block("image", im) for im in images if not placed[IMAGE_PLACEHOLDER]]
        for piece in _PLACEHOLDERS.split(user):
            if piece in items and placed[piece]:
                kind, values = items[piece]
                blocks.append(_block(kind, values[used[piece]]))
                used[piece] += 1
            elif piece:
                blocks.append(_text_block(piece))
        messages.append({"role": "user", "content": blocks})
        if assistant is not None:
            messages.append({"role": "assistant", "content": [_text_block(assistant)]})
    return messages


def special_tokens_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """A regex matching any special token of ``tokenizer`` (``all_special_tokens`` and added tokens marked
    special) as a literal string; None if it has none."""
    tokens = set(getattr(tokenizer, "all_special_tokens", None) or [])
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens.update(t.content for t in decoder.values() if getattr(t, "special", False))
    tokens.discard("")
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def check_texts(turns: list[tuple[str, str | None]], num_images: int, special: re.Pattern[str] | None,
                num_videos: int = 0) -> None:
    """Raise SkipSample for texts a model must not see: a placeholder in an assistant text, a placeholder count
    other than the image (video) count when there is any ``<image>`` (``<video>``), a special token written as
    text."""
    for i, (user, assistant) in enumerate(turns):
        for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
            if assistant and p in assistant:
                raise SkipSample("placeholder_in_assistant", f"turn {i}: the assistant text contains "
                                 f"{p!r}; images and videos belong to user turns")
        for role, text in (("user", _PLACEHOLDERS.sub(" ", user)), ("assistant", assistant or "")):
            found = special.search(text) if special is not None else None
            if found:
                raise SkipSample("control_token_in_text", f"turn {i}: the {role} text contains the special token "
                                 f"{found.group()!r} (place images with {IMAGE_PLACEHOLDER!r}, videos with "
                                 f"{VIDEO_PLACEHOLDER!r})")
    placed = count_placeholders(turns)
    if placed and placed != num_images:
        raise SkipSample("placeholder_mismatch", f"{placed} {IMAGE_PLACEHOLDER} placeholders in the user texts "
                         f"for {num_images} images (write one per image, or none to put every image first)")
    placed = count_placeholders(turns, VIDEO_PLACEHOLDER)
    if placed and placed != num_videos:
        raise SkipSample("video_placeholder_mismatch", f"{placed} {VIDEO_PLACEHOLDER} placeholders in the user "
                         f"texts for {num_videos} videos (write one per video, or none to put every video first)")


def sample_turns(texts: Any) -> list[tuple[str, str | None]]:
    """A sample's ``texts`` as (user, assistant) turns; the last turn's assistant may be missing, None or "" (then
    None: a score-only turn). Raises SkipSample (``empty_conversation``, ``malformed_text``)."""
    if texts is None or (isinstance(texts, (list, tuple)) and not texts):
        raise SkipSample("empty_conversation", "no texts")
    if isinstance(texts, dict):
        texts = [texts]
    if not isinstance(texts, (list, tuple)):
        raise SkipSample("malformed_text", f"texts is a {type(texts).__name__}, expected a list")
    turns: list[tuple[str, str | None]] = []
    for i, turn in enumerate(texts):
        if not isinstance(turn, dict):
            raise SkipSample("malformed_text", f"turn {i} is a {type(turn).__name__}, expected a dict")
        user, assistant = turn.get("user"), turn.get("assistant")
        if not isinstance(user, str) or not user.strip():
            raise SkipSample("malformed_text", f"turn {i}: 'user' must be a non-empty string")
        if assistant is not None and not isinstance(assistant, str):
            raise SkipSample("malformed_text", f"turn {i}: 'assistant' must be a string")
        if not (assistant or "").strip():
            if i != len(texts) - 1:
                raise SkipSample("malformed_text", f"turn {i}: empty assistant text before the last turn")
            assistant = None
        turns.append((user, assistant))
    return turns


def sample_videos(sample: Any) -> list[Any]:
    """The videos of ``sample`` as a list (its ``videos``, or ``video``: one video or a list of them; a video is a
    path, bytes or a list of frame images)."""
    videos = sample.get("videos")
    if videos is None:
        videos = sample.get("video")
    if videos is None:
        return []
    return list(videos) if isinstance(videos, (list, tuple)) else [videos]


def no_video_support(family: str) -> SkipSample:
    """The skip of a sample with videos for a family vlmtrain has no video processing for."""
    return SkipSample("video_unsupported", f"the {family} family has no video support in vlmtrain (video: Qwen3-VL, "
                      f"Qwen2.5-VL)")


def check_record(sample: Any, max_images: int | None = None, label_check: Callable[[dict[str, Any]], Any] | None = None,
                 head_names: Collection[str] | None = None, special: re.Pattern[str] | None = None,
                 no_video: str | None = None) -> tuple[list[tuple[str, str | None]], list[Any]]:
    """Every check a Hub VLM's training makes on one raw sample before its processor runs: (its turns, its images
    opened as RGB) or SkipSample. ``max_images``: more is ``too_many_images``; ``label_check``: the heads' check of
    ``labels`` (``bad_head_label``); ``head_names``: the model's heads, a sample with neither assistant text nor a
    label for one of them is ``no_target`` (None: not checked); ``special``: the tokenizer's special tokens, refused
    in texts (:func:`check_texts`, with the placeholder checks); ``no_video``: the name of a family without video
    support, a sample with videos is then ``video_unsupported`` (None: videos are counted against their
    ``<video>`` placeholders, and decoded later). HubVLMProcessor runs it on every sample;
    ``vlmtrain data inspect`` runs it without a processor."""
    if not isinstance(sample, dict):
        raise SkipSample("malformed_text", f"sample is a {type(sample).__name__}, expected a dict")
    skip_unreadable(sample)
    num_videos = len(sample_videos(sample))
    if num_videos and no_video is not None:
        raise no_video_support(no_video)
    turns = sample_turns(sample.get("texts"))
    head_labels = sample.get("labels")
    if head_labels is not None:
        if not isinstance(head_labels, dict):
            raise SkipSample("bad_head_label", f"'labels' is a {type(head_labels).__name__}, expected a "
                             f"dict {{head: value}}")
        if label_check is not None:
            label_check(head_labels)
    if head_names is not None and all(a is None for _, a in turns) and not any(
            (head_labels or {}).get(name) is not None for name in head_names):
        raise SkipSample("no_target", "no assistant text and no label for any of the model's heads "
                         f"({', '.join(sorted(head_names)) or 'it has none'})")
    images = sample.get("images")
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    if max_images is not None and len(images) > max_images:
        raise SkipSample("too_many_images", f"{len(images)} > max_images={max_images}")
    for img in images:  # a video file given as an image (never a corrupt_image count)
        if isinstance(img, str) and img.lower().endswith(tuple(f".{e}" for e in VIDEO_EXTENSIONS)):
            raise SkipSample("video_unsupported", f"{img}: a video among the images; give it under 'videos'")
    images = [load_image(img) for img in images]
    check_texts(turns, len(images), special, num_videos)
    return turns, images


# Messages transformers' processors raise (5.x), most specific first; anything else is `processor_error`.
_PROCESSOR_ERRORS = (
    ("bad_aspect_ratio", re.compile(r"aspect ratio", re.I)),
    ("image_too_small", re.compile(r"must be larger than factor|too small|smaller than the patch", re.I)),
    ("placeholder_mismatch", re.compile(r"tokens in each prompt should be the same as the number of images|"
                                        r"Mismatch in `image` token count|image features and image tokens do not "
                                        r"match|number of images", re.I)),
)


def processor_error_reason(err: Exception) -> str:
    """The skip reason of an exception a processor raised, from its message: ``bad_aspect_ratio`` (Qwen:
    longer side over 200 x the shorter), ``image_too_small`` (an image smaller than the patch grid),
    ``placeholder_mismatch`` (image tokens in the text that do not match the images), else ``processor_error``."""
    text = str(err)
    return next((reason for reason, pattern in _PROCESSOR_ERRORS if pattern.search(text)), "processor_error")
