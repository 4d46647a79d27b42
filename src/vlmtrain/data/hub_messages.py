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
from typing import Any

from vlmtrain.data.processing import SkipSample

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
