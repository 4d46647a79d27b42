"""Gemma 3 (model_type ``gemma3``): google/gemma-3-{4b,12b,27b}-it.

- Processor: ``Gemma3Processor`` (it has no video processor) with the PIL image processor. Each
  ``<start_of_image>`` becomes ``\\n\\n<start_of_image>`` + ``image_seq_length`` x ``<image_soft_token>`` +
  ``<end_of_image>\\n\\n``; the processor also returns ``token_type_ids`` (1 on image tokens), which the model
  needs: image tokens attend to each other bidirectionally, and without ``token_type_ids`` the attention
  silently changes. They are padded like ``input_ids`` (with 0).
- Template: gemma-3-it's. It starts with ``{{ bos_token }}``, and the processor then tokenizes without
  special tokens, so there is exactly one BOS. The generation prompt is ``<start_of_turn>model\\n``; the
  training template marks the reply and its ``<end_of_turn>`` (not the newline after it).
- Batching: one fixed-size view per image; ``pixel_values`` [n_images, C, H, W] concatenated in placeholder
  order (``num_crops`` is dropped: pan-and-scan is off).
- Image size: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` do not apply: every image is
  resized to the checkpoint's fixed size (896 x 896 for gemma-3-it) and becomes ``image_seq_length`` (256)
  tokens whatever its size.
- Packing (``data.packing``): refused (``packing_unsupported``): transformers' sliding-window mask looks the
  bidirectional image blocks up at per-sample positions inside a packed row.
- Modules: ``model.vision_tower`` (SigLIP), ``model.multi_modal_projector``, ``model.language_model``
  and ``lm_head`` (tied to the embeddings). save_pretrained writes legacy key names: reload with
  ``from_pretrained``.
"""

from __future__ import annotations

import os
from typing import Any

from .base import Family
from .idefics3 import byte_level_tokenizer

# google/gemma-3-4b-it's chat template (tokenizer_config.json), byte for byte.
_HEAD = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
)
_CONTENT = (
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
)
_TAIL = (
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
CHAT_TEMPLATE = _HEAD + _CONTENT + "    {{ '<end_of_turn>\n' }}\n" + _TAIL

# The model's turns: content and <end_of_turn> inside generation markers, the newline after them outside. The
# markers touch no whitespace, so removing them (the load-time check) leaves the same whitespace control.
TRAINING_TEMPLATE = (
    _HEAD
    + "    {%- if role == 'model' -%}{% generation %}\n"
    + _CONTENT
    + "    {{ '<end_of_turn>' }}{% endgeneration %}{{ '\n' }}\n"
    + "    {%- else -%}\n"
    + _CONTENT
    + "    {{ '<end_of_turn>\n' }}\n"
    + "    {%- endif -%}\n"
    + _TAIL
)

END_OF_TURN = "<end_of_turn>"
IMAGE_TOKEN = "<image_soft_token>"
# Gemma's order where it has one (pad 0, eos 1, bos 2, unk 3).
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", END_OF_TURN, "<start_of_image>",
            "<end_of_image>", IMAGE_TOKEN]

# Tiny sizes: 32 px images, patch 8 -> 4 x 4 patches, average-pooled to 2 x 2 = 4 soft tokens per image.
IMAGE, PATCH, TOKENS = 32, 8, 4


def load_processor(path: str) -> Any:
    """Gemma 3's processor (Hub id or directory) with the PIL image processor (never torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Gemma3Processor

    from .idefics3 import saved_chat_template, saved_processor_kwargs

    if not os.path.isdir(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(path, allow_patterns=["*.json", "*.jinja", "*.txt", "*.model"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    seq = saved_processor_kwargs(path).get("image_seq_length", getattr(image_processor, "image_seq_length", 256))
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                           chat_template=saved_chat_template(path, tokenizer), image_seq_length=seq)


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, image tokens) per image of ``pixel_values`` [n, C, H, W]: the vision tower attends over all
    (image_size / patch)^2 patches of each; the projector average-pools them to ``mm_tokens_per_image`` tokens,
    then multiplies each by its projection weight (a bare parameter: ``matmul_parameters``)."""
    pixels = batch.get("pixel_values")
    if pixels is None:
        return []
    patch = config.vision_config.patch_size
    patches = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    return [(patches, config.mm_tokens_per_image)] * pixels.reshape(-1, *pixels.shape[-3:]).shape[0]


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """A tiny random-init Gemma 3 (SigLIP + Gemma 3 text) with its processor, written to ``out_dir``."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = byte_level_tokenizer(
        SPECIALS, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": IMAGE_TOKEN})
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIALS}
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, resample=2)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                                image_seq_length=TOKENS)
    text = dict(model_type="gemma3_text", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=16, max_position_embeddings=1024, sliding_window=32,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=ids["<pad>"],
                bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], tie_word_embeddings=True)
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=IMAGE, patch_size=PATCH, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS,
                          boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                          image_token_index=ids[IMAGE_TOKEN], tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    model.generation_config.pad_token_id = ids["<pad>"]
    model.generation_config.bos_token_id = ids["<bos>"]
    model.generation_config.eos_token_id = [ids["<eos>"], ids[END_OF_TURN]]
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=END_OF_TURN,
    batch_layout={"pixel_values": "concat", "token_type_ids": "pad"},
    module_groups={"vision": ("model.vision_tower",), "projector": ("model.multi_modal_projector",),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=load_processor,
    build_tiny=build_tiny,
    packing_unsupported=(
        "its image tokens attend to each other bidirectionally (token_type_ids), and transformers' mask for its "
        "sliding-window layers looks those image blocks up at each sample's own positions inside a packed row, "
        "so packed samples would see wrong tokens (measured: packed logits differ from unpacked ones)."),
    image_tokens=image_tokens,
    matmul_parameters=("model.multi_modal_projector.mm_input_projection_weight",),
)
