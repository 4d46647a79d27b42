"""Qwen2.5-VL (Qwen/Qwen2.5-VL-*-Instruct): the family record and what its tiny builder differs in.

Same batching as Qwen3-VL (``pixel_values`` / ``image_grid_thw`` concatenated, ``mm_token_type_ids`` padded);
its template adds a default system prompt when the conversation has none. Its vision tower attends within
windows in most blocks (``windowed_attention``), which its FLOP count (``image_tokens``) follows.

Image size: :func:`~vlmtrain.models.families.qwen_common.set_image_size` (patch 14 x merge 2: 784 pixels per
image token; default cap 1,024 tokens = 802,816 pixels, the checkpoints' own being 12,845,056).
"""

from __future__ import annotations

import functools
from typing import Any

from . import qwen_common as qwen
from .base import Family
from .processors import image_only, load_processor
from .templates.qwen2_5_vl import CHAT_TEMPLATE, TRAINING_TEMPLATE

processor_class = functools.partial(image_only, "Qwen2_5_VLProcessor")
"""Qwen2_5_VLProcessor without a video processor."""
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int, int]]:
    """(patches, image tokens, query-key pairs in a windowed vision layer) per frame the vision tower attends over
    alone (each image, each temporal patch of a video: :func:`~vlmtrain.models.families.qwen_common.frame_grids`):
    the windowed blocks attend within squares of ``window_size`` pixels (``window_size // patch // merge`` image
    tokens a side; the last window of a row or column is cut short)."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    side = vision.window_size // merge // vision.patch_size  # image tokens per window side
    out = []
    for h, w in qwen.frame_grids(batch):
        squares = [sum(n * n for n in [side] * (m // side) + ([m % side] if m % side else [])) for m in (h // merge,
                                                                                                       w // merge)]
        out.append((h * w, h * w // merge**2, merge**4 * squares[0] * squares[1]))
    return out


def windowed_attention(config: Any) -> tuple[str, ...]:
    """The vision attention modules that attend within windows: every block's outside fullatt_block_indexes."""
    vision = config.vision_config
    return tuple(f"model.visual.blocks.{i}.attn" for i in range(vision.depth) if i not in vision.fullatt_block_indexes)


def tiny_config(**overrides: Any) -> Any:
    """A tiny Qwen2_5_VLConfig: text hidden 64 / 2 layers / head_dim 16; vision patch 8, merge 2 (32 px -> 4
    tokens), windows of 32 px in block 0 (block 1 attends over the whole image)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
    return qwen.tiny_config("Qwen2_5_VLConfig", {"rope_parameters": rope},
                            {"window_size": 32, "fullatt_block_indexes": [1]}, **overrides)


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """Write a tiny random-init Qwen2.5-VL checkpoint + processor (its real chat template) offline."""
    return qwen.build_tiny(out_dir, seed, processor_class, "Qwen2_5_VLForConditionalGeneration",
                           tiny_config(), CHAT_TEMPLATE, CLIP_MEAN, CLIP_STD)


FAMILY = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=qwen.IM_END,
    batch_layout=qwen.QWEN_BATCH_LAYOUT,
    module_groups={"vision": ("model.visual.patch_embed", "model.visual.blocks", "model.visual.rotary_pos_emb"),
                   "projector": ("model.visual.merger",),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=functools.partial(load_processor, processor_class),
    build_tiny=build_tiny,
    dummy_image=qwen.dummy_image,
    dummy_video=qwen.dummy_video,
    image_size=qwen.set_image_size,
    rope_positions=functools.partial(qwen.rope_positions, "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
                                     "Qwen2_5_VLModel"),
    image_tokens=image_tokens,
    windowed_attention=windowed_attention,
    video=functools.partial(qwen.video_support, "qwen2_5_vl"),
)
