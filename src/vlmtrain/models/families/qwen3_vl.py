"""Qwen3-VL (Qwen/Qwen3-VL-*-Instruct): the family record, its training template and a tiny builder.

Batching: ``pixel_values`` (patches of every image) and ``image_grid_thw`` are concatenated in placeholder
order, ``mm_token_type_ids`` (the model raises without it) is padded like ``input_ids``.

Image size: :func:`~vlmtrain.models.families.qwen_common.set_image_size` (patch 16 x merge 2: 1,024 pixels
per image token; default cap 1,024 tokens = 1,048,576 pixels, the checkpoints' own being 16,777,216).
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
    image_tokens,
    load_image_only_processor,
    rope_positions,
    save_tiny,
    set_image_size,
    text_ids,
    tiny_image_processor,
)

# Qwen3-VL-Instruct's chat template (chat_template.json of the Hub checkpoints).
_HEAD = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
"""
_ASSISTANT = """        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
"""
_TAIL = """    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHAT_TEMPLATE = _HEAD + _ASSISTANT + "        {{- '<|im_end|>\\n' }}\n" + _TAIL
"""The checkpoint's own template (what build_tiny saves)."""

TRAINING_TEMPLATE = (_HEAD + "        {%- generation %}\n" + _ASSISTANT + "        {{- '<|im_end|>' }}\n"
                     + "        {%- endgeneration %}\n" + "        {{- '\\n' }}\n" + _TAIL)
"""CHAT_TEMPLATE with the assistant reply and its <|im_end|> inside {% generation %} (the newline after is not
supervised)."""


def processor_class() -> type:
    """Qwen3VLProcessor without a video processor."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    return image_only_processor_class(Qwen3VLProcessor)


def load_processor(path: str) -> Any:
    """Image-only Qwen3-VL processor for a Hub id or a local checkpoint directory."""
    return load_image_only_processor(path, processor_class())


def tiny_config(**overrides: Any) -> Any:
    """A tiny Qwen3VLConfig: text hidden 64 / 2 layers / head_dim 16; vision patch 8, merge 2 (32 px -> 4 tokens)."""
    from transformers import Qwen3VLConfig

    ids = text_ids()
    text = {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                "mrope_interleaved": True},
            "pad_token_id": ids["pad_token_id"], "bos_token_id": ids["bos_token_id"],
            "eos_token_id": ids["eos_token_id"], "tie_word_embeddings": False}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    cfg = {"text_config": text, "vision_config": vision, "tie_word_embeddings": False,
           **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id", "pad_token_id", "bos_token_id", "eos_token_id")}}
    cfg.update(overrides)
    return Qwen3VLConfig(**cfg)


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """Write a tiny random-init Qwen3-VL checkpoint + image processor + tokenizer (real chat template) offline."""
    from transformers import Qwen3VLForConditionalGeneration

    proc = processor_class()(image_processor=tiny_image_processor(8, 2, (0.5,) * 3, (0.5,) * 3),
                             tokenizer=build_tiny_tokenizer(CHAT_TEMPLATE), chat_template=CHAT_TEMPLATE)
    return save_tiny(out_dir, Qwen3VLForConditionalGeneration, tiny_config(), proc, seed)


FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn="<|im_end|>",
    batch_layout=QWEN_BATCH_LAYOUT,
    module_groups={"vision": ("model.visual.patch_embed", "model.visual.pos_embed", "model.visual.blocks",
                              "model.visual.rotary_pos_emb"),
                   "projector": ("model.visual.merger", "model.visual.deepstack_merger_list"),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=load_processor,
    build_tiny=build_tiny,
    image_size=set_image_size,
    rope_positions=functools.partial(rope_positions, "transformers.models.qwen3_vl.modeling_qwen3_vl",
                                     "Qwen3VLModel"),
    image_tokens=image_tokens,
)
