"""Gemma 3 (model_type ``gemma3``): google/gemma-3-{4b,12b,27b}-it.

- Processor: ``Gemma3Processor`` with the PIL image processor. Each ``<start_of_image>`` becomes
  ``\\n\\n<start_of_image>`` + ``image_seq_length`` x ``<image_soft_token>`` + ``<end_of_image>\\n\\n``; the
  processor also returns ``token_type_ids`` (1 on image tokens), which the model needs: image tokens attend to
  each other bidirectionally, and without them the attention silently changes. Padded like ``input_ids`` (0).
- Template: gemma-3-it's (see :mod:`.templates.gemma3` for what the training one marks).
- Batching: one fixed-size view per image; ``pixel_values`` [n_images, C, H, W] concatenated in placeholder
  order (``num_crops`` is dropped: pan-and-scan is off).
- Image size: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` do not apply: every image is resized
  to the checkpoint's fixed size (896 x 896 for gemma-3-it), ``image_seq_length`` (256) tokens whatever its size.
- Vision tower SigLIP; ``lm_head`` is tied to the embeddings; save_pretrained writes legacy key names: reload
  with ``from_pretrained``.
"""
from __future__ import annotations

import functools
from typing import Any

from . import image_tokens
from .base import Family
from .processors import load_processor, transformers_processor
from .templates.gemma3 import CHAT_TEMPLATE, TRAINING_TEMPLATE
from .tiny import byte_level_tokenizer, save_tiny, tiny_text, tiny_vision, token_ids

END_OF_TURN = "<end_of_turn>"
IMAGE_TOKEN = "<image_soft_token>"
# Gemma's order where it has one (pad 0, eos 1, bos 2, unk 3).
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", END_OF_TURN, "<start_of_image>",
            "<end_of_image>", IMAGE_TOKEN]
# Tiny sizes: 32 px images, patch 8 -> 4 x 4 patches, average-pooled to 2 x 2 = 4 soft tokens per image.
IMAGE, PATCH, TOKENS = 32, 8, 4
processor_class = functools.partial(transformers_processor, "Gemma3Processor")  # it has no video processor


def build_tiny(out_dir: str, seed: int = 0) -> str:
    """A tiny random-init Gemma 3 (SigLIP + Gemma 3 text) with its processor, written to ``out_dir``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = byte_level_tokenizer(
        SPECIALS, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>", add_bos=True,
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": IMAGE_TOKEN})
    ids = token_ids(tokenizer, pad_token_id="<pad>", bos_token_id="<bos>", eos_token_id="<eos>")
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, image_mean=[0.5] * 3,
                                              image_std=[0.5] * 3, resample=2)
    processor = processor_class()(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                                  image_seq_length=TOKENS)
    text = tiny_text(tokenizer, model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=32,
                     layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True, **ids)
    special = token_ids(tokenizer, boi_token_index="<start_of_image>", eoi_token_index="<end_of_image>",
                        image_token_index=IMAGE_TOKEN)
    config = Gemma3Config(text_config=text, mm_tokens_per_image=TOKENS, tie_word_embeddings=True, **special,
                          vision_config=tiny_vision(IMAGE, PATCH, model_type="siglip_vision_model",
                                                    vision_use_head=False))
    generation = {**ids, "eos_token_id": [ids["eos_token_id"], tokenizer.convert_tokens_to_ids(END_OF_TURN)]}
    return save_tiny(out_dir, Gemma3ForConditionalGeneration, config, processor, seed, generation=generation)


def dummy_image(config: Any) -> dict[str, Any]:
    """The smallest valid image: every image is one view of the vision tower's fixed image_size."""
    import torch

    vision = config.vision_config
    return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)}


FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=END_OF_TURN,
    batch_layout={"pixel_values": "concat", "token_type_ids": "pad"},
    module_groups={"vision": ("model.vision_tower",), "projector": ("model.multi_modal_projector",),
                   "text": ("model.language_model", "lm_head")},
    text_module="model.language_model",
    load_processor=functools.partial(load_processor, processor_class, keys=("image_seq_length",),
                                     from_image_processor={"image_seq_length": 256}),
    build_tiny=build_tiny,
    dummy_image=dummy_image,
    packing_unsupported=(
        "its image tokens attend to each other bidirectionally (token_type_ids), and transformers' mask for its "
        "sliding-window layers looks those image blocks up at each sample's own positions inside a packed row, "
        "so packed samples would see wrong tokens (measured: packed logits differ from unpacked ones)."),
    image_tokens=image_tokens.gemma3,
    matmul_parameters=("model.multi_modal_projector.mm_input_projection_weight",),
)
