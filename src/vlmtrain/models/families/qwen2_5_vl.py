"""Qwen2.5-VL (Qwen/Qwen2.5-VL-*-Instruct): the family record, its training template and a tiny builder.

Same batching as Qwen3-VL (``pixel_values`` / ``image_grid_thw`` concatenated, ``mm_token_type_ids`` padded);
its template adds a default system prompt when the conversation has none.

Image size: :func:`~vlmtrain.models.families.qwen_common.set_image_size` (patch 14 x merge 2: 784 pixels per
image token; default cap 1,024 tokens = 802,816 pixels, the checkpoints' own being 12,845,056).
"""

from __future__ import annotations

import functools
from typing import Any

from .base import Family
from .qwen_common import (
    QWEN_BATCH_LAYOUT,
    TINY_VOCAB,
    build_tiny_tokenizer,
    image_only_processor_class,
    load_image_only_processor,
    rope_positions,
    save_tiny,
    set_image_size,
    text_ids,
    tiny_image_processor,
)

_PRE = ("{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
        "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
        "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n")
_CONTENT_LIST = (
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
)
_POST = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

# Qwen2.5-VL-Instruct's chat template (chat_template.json of the Hub checkpoints; Qwen2-VL's too).
CHAT_TEMPLATE = (_PRE + "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
                 + _CONTENT_LIST + "<|im_end|>\n{% endif %}" + _POST)
"""The checkpoint's own template (what build_tiny saves)."""

_CONTENT = "{% if message['content'] is string %}{{ message['content'] }}{% else %}" + _CONTENT_LIST + "{% endif %}"
# trim_blocks drops a newline right after a block tag, so the newline after {% endgeneration %} is an expression.
TRAINING_TEMPLATE = (_PRE + "{% if message['role'] == 'assistant' %}{% generation %}" + _CONTENT
                     + "<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}" + _CONTENT + "<|im_end|>{{ '\\n' }}"
                     + "{% endif %}" + _POST)
"""CHAT_TEMPLATE with each assistant reply and its <|im_end|> inside {% generation %}."""


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int, int]]:
    """(patches, image tokens, query-key pairs in a windowed vision layer) per image of ``image_grid_thw``: the
    windowed blocks attend within squares of ``window_size`` pixels (``window_size // patch // merge`` image
    tokens a side; the last window of a row or column is cut short), each frame on its own."""
    grid = batch.get("image_grid_thw")
    vision = config.vision_config
    merge = vision.spatial_merge_size
    side = vision.window_size // merge // vision.patch_size  # image tokens per window side
    out = []
    for t, h, w in [] if grid is None else grid.tolist():
        squares = [sum(n * n for n in [side] * (m // side) + ([m % side] if m % side else [])) for m in (h // merge,
                                                                                                       w // merge)]
        out.append((t * h * w, t * h * w // merge**2, t * merge**4 * squares[0] * squares[1]))
    return out


def windowed_attention(config: Any) -> tuple[str, ...]:
    """The vision attention modules that attend within windows: every block's outside fullatt_block_indexes."""
    vision = config.vision_config
    return tuple(f"model.visual.blocks.{i}.attn" for i in range(vision.depth) if i not in vision.fullatt_block_indexes)


def processor_class() -> type:
    """Qwen2_5_VLProcessor without a video processor."""
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    return image_only_processor_class(Qwen2_5_VLProcessor)


def load_processor(path: str) -> Any:
    """Image-only Qwen2.5-VL processor for a Hub id or a local checkpoint directory."""
    return load_image_only_processor(path, processor_class())


def tiny_config(**overrides: Any) -> Any:
    """A tiny Qwen2_5_VLConfig: text hidden 64 / 2 layers / head_dim 16; vision patch 8, merge 2 (32 px -> 4
    tokens)."""
    from transformers import Qwen2_5_VLConfig

    ids = text_ids()
    text = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            "pad_token_id": ids["pad_token_id"], "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"], "tie_word_embeddings": False}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "window_size": 32,
              "fullatt_block_indexes": [1]}
    cfg = {"text_config": text, "vision_config": vision, "tie_word_embeddings": False,
           **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id", "pad_token_id", "bos_token_id", "eos_token_id")}}
    cfg.update(overrides)
    return Qwen2_5_VLConfig(**cfg)


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """Write a tiny random-init Qwen2.5-VL checkpoint + image processor + tokenizer (real chat template)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    proc = processor_class()(image_processor=tiny_image_processor(8, 2, clip_mean, clip_std),
                             tokenizer=build_tiny_tokenizer(CHAT_TEMPLATE), chat_template=CHAT_TEMPLATE)
    return save_tiny(out_dir, Qwen2_5_VLForConditionalGeneration, tiny_config(), proc, seed)


FAMILY = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn="<|im_end|>",
    batch_layout=QWEN_BATCH_LAYOUT,
    module_groups={"vision": ("model.visual.patch_embed", "model.visual.blocks", "model.visual.rotary_pos_emb"),
                   "projector": ("model.visual.merger",),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=load_processor,
    build_tiny=build_tiny,
    image_size=set_image_size,
    rope_positions=functools.partial(rope_positions, "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                                     "Qwen2_5_VLModel"),
    image_tokens=image_tokens,
    windowed_attention=windowed_attention,
)
