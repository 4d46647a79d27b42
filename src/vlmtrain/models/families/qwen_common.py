"""What Qwen3-VL and Qwen2.5-VL share: tokens, batching, FLOP and rope counts, image size, the tiny builder.

Both families use ChatML with ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the processor
expands ``<|image_pad|>`` to one token per merged patch and returns ``pixel_values`` (all patches of all
images, concatenated), ``image_grid_thw`` ([n_images, 3]) and ``mm_token_type_ids`` (1 on image tokens).

Image size: the image processor resizes each image (``smart_resize``) to sides that are multiples of
``factor = patch_size * merge_size`` with a pixel count within ``size = {"shortest_edge": min_pixels,
"longest_edge": max_pixels}``, so an image becomes at most ``max_pixels / factor**2`` image tokens.
:func:`set_image_size` sets that range from ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens``
(tokens x factor**2 pixels); by default it caps an image at :data:`DEFAULT_MAX_IMAGE_TOKENS` image tokens (or
the checkpoint's own max_pixels, if smaller). A Qwen3-VL checkpoint (patch 16, merge 2) itself allows 16.7 MP
= 16,384 tokens per image: two 1080p images would be 4,080 tokens; under the default cap they are 1,008 each.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from .tiny import byte_level_tokenizer, save_tiny

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_PAD, VIDEO_PAD = "<|vision_pad|>", "<|video_pad|>"
# Order fixes the ids after the 256 byte-level tokens: <|endoftext|> = 256, ...
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)
TINY_VOCAB = 256 + len(SPECIAL_TOKENS) + 8  # a little slack, as real checkpoints have
DEFAULT_MAX_IMAGE_TOKENS = 1024
"""Image tokens per image unless data.max_pixels / max_image_tokens say otherwise."""

# Batch layout shared by both: pixels of every image (video) concatenated in placeholder order, one grid row per
# image (video), Qwen2.5-VL's seconds per temporal patch one per video, the multimodal token types padded like
# input_ids.
QWEN_BATCH_LAYOUT = {"pixel_values": "concat", "image_grid_thw": "concat", "mm_token_type_ids": "pad",
                     "pixel_values_videos": "concat", "video_grid_thw": "concat", "second_per_grid_ts": "concat"}


def frame_grids(batch: Any) -> list[tuple[int, int]]:
    """(h, w) patches of each frame the vision tower attends over alone: every image of ``image_grid_thw`` and
    every temporal patch of each video of ``video_grid_thw`` (the tower's attention spans one temporal patch:
    transformers' ``get_vision_cu_seqlens``)."""
    out = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = batch.get(key)
        for t, h, w in [] if grid is None else torch.as_tensor(grid).reshape(-1, 3).tolist():
            out += [(h, w)] * t
    return out


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, image tokens) per frame the vision tower attends over alone (:func:`frame_grids`: images and
    videos' temporal patches): h*w patches, merged spatial_merge_size^2 to 1."""
    merge = config.vision_config.spatial_merge_size ** 2
    return [(h * w, h * w // merge) for h, w in frame_grids(batch)]


def dummy_video(config: Any) -> dict[str, torch.Tensor]:
    """Qwen's smallest valid video (the ``dummy_video`` of both families): :func:`dummy_image` as
    ``get_video_features``' arguments (one temporal patch of merge x merge patches)."""
    image = dummy_image(config)
    return {"pixel_values_videos": image["pixel_values"], "video_grid_thw": image["image_grid_thw"]}


def dummy_image(config: Any) -> dict[str, torch.Tensor]:
    """Qwen's smallest valid image (the ``dummy_image`` of both families): one frame of merge x merge patches,
    which the projector merges into one image token."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return {"pixel_values": torch.zeros(merge * merge, patch), "image_grid_thw": torch.tensor([[1, merge, merge]])}


def rope_positions(module: str, class_name: str, config: Any, item: Any) -> torch.Tensor:
    """One processed sample's multimodal rotary positions [3, L] (temporal, height, width; its images' and videos'),
    computed for the sample alone by the model's own ``get_rope_index`` (class ``class_name`` of ``module``; called without
    weights, it reads only ``config``), as the model computes them for an unpacked sample. A family binds
    module and class with functools.partial (picklable, for data-loader workers)."""
    import importlib

    cls = getattr(importlib.import_module(module), class_name)
    index = types.SimpleNamespace(config=config)
    index.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, index)
    ids = torch.as_tensor(item["input_ids"]).reshape(1, -1)
    token_types = torch.as_tensor(item["mm_token_type_ids"]).reshape(1, -1)
    grids = {key: None if item.get(key) is None else torch.as_tensor(item[key]).reshape(-1, 3)
             for key in ("image_grid_thw", "video_grid_thw")}
    seconds = item.get("second_per_grid_ts")  # (Qwen2.5-VL: a video's temporal positions are spaced by it)
    if seconds is not None:
        grids["second_per_grid_ts"] = torch.as_tensor(seconds).reshape(-1)
    pos, _ = cls.get_rope_index(index, ids, mm_token_type_ids=token_types, **grids)
    return pos[:, 0]


def set_image_size(processor: Any, max_pixels: int | None = None, min_pixels: int | None = None,
                   max_image_tokens: int | None = None) -> None:
    """Set the Qwen image processor's resize range (``size``) in place: ``max_pixels`` (or ``max_image_tokens``
    x factor**2; default: the smaller of the checkpoint's own and DEFAULT_MAX_IMAGE_TOKENS x factor**2) and
    ``min_pixels`` (default: the checkpoint's own, lowered to max_pixels if above it). The processor saved
    with a checkpoint keeps the range, so inference resizes as training did."""
    from transformers.image_utils import SizeDict

    from ...errors import ConfigError

    ip = processor.image_processor
    factor = ip.patch_size * ip.merge_size
    own_min, own_max = ip.size["shortest_edge"], ip.size["longest_edge"]
    if max_image_tokens is not None:
        max_pixels = max_image_tokens * factor**2
    elif max_pixels is None:
        max_pixels = min(own_max, DEFAULT_MAX_IMAGE_TOKENS * factor**2)
    if max_pixels < factor**2:
        raise ConfigError(f"data.max_pixels / max_image_tokens: {max_pixels} pixels is less than one image token "
                          f"({factor}x{factor} = {factor**2} pixels for this checkpoint).")
    if min_pixels is None:
        min_pixels = min(own_min, max_pixels)
    elif min_pixels > max_pixels:
        raise ConfigError(f"data.min_pixels={min_pixels} is above the max_pixels of {max_pixels} "
                          f"(data.max_pixels / max_image_tokens, or the default cap).")
    ip.size = SizeDict(shortest_edge=int(min_pixels), longest_edge=int(max_pixels))


def video_support(kind: str, processor: Any, settings: Any) -> Any:
    """The ``video`` hook of both families: :class:`~vlmtrain.models.families.qwen_video.QwenVideo` for this
    processor's vision geometry and ``settings`` (``kind``: 'qwen3_vl' or 'qwen2_5_vl'), its frame count never
    above the checkpoint's own ``max_frames`` (the video processor settings transformers reads from a local
    checkpoint, :func:`~vlmtrain.models.families.processors.video_settings`; Qwen's 768 otherwise)."""
    import dataclasses
    import logging
    import os

    from .processors import video_settings
    from .qwen_video import QwenVideo

    source = getattr(processor, "source", None)
    own = None
    if isinstance(source, str) and os.path.isdir(source):
        own = (video_settings(source, getattr(processor, "saved_class_name", "")) or {}).get("max_frames")
    if isinstance(own, int) and own < settings.max_frames:
        logging.getLogger(__name__).warning(
            "data.video_max_frames=%d is above the checkpoint's own max_frames=%d (%s): using %d.",
            settings.max_frames, own, source, own)
        settings = dataclasses.replace(settings, max_frames=own, min_frames=min(settings.min_frames, own))
    return QwenVideo(kind, processor, settings)


def special_token_ids() -> dict[str, int]:
    """Token -> id in the tiny tokenizer (:func:`build_tiny_tokenizer`)."""
    return {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}


def build_tiny_tokenizer(chat_template: str) -> Any:
    """A byte-level tokenizer (256 byte tokens, no merges) plus Qwen's special tokens, built offline.

    Like Qwen's own: pad ``<|endoftext|>``, eos ``<|im_end|>``, no bos, ``image_token`` ``<|image_pad|>``.
    """
    tokenizer = byte_level_tokenizer(
        SPECIAL_TOKENS, bos=None, eos=IM_END, pad=ENDOFTEXT, specials_last=True,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                              "vision_start_token": VISION_START, "vision_end_token": VISION_END},
        model_max_length=32768)
    tokenizer.chat_template = chat_template
    ids = special_token_ids()
    assert all(tokenizer.convert_tokens_to_ids(t) == i for t, i in ids.items()), "special token ids moved"
    return tokenizer


def tiny_config(config_class: str, text: dict[str, Any], vision: dict[str, Any], **overrides: Any) -> Any:
    """A tiny Qwen-VL config (``config_class`` of transformers): text hidden 64 / 2 layers; vision patch 8, merge
    2, hidden 32 / 2 layers (32 px -> 4 tokens); ``text`` / ``vision`` add or change what a family's differ in."""
    import transformers

    ids = text_ids()
    text = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "pad_token_id": ids["pad_token_id"], "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"], "tie_word_embeddings": False, **text}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, **vision}
    cfg = {"text_config": text, "vision_config": vision, "tie_word_embeddings": False,
           **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id", "pad_token_id", "bos_token_id", "eos_token_id")}}
    cfg.update(overrides)
    return getattr(transformers, config_class)(**cfg)


def build_tiny(out_dir: str, seed: int, processor_class: Callable[[], type], model_class: str, config: Any,
               chat_template: str, mean: tuple[float, ...], std: tuple[float, ...]) -> str:
    """Write a tiny random-init Qwen-VL checkpoint (``model_class`` of transformers, ``config``) + image
    processor (patch 8, merge 2, ``mean`` / ``std``) + tokenizer (``chat_template``) offline."""
    import transformers

    proc = processor_class()(image_processor=tiny_image_processor(8, 2, mean, std),
                           tokenizer=build_tiny_tokenizer(chat_template), chat_template=chat_template)
    return save_tiny(out_dir, getattr(transformers, model_class), config, proc, seed, parts=True)


def tiny_image_processor(patch_size: int, merge_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
    """A PIL Qwen image processor for tiny images: a 32 px image -> (32 / patch)^2 / merge^2 tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = patch_size * merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2, image_mean=list(mean),
        image_std=list(std), size={"shortest_edge": factor * factor, "longest_edge": 4 * factor * factor * 4},
    )


def text_ids(vocab_size: int = TINY_VOCAB) -> dict[str, int]:
    """The special-token ids every tiny Qwen config sets explicitly (so no real-model id leaks in)."""
    ids = special_token_ids()
    return {"image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
            "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
            "pad_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END], "bos_token_id": ids[ENDOFTEXT],
            "vocab_size": vocab_size}
