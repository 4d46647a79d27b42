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
import json
import os
from typing import Any

import torch

from .base import Family
from .idefics3 import byte_level_tokenizer

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf chat_template.json, byte for byte.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}{{'<|im_end|>'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# User turns render their blocks in order (the checkpoint's puts a turn's images first): the same text when the
# images come first, and each image where its <image> placeholder stood otherwise; only the first text block
# gets the checkpoint's newline prefix.
TRAINING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% if message['role'] != 'assistant' %}{% set text = namespace(first=true) %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<image>' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>' }}"
    "{% elif content['type'] == 'text' %}{% if text.first %}{{ '\\n' }}{% set text.first = false %}{% endif %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{{'<|im_end|>'}}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' }}{% generation %}{{ content['text'] }}{% endgeneration %}{% endfor %}"
    "{% generation %}{{'<|im_end|>'}}{% endgeneration %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

END_OF_TURN = "<|im_end|>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", END_OF_TURN, "<image>", "<video>"]

# Tiny sizes: 16 px views, patch 8 -> 4 tokens per view; a lone image is cut into up to 2 x 2 views of 16 px
# (grid pinpoints up to 32 px) plus the base view.
VIEW, PATCH = 16, 8
PINPOINTS = [[16, 16], [16, 32], [32, 16], [32, 32]]
PROCESSOR_KEYS = ("num_image_tokens", "vision_feature_select_strategy", "vision_aspect_ratio", "image_token",
                  "video_token")


@functools.cache
def _image_only_processor_class() -> type:
    from transformers import LlavaOnevisionProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
        """LlavaOnevisionProcessor with an image processor and a tokenizer only (no video processor)."""

        def __init__(self, image_processor=None, tokenizer=None, num_image_tokens=None,
                     vision_feature_select_strategy=None, chat_template=None, image_token="<image>",
                     video_token="<video>", vision_aspect_ratio="anyres_max_9", **kwargs):
            self.num_image_tokens = num_image_tokens
            self.vision_feature_select_strategy = vision_feature_select_strategy
            self.image_token = getattr(tokenizer, "image_token", None) or image_token
            self.video_token = getattr(tokenizer, "video_token", None) or video_token
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_aspect_ratio = vision_aspect_ratio
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    from .base import saved_as_real_class

    return saved_as_real_class(ImageOnlyLlavaOnevisionProcessor)  # saved as LlavaOnevisionProcessor


def load_processor(path: str) -> Any:
    """An image-only LLaVA-OneVision processor (Hub id or directory): PIL image processor, tokenizer, the
    checkpoint's chat template and processor settings; no video processor, so no torchvision."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from .idefics3 import saved_chat_template, saved_processor_kwargs

    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.txt", "*.model"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    kwargs = {k: v for k, v in saved_processor_kwargs(path).items() if k in PROCESSOR_KEYS}
    processor = _image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                              chat_template=saved_chat_template(path, tokenizer), **kwargs)
    processor.source = path  # (its video processor settings go along when saved: SavedAsRealClass)
    return processor


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
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIALS}
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": VIEW, "width": VIEW},
                                                      image_grid_pinpoints=PINPOINTS, image_mean=[0.5] * 3,
                                                      image_std=[0.5] * 3)
    settings = dict(num_image_tokens=(VIEW // PATCH) ** 2, vision_feature_select_strategy="full",
                    vision_aspect_ratio="anyres_max_9")
    processor = _image_only_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                              chat_template=CHAT_TEMPLATE, **settings)
    text = dict(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                tie_word_embeddings=False, pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
                eos_token_id=ids[END_OF_TURN])
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=VIEW, patch_size=PATCH, vision_use_head=False)  # as released
    config = LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                                  video_token_index=ids["<video>"], vision_feature_select_strategy="full",
                                  vision_feature_layer=-1, image_grid_pinpoints=PINPOINTS,
                                  vision_aspect_ratio="anyres_max_9", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(config)
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = ids[END_OF_TURN]
    model.generation_config.bos_token_id = None
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    _set_processor_class(out_dir, "LlavaOnevisionProcessor")
    return out_dir


def _set_processor_class(out_dir: str, name: str) -> None:
    """processor_config.json names the real processor class (as on the Hub), not our image-only subclass."""
    file = os.path.join(out_dir, "processor_config.json")
    with open(file) as f:
        data: dict[str, Any] = json.load(f)
    data["processor_class"] = name
    with open(file, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


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
    load_processor=load_processor,
    build_tiny=build_tiny,
    image_tokens=image_tokens,
)
