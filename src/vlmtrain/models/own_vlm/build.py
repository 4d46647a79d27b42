"""Building a :class:`VisionLanguageModel` from Hub names, local dirs or config dicts."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from ...errors import ConfigError
from ..meta import from_pretrained
from .vlm import VisionLanguageModel, VLMConfig, unknown_type_message


def resolve_config(spec: str | dict[str, Any], key: str, causal: bool) -> PretrainedConfig:
    """A vision (causal=False) or text config from a Hub name / local dir, or a dict with model_type."""
    if isinstance(spec, str):
        config = AutoConfig.from_pretrained(spec)
    else:
        spec = dict(spec)
        model_type = spec.pop("model_type", None)
        if model_type is None:
            raise ConfigError(f"{key} needs a model_type (e.g. {'llama' if causal else 'siglip_vision_model'!r}).")
        if model_type not in CONFIG_MAPPING:
            raise ConfigError(unknown_type_message(key, model_type))
        config = AutoConfig.for_model(model_type, **spec)
    if causal:
        config = config.get_text_config()  # a composite (e.g. a VLM repo) -> its language model config
        if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError(f"{key} model_type={config.model_type!r} has no causal LM class in transformers.")
    else:
        config = getattr(config, "vision_config", None) or config  # e.g. a full SigLIP -> its vision tower
        if config.model_type not in MODEL_MAPPING_NAMES:
            raise ConfigError(f"{key} model_type={config.model_type!r} has no model class in transformers.")
    return config


def build_vlm(vision: str | dict[str, Any], text: str | dict[str, Any], pixel_shuffle_factor: int,
              projector_type: str = "linear", tokenizer: PreTrainedTokenizerBase | None = None,
              load_backbone: bool = False, image_token: str = "<image>",
              dtype: torch.dtype = torch.float32, vision_position_scale: float = 1.0,
              image_index_embeddings: int = 0) -> VisionLanguageModel:
    """Build a :class:`VisionLanguageModel`.

    ``vision`` / ``text`` are Hub names or local dirs (``load_backbone=True`` loads their pretrained weights,
    else only their configs, randomly initialized) or config dicts with ``model_type`` (random init).
    SigLIP's pooling head is dropped (``vision_use_head=False``) unless a dict asks for it: the VLM uses
    the patch embeddings only, and unused parameters break DDP. With ``tokenizer``: the image token is
    added as a special token if missing, the decoder vocab follows ``len(tokenizer)`` and
    ``image_token_id`` is set. A randomly initialized vision tower gets 2D sin-cos positions
    (:func:`sincos_position_embeddings`, times ``vision_position_scale``). ``image_index_embeddings``: see
    :class:`~vlmtrain.models.own_vlm.projector.ModalityProjector`.
    """
    if load_backbone and not (isinstance(vision, str) and isinstance(text, str)):
        raise ConfigError("load_backbone=True needs vision and text as Hub names or local directories.")
    # Resolve (and validate) both configs before building anything heavy.
    vision_config = resolve_config(vision, "vision", causal=False)
    text_config = resolve_config(text, "text", causal=True)
    if hasattr(vision_config, "vision_use_head") and not (isinstance(vision, dict) and "vision_use_head" in vision):
        vision_config.vision_use_head = False
    image_token_id = None
    if tokenizer is not None:
        if image_token not in tokenizer.get_vocab():
            # transformers 5 renamed the flag that keeps existing extra special tokens (default: replace them).
            params = inspect.signature(tokenizer.add_special_tokens).parameters
            keep = {"replace_extra_special_tokens" if "replace_extra_special_tokens" in params
                    else "replace_additional_special_tokens": False}
            tokenizer.add_special_tokens({"additional_special_tokens": [image_token]}, **keep)
        image_token_id = tokenizer.convert_tokens_to_ids(image_token)
        if not load_backbone:  # random init: vocab and special ids follow the tokenizer
            text_config.vocab_size = len(tokenizer)
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                if getattr(tokenizer, name) is not None:
                    setattr(text_config, name, getattr(tokenizer, name))
    config = VLMConfig(vision_config=vision_config, text_config=text_config,
                       pixel_shuffle_factor=pixel_shuffle_factor, projector_type=projector_type,
                       image_token_id=image_token_id, image_index_embeddings=image_index_embeddings)
    vision_encoder = decoder = None
    if load_backbone:
        vision_encoder = from_pretrained(AutoModel, vision, config=config.vision_config, dtype=dtype)
        decoder = from_pretrained(AutoModelForCausalLM, text, config=config.text_config, dtype=dtype)
    model = VisionLanguageModel(config, vision_encoder=vision_encoder, decoder=decoder).to(dtype)
    if not load_backbone:
        sincos_position_embeddings(model.vision_encoder, scale=vision_position_scale)
    if tokenizer is not None and load_backbone:
        if model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.decoder.resize_token_embeddings(len(tokenizer))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(tokenizer, name) is not None and getattr(model.config.text_config, name, None) is None:
                setattr(model.config.text_config, name, getattr(tokenizer, name))
    return model


def sincos_position_embeddings(vision_encoder: nn.Module, scale: float = 1.0) -> bool:
    """Set a randomly initialized ViT's learned position table to 2D sin-cos values (as MAE does).

    Random position vectors carry no notion of left/right: a from-scratch model must first learn an
    ordering of the columns before it can answer "is A left of B?". Sin-cos rows give every patch its
    (x, y) from the start; they stay trainable. Applies to towers whose ``embeddings.position_embedding``
    is an ``nn.Embedding`` over a square patch grid (SigLIP, SigLIP2); returns whether it applied.
    ``scale`` multiplies the values: at 1 (MAE's unit scale) a patch's position is a small part of its
    embedding next to what it shows, which a small model trained from scratch can learn to ignore.
    """
    embeddings = getattr(getattr(vision_encoder, "vision_model", vision_encoder), "embeddings", None)
    table = getattr(embeddings, "position_embedding", None)
    if not isinstance(table, nn.Embedding):
        return False
    n, dim = table.weight.shape
    grid = math.isqrt(n)
    if grid * grid != n or dim % 4:
        return False
    freqs = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim // 4))
    ys, xs = torch.meshgrid(torch.arange(grid, dtype=torch.float64), torch.arange(grid, dtype=torch.float64),
                            indexing="ij")  # row-major, as the patches are numbered
    parts = []
    for coord in (xs.reshape(-1), ys.reshape(-1)):
        angles = coord[:, None] * freqs[None, :]
        parts += [angles.sin(), angles.cos()]
    with torch.no_grad():  # unit scale as in MAE: a random init's ~1/sqrt(width) drowns under the pixel content
        table.weight.copy_((scale * torch.cat(parts, dim=1)).to(table.weight.dtype))
    return True
