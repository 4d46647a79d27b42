"""Processing for Hub VLMs through the model's own processor: chat template, token expansion, pixels, labels
(and, for Qwen3-VL / Qwen2.5-VL, videos: :mod:`vlmtrain.data.video`, the family's ``video`` hook).

vlmtrain renders a the_cauldron sample as content-block messages (:mod:`vlmtrain.data.hub_messages`: each
image where its ``<image>`` placeholder stands in a user text, or without placeholders all images first in
the first user turn) and calls ``processor.apply_chat_template`` with the family's training template (the
checkpoint's template plus ``{% generation %}`` markers); the processor resizes the images (bounded by
:func:`apply_image_size`: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens``), expands the image
tokens and makes the pixel tensors, so a sample's length counts its image tokens after the resize. Labels
are ``input_ids`` where the assistant mask is 1 (assistant text + end-of-turn token), -100 elsewhere.
:func:`check_training_template` proves at load time that the training template renders exactly like the
checkpoint's own and that its mask covers exactly the assistant replies, with and without images.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmtrain.data.hub_messages import (
    build_messages,
    check_record,
    no_video_support,
    processor_error_reason,
    sample_videos,
    special_tokens_pattern,
)
from vlmtrain.data.packing import vision_patches
from vlmtrain.data.processing import IGNORE_INDEX, SkipSample
from vlmtrain.data.video import VideoClip, VideoSettings, load_planned
from vlmtrain.errors import ConfigError

_MARKER = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


def strip_generation_markers(template: str) -> str:
    """``template`` with its ``{% generation %}`` / ``{% endgeneration %}`` tags removed."""
    return _MARKER.sub("", template)


IMAGE_SIZE_KEYS = ("max_pixels", "min_pixels", "max_image_tokens")


def check_image_size(family: Any, data: Any) -> None:
    """ConfigError if ``data`` sets an image-size key (``max_pixels`` / ``min_pixels`` / ``max_image_tokens``)
    that the family cannot apply (its image size is fixed by the checkpoint)."""
    given = [k for k in IMAGE_SIZE_KEYS if getattr(data, k, None) is not None]
    if given and family.image_size is None:
        raise ConfigError(f"data.{given[0]} does not apply to the {family.name} family: its images are resized "
                          f"to the checkpoint's fixed size / tiling, which already bounds their token count "
                          f"(see vlmtrain.models.families.{family.name}). Remove data.{given[0]}.")


def check_video_settings(family: Any, data: Any) -> None:
    """ConfigError if ``data`` changes a video key (``video_*``, ``max_video_tokens``) from its default for a
    family without video support (its name in the message)."""
    from dataclasses import fields

    from vlmtrain.data.video import VIDEO_KEYS

    if getattr(family, "video", None) is not None:
        return
    defaults = {f.name: f.default for f in fields(data)} if hasattr(data, "__dataclass_fields__") else {}
    changed = [k for k in VIDEO_KEYS if hasattr(data, k) and getattr(data, k) != defaults.get(k)]
    if changed:
        raise ConfigError(f"data.{changed[0]} is a video setting, and the {family.name} family has no video support "
                          f"in vlmtrain (video: Qwen3-VL, Qwen2.5-VL). Remove data.{changed[0]}.")


def apply_image_size(processor: Any, family: Any, data: Any) -> None:
    """Bound the processor's image resize by ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` (the
    family's defaults where null; nothing for families whose image size the checkpoint fixes), in place, so
    images are resized before their tokens are counted against ``max_length``."""
    check_image_size(family, data)
    if family.image_size is not None:
        family.image_size(processor, *(getattr(data, k, None) for k in IMAGE_SIZE_KEYS))


class HubVLMProcessor:
    """Turns the_cauldron samples into per-sample tensors with a Hub VLM's own processor.

    ``process(sample)`` returns ``input_ids`` / ``attention_mask`` / ``labels`` ([L]), the processor's other
    outputs (per-token keys such as ``mm_token_type_ids`` as [L]; ``concat``-layout keys such as Qwen's
    ``pixel_values`` / ``image_grid_thw`` as the processor returns them; other keys without the batch
    dimension of 1, except callable layouts, which get the processor's tensor unchanged), the same for the
    generation prompt under ``prompt_*`` (conversation up to the last user turn plus the generation prompt),
    ``num_images``, and ``head_labels`` (the sample's ``labels`` dict, untouched) when the sample has one.

    A last turn without assistant text (missing, None or "") is rendered without an assistant message: with
    no assistant turn at all the sample is score-only (every label -100). With ``head_names`` (the model's
    heads; an empty collection for a model without heads) a sample that has neither assistant text nor a
    label for one of those heads is skipped (``no_target``: it would train nothing, and a batch of such
    samples has a NaN loss); None (inference) accepts it. Bad samples raise
    :class:`~vlmtrain.data.processing.SkipSample` (reasons in :mod:`vlmtrain.data.hub_messages` and
    :func:`~vlmtrain.data.hub_messages.processor_error_reason` besides the shared ones; ``video_unsupported``
    for a sample with videos when the family has no video support, or a video file among its images; the checks
    made before the processor runs are :func:`~vlmtrain.data.hub_messages.check_record`); an over-long one
    (> ``max_length`` tokens, image and video tokens included, after the resize) is dropped, never truncated.

    Videos (``videos``: Qwen3-VL, Qwen2.5-VL, through ``family.video``): decoded to the frames the family's plan
    keeps under ``video`` (:class:`~vlmtrain.data.video.VideoSettings`; default: the defaults, the clip's tokens
    bounded by ``max_length``) and within the room the sample's text, images and template leave under
    ``max_length`` (shared equally by its clips; every token a clip takes is counted, timestamps and markers
    included), so a clip that can fit is never ``too_long``; placed by ``<video>`` placeholders (else first),
    and expanded by the checkpoint's processor class with the family's torch-only video processor attached
    (``pixel_values_videos``, ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``, Qwen3-VL's timestamps in
    the text).
    """

    def __init__(self, processor: Any, family: Any, max_length: int = 2048, max_images: int = 8,
                 label_check: Callable[[dict[str, Any]], Any] | None = None, prompts: bool = True,
                 head_names: Collection[str] | None = None, video: VideoSettings | None = None,
                 max_patches: int | None = None) -> None:
        if max_length < 1 or max_images < 0:
            raise ValueError(f"max_length must be >= 1 and max_images >= 0, got {max_length}, {max_images}")
        self.processor, self.family = processor, family
        # Video: the family's support for these settings (default: data.max_length bounds a clip's tokens).
        hook = getattr(family, "video", None)
        self.video = None if hook is None else hook(processor, video or VideoSettings(max_tokens=max_length))
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.max_length, self.max_images, self.max_patches = max_length, max_images, max_patches
        self.label_check, self.prompts = label_check, prompts
        self.head_names = None if head_names is None else frozenset(head_names)
        self.special_tokens = special_tokens_pattern(self.tokenizer)

    def videos(self, sample: Mapping[str, Any], room: int | None = None, tokens: int | None = None
               ) -> list[VideoClip]:
        """The sample's ``videos`` (a file path or bytes, or a list of videos, each a path, bytes or a list of
        frame images), decoded to the frames the family's plan keeps (each clip within ``room`` tokens, all it
        takes in input_ids counted, and ``tokens`` video tokens; None: the settings' caps only) with the frame
        size it planned
        (``VideoClip.size``); SkipSample ``video_unsupported`` for a family without video support, and the
        reasons of :func:`~vlmtrain.data.video.load_video`."""
        videos = sample_videos(sample)
        if videos and self.video is None:
            raise no_video_support(self.family.name)
        clips = []
        for spec in videos:
            clip, plan = load_planned(spec, self.video.settings,
                                      functools.partial(self.video.plan, room=room, tokens=tokens))
            clip.size = (plan.height, plan.width)
            clips.append(clip)
        return clips

    def _video_room(self, turns: list[Any], images: list[Any], count: int) -> tuple[int, int | None]:
        """What each of a sample's ``count`` clips may take so that the sample fits: (tokens in input_ids under
        max_length, video tokens under ``max_patches``; None without it), what its text, images and template leave
        (measured by the processor with the smallest clip in each clip's place), shared equally. SkipSample
        ``too_long`` / ``too_many_patches`` when even the smallest clips do not fit."""
        smallest = [self.video.smallest() for _ in range(count)]
        clips = [clip for clip, _ in smallest]
        out = self._call(build_messages(turns, images, [c.frames for c in clips]), clips)
        length = int(out["input_ids"].shape[-1])
        self._check_size(length, vision_patches(out))
        room = (self.max_length - length + sum(plan.length for _, plan in smallest)) // count
        if self.max_patches is None:
            return room, None
        per_token = self.video.merge_size ** 2
        videos = sum(plan.tokens for _, plan in smallest) * per_token
        return room, (self.max_patches - vision_patches(out) + videos) // count // per_token

    def _check_size(self, length: int, patches: int) -> None:
        """SkipSample ``too_long`` past max_length tokens, ``too_many_patches`` past ``max_patches`` vision patches
        (images and videos: one packed row must hold the sample)."""
        if length > self.max_length:
            raise SkipSample("too_long", f"{length} tokens > max_length={self.max_length}")
        if self.max_patches is not None and patches > self.max_patches:
            raise SkipSample("too_many_patches", f"{patches} vision patches (images and videos) > "
                             f"data.max_patches_per_pack={self.max_patches}")

    # -- processor calls --------------------------------------------------------------------------
    def _call(self, messages: list[dict[str, Any]], clips: list[VideoClip] = (), **kwargs: Any  # type: ignore[assignment]
              ) -> dict[str, torch.Tensor]:
        # Lists, not tensors, from the processor: its assistant-mask alignment walks the token offsets in
        # Python, slow over tensor rows (collation 1.75x faster, benchmarks/README.md); same tensors.
        processor = self.processor
        if clips:  # the frames go in the messages, their indices and fps (timestamps) as video_metadata
            processor = self.video.attach(self.processor, [c.size for c in clips])  # (a shallow copy per call)
            kwargs["processor_kwargs"] = {"video_metadata": [c.metadata() for c in clips]}
        try:
            out = processor.apply_chat_template(
                messages, chat_template=self.family.training_template, tokenize=True, return_dict=True,
                return_tensors=None, **kwargs)
        except (ValueError, IndexError) as err:  # e.g. an extreme aspect ratio: named by what failed
            raise SkipSample(processor_error_reason(err), str(err)[:200]) from err
        return {k: v if isinstance(v, torch.Tensor) else _tensor(v) for k, v in out.items()}

    def _unbatch(self, out: Mapping[str, torch.Tensor], length: int) -> dict[str, Any]:
        layout = self.family.batch_layout
        item: dict[str, Any] = {}
        for key, value in out.items():
            if not isinstance(value, torch.Tensor):
                value = torch.as_tensor(value)
            how = layout.get(key, "pad" if value.ndim == 2 and value.shape == (1, length) else "stack")
            if how == "concat" or callable(how):
                item[key] = value
            elif value.ndim >= 1 and value.shape[0] == 1:
                item[key] = value[0]
            else:
                raise ValueError(f"processor output {key!r} has shape {tuple(value.shape)} for one sample; "
                                 f"expected a leading batch dimension of 1 (or declare it 'concat' in the "
                                 f"{self.family.name} family's batch_layout)")
        return item

    def process(self, sample: dict[str, Any]) -> dict[str, Any]:
        """One sample -> per-sample tensors (see the class docstring); raises SkipSample for a bad one."""
        no_video = None if self.video is not None else self.family.name
        turns, images = check_record(sample, self.max_images, self.label_check, self.head_names,
                                     self.special_tokens, no_video=no_video)
        head_labels = sample.get("labels")
        count = len(sample_videos(sample))
        room, tokens = self._video_room(turns, images, count) if count and self.video else (None, None)
        clips = self.videos(sample, room, tokens)
        frames = [c.frames for c in clips]

        out = self._call(build_messages(turns, images, frames), clips, return_assistant_tokens_mask=True)
        mask = torch.as_tensor(out.pop("assistant_masks"))
        length = int(out["input_ids"].shape[-1])
        self._check_size(length, vision_patches(out))
        item = self._unbatch(out, length)
        item["labels"] = torch.where(mask.reshape(-1).bool(), item["input_ids"], IGNORE_INDEX)
        if self.prompts:
            prompt_turns = turns if turns[-1][1] is None else [*turns[:-1], (turns[-1][0], None)]
            prompt = self._call(build_messages(prompt_turns, images, frames), clips, add_generation_prompt=True)
            p_len = int(prompt["input_ids"].shape[-1])
            item.update({f"prompt_{k}": v for k, v in self._unbatch(prompt, p_len).items()})
        item["num_images"] = len(images)
        if head_labels is not None:
            item["head_labels"] = head_labels
        return item

    __call__ = process


def _tensor(value: Any) -> torch.Tensor:
    """A processor output list as return_tensors="pt" makes it (floats in the default dtype, float32:
    Qwen2.5-VL's second_per_grid_ts)."""
    array = np.asarray(value)
    return torch.as_tensor(array.astype(np.float32) if array.dtype == np.float64 else array)


# -- the load-time template check ---------------------------------------------------------------
def _probes(image: Image.Image) -> list[tuple[str, list[dict[str, Any]]]]:
    """(name, messages) probe conversations: 1 and 2 images, multi-turn, text only."""
    return [
        ("one image, one turn", build_messages([("Describe the image.", "A red square.")], [image])),
        ("two images, two turns", build_messages([("Compare them.", "Both are red."),
                                                  ("Which is larger?", "The first one.")], [image, image])),
        ("text only, three turns", build_messages([("Hi", "Hello!"), ("2+2?", "4"), ("Thanks", "You're welcome.")],
                                                  [])),
    ]


def _placed_probe(image: Image.Image) -> tuple[str, list[dict[str, Any]]]:
    """Two images placed inside two user turns by ``<image>`` placeholders (mask check only: LLaVA-OneVision's
    own template would move them to the start of their turns)."""
    return ("two images placed by <image>", build_messages([("First <image> one.", "Red."),
                                                             ("Then <image>?", "Blue.")], [image, image]))


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_training_template(processor: Any, family: Any) -> None:
    """Raise ConfigError unless ``family.training_template`` is fit for training with this checkpoint.

    On probe conversations (1 and 2 images, multi-turn, text only; with and without a generation prompt)
    the training template with its generation markers removed must render byte-identically to the
    processor's own chat template, and the assistant mask it yields (two-image, text-only and two images placed
    by ``<image>`` inside two turns) must cover exactly the assistant texts and end-of-turn tokens (never all
    zeros).
    """
    name = getattr(family, "name", "?")
    training = family.training_template
    if not _MARKER.search(training or ""):
        raise ConfigError(f"family {name!r}: the training template has no {{% generation %}} markers; "
                          f"its assistant mask would be all zeros (nothing to train on).")
    own = getattr(processor, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    if not own:
        raise ConfigError(f"family {name!r}: the checkpoint's processor has no chat template to check the "
                          f"training template against.")
    stripped = strip_generation_markers(training)
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    for probe, messages in _probes(image):
        for gen in (False, True):
            msgs = messages[:-1] if gen else messages  # the generation prompt follows a user turn
            want = processor.apply_chat_template(msgs, chat_template=own, add_generation_prompt=gen)
            got = processor.apply_chat_template(msgs, chat_template=stripped, add_generation_prompt=gen)
            if got != want:
                i = _first_difference(got, want)
                raise ConfigError(
                    f"family {name!r}: the training template (markers removed) renders differently from the "
                    f"checkpoint's chat template on probe {probe!r} (add_generation_prompt={gen}) at "
                    f"character {i}: training {got[max(0, i - 40):i + 40]!r} vs checkpoint "
                    f"{want[max(0, i - 40):i + 40]!r}. Update the family's training template.")
    # the mask on a text-only probe and on one with images: transformers before 5.18 (seen on 5.17) placed it
    # by character offsets of the text before the image placeholders were expanded, so with images it fell on
    # the wrong tokens or nowhere (a Qwen3-VL batch without targets: NaN loss) while text-only ones were right
    for probe, messages in [*_probes(image)[1:], _placed_probe(image)]:
        _check_mask(processor, family, probe, messages)


def _check_mask(processor: Any, family: Any, probe: str, messages: list[dict[str, Any]]) -> None:
    import transformers

    name = getattr(family, "name", "?")
    has_images = any(c.get("type") == "image" for m in messages for c in m["content"])
    upgrade = (f" With images this means transformers {transformers.__version__} misplaces the assistant mask "
               f"after expanding image tokens: upgrade transformers (>= 5.18)." if has_images else "")
    out = processor.apply_chat_template(messages, chat_template=family.training_template, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True, return_tensors="pt")
    ids, mask = out["input_ids"].reshape(-1), torch.as_tensor(out["assistant_masks"]).reshape(-1).bool()
    if not mask.any():
        raise ConfigError(f"family {name!r}: the training template's assistant mask is all zeros on probe "
                          f"{probe!r}; its {{% generation %}} markers must enclose the assistant replies."
                          f"{upgrade}")
    tokenizer = getattr(processor, "tokenizer", processor)
    got = "".join(tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False).split())
    want = "".join("".join(m["content"][0]["text"] + family.end_of_turn
                           for m in messages if m["role"] == "assistant").split())
    if got != want:
        raise ConfigError(f"family {name!r}: the training template's assistant mask covers {got!r} on probe "
                          f"{probe!r}; expected the assistant texts each followed by {family.end_of_turn!r}: "
                          f"{want!r}.{upgrade}")
