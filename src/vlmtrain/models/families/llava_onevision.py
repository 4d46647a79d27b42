"""LLaVA-OneVision (model_type ``llava_onevision``): llava-hf/llava-onevision-qwen2-{0.5b,7b,72b}-ov-hf.

- Processor: an image-only ``LlavaOnevisionProcessor`` (the real one insists on a video processor, which
  needs torchvision) with the PIL image processor.
- Template: llava-hf's ChatML variant (``<|im_start|>role `` then images, then ``\\n`` + each text). Its
  assistant text already sits in generation markers, but its ``<|im_end|>`` does not; the training template
  marks the reply text and ``<|im_end|>`` (not the ``\\n`` before the text: the generation prompt
  ``<|im_start|>assistant\\n`` already ends with it). Its user turns render their content blocks in order,
  so images placed by ``<image>`` placeholders stay where the text put them (the checkpoint's template would
  move a turn's images to its start); with images first the two render the same.
- Image size: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` do not apply: an image is resized
  to the checkpoint's fixed view size and cut into at most the ``image_grid_pinpoints`` grid ("anyres"), so
  its token count is already bounded by the checkpoint's settings.
- Batching: a sample with one image is "anyres" (base view + grid crops: its token count depends on the
  image size); a sample with several images gives each one view (``num_image_tokens`` + 1 tokens) — the
  model tells the two apart only through ``batch_num_images`` (one entry per sample that has images), so
  images must stay nested per sample. ``pixel_values`` [n_images, max crops, C, H, W] are concatenated over
  samples after zero-padding the crops dimension (the model slices each image's real crops from
  ``image_sizes``); ``image_sizes`` [n_images, 2] and ``batch_num_images`` are concatenated.
- Modules: ``model.vision_tower`` (SigLIP), ``model.multi_modal_projector`` and ``model.image_newline``,
  ``model.language_model`` (Qwen2) and ``lm_head``. save_pretrained writes legacy key names: reload with
  ``from_pretrained``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .base import Family
from .processors import image_only_processor_class, load_processor
from .templates.llava_onevision import CHAT_TEMPLATE, TRAINING_TEMPLATE
from .tiny import byte_level_tokenizer, save_tiny, tiny_text, tiny_vision, token_ids

END_OF_TURN = "<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", END_OF_TURN, "<image>", "<video>"]
# Tiny sizes: 16 px views, patch 8 -> 4 tokens per view; a lone image is cut into up to 2 x 2 views of 16 px
# (grid pinpoints up to 32 px) plus the base view.
VIEW, PATCH = 16, 8
PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]
PROCESSOR_KEYS = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio", "image_token",
                  "video_token")


def processor_class(path: str | None = None) -> type:
    """LlavaOnevisionProcessor without a video processor."""
    from transformers import LlavaOnevisionProcessor

    return image_only_processor_class(LlavaOnevisionProcessor)


def pad_crops_and_concat(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """[n_i, crops_i, C, H, W] per sample -> [sum n_i, max crops, C, H, W]: crops zero-padded, images
    concatenated in sample order (what the processor's batched call returns)."""
    per_sample = [t for t in per_sample if t is not None and t.numel() > 0]
    crops = max(t.shape[1] for t in per_sample)
    padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, crops - t.shape[1])) for t in per_sample]
    return torch.cat(padded, dim=0)


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, projected features) per view the vision tower sees: a sample's only image is its base view plus
    grid crops ("anyres": how many from ``image_sizes`` and ``image_grid_pinpoints``, as the model counts them),
    each image of a several-image sample one view. Every view's (image_size / patch)^2 patches attend to each
    other and each (less the first with vision_feature_select_strategy 'default') goes through the projector;
    the pooling and unpadding after it are no matmuls."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    sizes = batch.get("image_sizes")
    if sizes is None:
        return []
    per_sample = batch.get("batch_num_images")
    crops_of = [n == 1 for n in per_sample.tolist() for _ in range(n)] if per_sample is not None else [True] * len(
        sizes)
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    features = patches - (config.vision_feature_select_strategy == "default")
    views = sum(image_size_to_num_patches(size, config.image_grid_pinpoints, vision.image_size) if crops else 1
                for size, crops in zip(sizes.tolist(), crops_of))
    return [(patches, features)] * views


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """A tiny random-init LLaVA-OneVision (SigLIP + Qwen2) with its processor, written to ``out_dir``."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )

    tokenizer = byte_level_tokenizer(SPECIALS, bos=None, eos=END_OF_TURN, pad="<|endoftext|>",
                                     extra_special_tokens={"image_token": "<image>", "video_token": "<video>"})
    ids = {**token_ids(tokenizer, pad_token_id="<|endoftext|>", eos_token_id=END_OF_TURN), "bos_token_id": None}
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": VIEW, "width": VIEW},
                                                      image_grid_pinpoints=PINPOINTS, image_mean=[0.5] * 3,
                                                      image_std=[0.5] * 3)
    settings = dict(vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    processor = processor_class()(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                                  num_image_tokens=(VIEW // PATCH) ** 2, **settings)
    vision = tiny_vision(VIEW, PATCH, model_type="siglip_vision_model", vision_use_head=False)  # as released
    config = LlavaOnevisionConfig(vision_config=vision, text_config=tiny_text(tokenizer, model_type="qwen2", **ids),
                                  image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                                  video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
                                  vision_feature_layer=-1, image_grid_pinpoints=PINPOINTS, tie_word_embeddings=False,
                                  **settings)
    return save_tiny(out_dir, LlavaOnevisionForConditionalGeneration, config, processor, seed, generation=ids)


FAMILY = Family(
    name="llava_onevision",
    model_types=("llava_onevision",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=END_OF_TURN,
    batch_layout={"pixel_values": pad_crops_and_concat, "image_sizes": "concat", "batch_num_images": "concat"},
    module_groups={"vision": ("model.vision_tower",),
                   "projector": ("model.multi_modal_projector", "model.image_newline"),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=functools.partial(load_processor, processor_class, keys=PROCESSOR_KEYS),
    build_tiny=build_tiny,
    image_tokens=image_tokens,
)
