"""SmolVLM / Idefics3 (model_types ``idefics3`` and ``smolvlm``): HuggingFaceTB/SmolVLM-Instruct and SmolVLM2.

- Processor: ``Idefics3Processor``, or an image-only ``SmolVLMProcessor`` (no video processor, no num2words).
- Template: SmolVLM-Instruct's. It renders only content blocks (string content is dropped), so samples must
  use ``[{"type": "text", ...}]`` content. What the model generates after the prompt ``Assistant:`` is
  ``" " + text + "<end_of_utterance>"`` (not the trailing newline), so that is what the training template marks.
- Batching: each image becomes up to 1 + rows x cols crops; ``pixel_values`` [N_crops, C, H, W] and
  ``pixel_attention_mask`` [N_crops, H, W] are zero-padded per sample to [B, max N_crops, ...] (the model
  drops all-zero crops), as the processor's own batched call does.
- Image size: ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens`` do not apply: the checkpoint's
  ``size.longest_edge`` and crops of ``max_image_size`` (``image_seq_len`` tokens each) bound the token count.
"""

from __future__ import annotations

import functools
from typing import Any

from . import image_tokens, model_type_of
from .base import Family
from .processors import image_only_smolvlm, load_processor, transformers_processor
from .templates.idefics3 import CHAT_TEMPLATE, SMOLVLM2_CHAT_TEMPLATE, TRAINING_TEMPLATE
from .tiny import byte_level_tokenizer, save_tiny, tiny_text, tiny_vision, token_ids

END_OF_TURN = "<end_of_utterance>"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
            END_OF_TURN, "<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
# Tiny sizes: 32 px crops, patch 8, pixel shuffle 2 -> 4 tokens per crop; images are resized to a longest edge
# of 64 px, so an image is at most 2 x 2 crops + the global one.
CROP, PATCH, SCALE = 32, 8, 2


def processor_class(path: str | None = None, model_type: str | None = None) -> type:
    """Idefics3Processor, or the image-only SmolVLMProcessor for a SmolVLM checkpoint (``path``'s model_type)."""
    smol = (model_type or model_type_of(path or "")) == "smolvlm"
    return image_only_smolvlm() if smol else transformers_processor("Idefics3Processor")


def build_tiny(out_dir: str, seed: int = 0, model_type: str = "idefics3") -> str:
    """A tiny random-init SmolVLM with its processor, written to ``out_dir``: ``model_type`` 'idefics3'
    (SmolVLM-Instruct: Idefics3ForConditionalGeneration) or 'smolvlm' (SmolVLM2: SmolVLMForConditionalGeneration)."""
    import importlib

    import transformers

    if model_type not in ("idefics3", "smolvlm"):
        raise ValueError(f"model_type must be 'idefics3' or 'smolvlm', got {model_type!r}")
    prefix = "SmolVLM" if model_type == "smolvlm" else "Idefics3"
    module = importlib.import_module(f"transformers.models.{model_type}.image_processing_pil_{model_type}")
    tokenizer = byte_level_tokenizer(SPECIALS, bos="<|im_start|>", eos=END_OF_TURN, pad="<|im_end|>",
                                     unk="<|endoftext|>")
    ids = token_ids(tokenizer, pad_token_id="<|im_end|>", bos_token_id="<|im_start|>", eos_token_id=END_OF_TURN)
    image_processor = getattr(module, f"{prefix}ImageProcessorPil")(
        size={"longest_edge": 2 * CROP}, max_image_size={"longest_edge": CROP}, do_image_splitting=True,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = processor_class(model_type=model_type)(
        image_processor=image_processor, tokenizer=tokenizer, image_seq_len=(CROP // PATCH) ** 2 // SCALE**2,
        chat_template=SMOLVLM2_CHAT_TEMPLATE if prefix == "SmolVLM" else CHAT_TEMPLATE)
    config = getattr(transformers, f"{prefix}Config")(
        vision_config=tiny_vision(CROP, PATCH), text_config=tiny_text(tokenizer, model_type="llama", rms_norm_eps=1e-5,
                                                                      **ids),
        scale_factor=SCALE, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False, **ids)
    model_class = getattr(transformers, f"{prefix}ForConditionalGeneration")
    return save_tiny(out_dir, model_class, config, processor, seed, generation=ids)


def dummy_image(config: Any) -> dict[str, Any]:
    """The smallest valid image: one crop (the vision tower's image_size), not all zero (the model drops
    all-zero crops as padding)."""
    import torch

    vision = config.vision_config
    side = vision.image_size
    return {"pixel_values": torch.ones(1, 1, vision.num_channels, side, side),
            "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool)}


FAMILY = Family(
    name="idefics3",
    model_types=("idefics3", "smolvlm"),
    training_template=TRAINING_TEMPLATE,
    end_of_turn=END_OF_TURN,
    batch_layout={"pixel_values": "pad_images", "pixel_attention_mask": "pad_images"},
    module_groups={"vision": ("model.vision_model",), "projector": ("model.connector",),
                   "text": ("model.text_model", "lm_head")},
    text_module="model.text_model",
    load_processor=functools.partial(load_processor, processor_class, keys=("image_seq_len",)),
    build_tiny=build_tiny,
    dummy_image=dummy_image,
    image_tokens=image_tokens.idefics3,
)
