"""LLaVA-OneVision (model_type ``llava_onevision``): llava-hf/llava-onevision-qwen2-{0.5b,7b,72b}-ov-hf.

- Processor: an image-only ``LlavaOnevisionProcessor`` (no video processor: no torchvision).
- Template: llava-hf's ChatML variant (see :mod:`.templates.llava_onevision` for what the training one marks).
- Image size: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` do not apply: the checkpoint's view
  size and ``image_grid_pinpoints`` grid ("anyres") bound an image's token count.
- Batching: a sample with one image is "anyres" (base view + grid crops: its token count depends on the
  image size); a sample with several images gives each one view (``num_image_tokens`` + 1 tokens) — the
  model tells the two apart only through ``batch_num_images`` (one entry per sample that has images), so
  images must stay nested per sample. ``pixel_values`` [n_images, max crops, C, H, W] are concatenated over
  samples after zero-padding the crops dimension (the model slices each image's real crops from
  ``image_sizes``); ``image_sizes`` [n_images, 2] and ``batch_num_images`` are concatenated.
- Vision tower SigLIP, language model Qwen2; save_pretrained writes legacy key names: reload with from_pretrained.
"""

from __future__ import annotations

import functools
from typing import Any

from . import image_tokens
from .base import Family, pad_crops_and_concat
from .processors import image_only, load_processor
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
processor_class = functools.partial(image_only, "LlavaOnevisionProcessor")


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """A tiny random-init LLaVA-OneVision (SigLIP + Qwen2) with its processor, written to ``out_dir``."""
    import transformers.models.llava_onevision.image_processing_pil_llava_onevision as pil
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    tokenizer = byte_level_tokenizer(SPECIALS, bos=None, eos=END_OF_TURN, pad="<|endoftext|>",
                                     extra_special_tokens={"image_token": "<image>", "video_token": "<video>"})
    ids = {**token_ids(tokenizer, pad_token_id="<|endoftext|>", eos_token_id=END_OF_TURN), "bos_token_id": None}
    image_processor = pil.LlavaOnevisionImageProcessorPil(size={"height": VIEW, "width": VIEW}, image_mean=[0.5] * 3,
                                                          image_grid_pinpoints=PINPOINTS, image_std=[0.5] * 3)
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


def dummy_image(config: Any) -> dict[str, Any]:
    """The smallest valid image: one image of the view size alone in its sample ("anyres": its base view and
    the one crop of the smallest grid, which uses image_newline as every anyres image does)."""
    import torch
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    vision = config.vision_config
    side = vision.image_size
    views = image_size_to_num_patches([side, side], config.image_grid_pinpoints, side)
    return {"pixel_values": torch.zeros(1, views, vision.num_channels, side, side),
            "image_sizes": torch.tensor([[side, side]]), "batch_num_images": torch.tensor([1])}


def unused_parameters(config: Any) -> tuple[str, ...]:
    """The vision tower's parts after the hidden states the model takes (``vision_feature_layer``: a layer's output,
    before the tower's post_layernorm): that norm, any pooling head and the layers after the last one taken."""
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    depth = config.vision_config.num_hidden_layers
    last = max(layer % (depth + 1) for layer in layers)  # an index into hidden_states (0: the embeddings)
    tower = "model.vision_tower."
    return (f"{tower}post_layernorm.", f"{tower}head.", *(f"{tower}encoder.layers.{i}." for i in range(last, depth)))


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
    dummy_image=dummy_image,
    unused_parameters=unused_parameters,
    image_tokens=image_tokens.llava_onevision,
)
