"""Qwen3-VL (Qwen/Qwen3-VL-*-Instruct): the family record and what its tiny builder differs in.

Batching: ``pixel_values`` (patches of every image) and ``image_grid_thw`` are concatenated in placeholder
order, ``mm_token_type_ids`` (the model raises without it) is padded like ``input_ids``.

Image size: :func:`~vlmtrain.models.families.qwen_common.set_image_size` (patch 16 x merge 2: 1,024 pixels
per image token; default cap 1,024 tokens = 1,048,576 pixels, the checkpoints' own being 16,777,216).
"""

from __future__ import annotations

import functools
from typing import Any

from . import qwen_common as qwen
from .base import Family
from .processors import image_only, load_processor
from .templates.qwen3_vl import CHAT_TEMPLATE, TRAINING_TEMPLATE

processor_class = functools.partial(image_only, "Qwen3VLProcessor")
"""Qwen3VLProcessor without a video processor."""


def tiny_config(**overrides: Any) -> Any:
    """A tiny Qwen3VLConfig: text hidden 64 / 2 layers / head_dim 16; vision patch 8, merge 2 (32 px -> 4 tokens)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
    return qwen.tiny_config("Qwen3VLConfig", {"head_dim": 16, "rope_parameters": rope},
                            {"num_position_embeddings": 64, "deepstack_visual_indexes": [0]}, **overrides)


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """Write a tiny random-init Qwen3-VL checkpoint + processor (its real chat template) offline."""
    return qwen.build_tiny(out_dir, seed, processor_class, "Qwen3VLForConditionalGeneration", tiny_config(),
                           CHAT_TEMPLATE, (0.5,) * 3, (0.5,) * 3)


FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=qwen.IM_END,
    batch_layout=qwen.QWEN_BATCH_LAYOUT,
    module_groups={"vision": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks",
                              "model.visual.rotary_pos_emb"),
                   "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=functools.partial(load_processor, processor_class),
    build_tiny=build_tiny,
    dummy_image=qwen.dummy_image,
    dummy_video=qwen.dummy_video,
    image_size=qwen.set_image_size,
    rope_positions=functools.partial(qwen.rope_positions, "transformers.models.qwen3_vl.modeling_qwen3_vl",
                                     "Qwen3VLModel"),
    image_tokens=qwen.image_tokens,
    video=functools.partial(qwen.video_support, "qwen3_vl"),
)
