"""A nanoVLM-style vision-language model: vision tower -> pixel-shuffle projector -> causal LM decoder.

Image embeddings replace the decoder's input embeddings at the image-token positions; the loss is the
mean cross-entropy over target tokens (``labels != -100``) and ``num_items`` counts them (DESIGN.md).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from ...errors import ConfigError
from ..speed.lm_loss import lm_loss_sum
from ..vision.dummy_vision import VISION_INPUT_ATTR, VisionInput, needed, zero_of
from .projector import PROJECTOR_TYPES, ModalityProjector

IGNORE_INDEX = -100


def _sub_config(value: Any, default_type: str, key: str) -> PretrainedConfig:
    """A sub-config from a config object, a dict with ``model_type``, or None (the default type)."""
    if isinstance(value, PretrainedConfig):
        return value
    value = dict(value or {})
    model_type = value.pop("model_type", default_type)
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(unknown_type_message(key, model_type))
    return AutoConfig.for_model(model_type, **value)


def unknown_type_message(key: str, model_type: Any) -> str:
    near = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
    return f"{key}.model_type={model_type!r} is not a known transformers model type.{hint}"


def vision_grid(vision_config: PretrainedConfig) -> tuple[int, int]:
    """(patches per side, patch size) of a square-image vision tower config."""
    patch = vision_config.patch_size
    patch = patch[0] if isinstance(patch, (list, tuple)) else int(patch)
    if getattr(vision_config, "image_size", None):
        size = vision_config.image_size
        return (size[0] if isinstance(size, (list, tuple)) else int(size)) // patch, patch
    if getattr(vision_config, "num_patches", None):  # SigLIP2 (NaFlex): a patch budget, we use a square grid
        return math.isqrt(vision_config.num_patches), patch
    raise ConfigError(f"vision_config ({vision_config.model_type}) has neither image_size nor num_patches.")


class VLMConfig(PretrainedConfig):
    """Config of :class:`VisionLanguageModel`: a vision tower config, a causal LM config and the projector.

    ``image_token_length`` (tokens per image) and ``image_size`` (pixels per side) are derived from the
    vision config and ``pixel_shuffle_factor``; values passed for them are recomputed.
    """

    model_type = "vlmtrain_vlm"
    sub_configs = {"vision_config": AutoConfig, "text_config": AutoConfig}

    # A custom __init__ (rather than v5 dataclass fields) keeps this working on transformers 4.x and 5.x.
    def __init__(self, vision_config: dict | PretrainedConfig | None = None,
                 text_config: dict | PretrainedConfig | None = None, pixel_shuffle_factor: int = 1,
                 projector_type: str = "linear", image_token_id: int | None = None,
                 image_index_embeddings: int = 0, **kwargs: Any) -> None:
        self.vision_config = _sub_config(vision_config, "siglip_vision_model", "vision_config")
        self.text_config = _sub_config(text_config, "llama", "text_config")
        if projector_type not in PROJECTOR_TYPES:
            raise ConfigError(f"projector_type={projector_type!r} is not one of {PROJECTOR_TYPES}.")
        grid, patch = vision_grid(self.vision_config)
        if pixel_shuffle_factor < 1 or grid % pixel_shuffle_factor:
            raise ConfigError(f"pixel_shuffle_factor={pixel_shuffle_factor} must divide the vision tower's "
                              f"{grid}x{grid} patch grid.")
        self.pixel_shuffle_factor = pixel_shuffle_factor
        self.projector_type = projector_type
        self.image_index_embeddings = image_index_embeddings
        self.image_token_id = image_token_id
        self.image_size = grid * patch
        self.image_token_length = (grid // pixel_shuffle_factor) ** 2
        kwargs.pop("image_size", None)
        kwargs.pop("image_token_length", None)
        kwargs.setdefault("tie_word_embeddings", False)  # the decoder ties (or not) its own embeddings
        super().__init__(**kwargs)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens of each row, so left and right padding give the same positions."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class VisionLanguageModel(PreTrainedModel):
    """Vision tower (``vision_encoder``), :class:`ModalityProjector` (``projector``) and causal LM (``decoder``).

    The three submodule names are what per-module learning rates refer to.
    """

    config_class = VLMConfig
    base_model_prefix = "vlm"
    # module_learning_rates aliases (trainer/optim.py's MODULE_GROUPS_ATTR), the same for every family
    vlmtrain_module_groups = {"vision": ("vision_encoder",), "projector": ("projector",), "text": ("decoder",)}
    main_input_name = "input_ids"
    vlmtrain_accepts_loss_only = True  # forward(..., loss_only=True): the Trainer passes it (models/speed/lm_loss.py)
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def __init__(self, config: VLMConfig, vision_encoder: nn.Module | None = None,
                 decoder: PreTrainedModel | None = None) -> None:
        super().__init__(config)
        self.vision_encoder = vision_encoder if vision_encoder is not None else AutoModel.from_config(
            config.vision_config)
        self.decoder = decoder if decoder is not None else AutoModelForCausalLM.from_config(config.text_config)
        # Share the sub-configs with the submodules, so resizing the decoder's vocab is what gets saved.
        config.vision_config, config.text_config = self.vision_encoder.config, self.decoder.config
        self.projector = ModalityProjector(config.vision_config.hidden_size, config.text_config.hidden_size,
                                           config.pixel_shuffle_factor, config.projector_type,
                                           config.image_index_embeddings)
        self.post_init()
        self.projector.reset_image_index()  # (post_init's generic init would draw them at random)
        # a step without images leaves the tower and projector without gradients
        setattr(self, VISION_INPUT_ATTR, VisionInput(("vision_encoder", "projector")))

    def get_input_embeddings(self) -> nn.Module:
        return self.decoder.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.decoder.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module | None:
        return self.decoder.get_output_embeddings()

    def set_output_embeddings(self, value: nn.Module) -> None:
        self.decoder.set_output_embeddings(value)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        # The decoder resizes (and re-ties) its own embeddings; its config is ours, so the new size is saved.
        return self.decoder.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    # -- images ---------------------------------------------------------------------------------------
    def vlmtrain_image_tokens(self, batch: Mapping[str, Any]) -> list[tuple[int, int]]:
        """(patches the vision tower attends over, tokens the projector emits) per image of a batch: what
        models/speed/flops.py (IMAGE_TOKENS_ATTR) counts the image side of a step by."""
        pixels = batch.get("pixel_values")
        grid, _ = vision_grid(self.config.vision_config)
        patches = grid * grid + ("clip" in self.config.vision_config.model_type)  # CLIP prepends a CLS token
        return [(patches, self.config.image_token_length)] * (0 if pixels is None else int(pixels.shape[0]))

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, image_token_length, decoder hidden]."""
        size = self.config.image_size
        if pixel_values.shape[-2:] != (size, size):
            raise ValueError(f"pixel_values are {tuple(pixel_values.shape[-2:])} but the vision encoder expects "
                             f"{size}x{size} images.")
        dtype = next(self.vision_encoder.parameters()).dtype
        pixel_values = pixel_values.to(dtype)
        if self.config.vision_config.model_type == "siglip2_vision_model":
            feats = self._siglip2_features(pixel_values)
        else:
            feats = self.vision_encoder(pixel_values=pixel_values).last_hidden_state
        grid, _ = vision_grid(self.config.vision_config)
        if feats.shape[1] == grid * grid + 1:  # CLIP-style towers prepend a CLS token: keep the patch grid
            feats = feats[:, 1:]
        return self.projector(feats)

    def _siglip2_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # SigLIP2 (NaFlex) takes flattened patches + their grid shape; patchify as its image processor does.
        n, c, s, _ = pixel_values.shape
        grid, p = vision_grid(self.config.vision_config)
        patches = pixel_values.reshape(n, c, grid, p, grid, p).permute(0, 2, 4, 3, 5, 1).reshape(n, grid * grid, -1)
        mask = torch.ones(n, grid * grid, dtype=torch.long, device=pixel_values.device)
        shapes = torch.tensor([[grid, grid]] * n, dtype=torch.long, device=pixel_values.device)
        return self.vision_encoder(pixel_values=patches, pixel_attention_mask=mask,
                                   spatial_shapes=shapes).last_hidden_state

    def _check_image_tokens(self, input_ids: torch.Tensor, n_images: int,
                            image_counts: torch.Tensor | list[int] | None) -> None:
        # Called only on a mismatch (or when per-sample counts are given), to name the first bad sample.
        length = self.config.image_token_length
        per_sample = (input_ids == self.config.image_token_id).sum(-1).tolist()
        counts = [int(c) for c in image_counts] if image_counts is not None else None
        used = 0
        for b, c in enumerate(per_sample):
            if c % length:
                raise ValueError(f"sample {b} has {c} image-token positions, not a multiple of image_token_length="
                                 f"{length} (was an image's placeholder run truncated?).")
            if counts is not None and c // length != counts[b]:
                raise ValueError(f"sample {b} has {c} image-token positions ({c // length} images x {length}) "
                                 f"but {counts[b]} images.")
            used += c // length
            if used > n_images:
                raise ValueError(f"sample {b} has {c} image-token positions ({c // length} images x {length}) but "
                                 f"pixel_values has only {n_images} images for samples 0..{b} "
                                 f"(images per sample from placeholders: {[x // length for x in per_sample]}).")
        if used != n_images:
            raise ValueError(f"pixel_values has {n_images} images but the samples' image tokens account for {used} "
                             f"(images per sample from placeholders: {[x // length for x in per_sample]}); "
                             f"sample {len(per_sample) - 1} or an earlier one lost its image tokens.")

    def _dummy_image_zero(self, embeds: torch.Tensor) -> torch.Tensor:
        """0 x the encoding of one blank image: under several processes a batch without images still runs the
        vision tower and projector (image index included) as a batch with images does, so every rank runs the
        same collectives (DDP's gradient buckets, FSDP's all-gathers) and every image-side parameter gets an
        exact zero gradient (models/vision/dummy_vision.py)."""
        size, length = self.config.image_size, self.config.image_token_length
        blank = embeds.new_zeros(1, 3, size, size, dtype=torch.float32)
        images = self.encode_images(blank)
        images = self.projector.add_image_index(images, torch.ones(1, length, dtype=torch.bool,
                                                                   device=embeds.device), length)
        return zero_of(images).to(embeds.dtype)

    def embed(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None,
              image_counts: torch.Tensor | list[int] | None = None) -> torch.Tensor:
        """Decoder input embeddings with image embeddings spliced in at the image-token positions, in order."""
        embeds = self.get_input_embeddings()(input_ids)
        n_images = 0 if pixel_values is None else pixel_values.shape[0]
        if self.config.image_token_id is None:
            if n_images:
                raise ValueError("pixel_values given but config.image_token_id is not set.")
            return embeds
        getattr(self, VISION_INPUT_ATTR).record(n_images > 0)
        is_image = input_ids == self.config.image_token_id
        n_slots = int(is_image.sum())
        if n_slots != n_images * self.config.image_token_length or image_counts is not None:
            self._check_image_tokens(input_ids, n_images, image_counts)
        if n_images == 0:
            # (also in one process's training: every trainable parameter gets a gradient, as DDP expects)
            dummy = needed() or (self.training and torch.is_grad_enabled())
            return embeds + self._dummy_image_zero(embeds) if dummy else embeds
        images = self.encode_images(pixel_values).to(embeds.dtype)
        images = self.projector.add_image_index(images, is_image, self.config.image_token_length)
        # masked_scatter fills the True positions in row-major order: images in order of appearance.
        return embeds.masked_scatter(is_image.unsqueeze(-1), images.reshape(-1, images.shape[-1]))

    # -- training / evaluation -------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, image_counts: torch.Tensor | list[int] | None = None,
                use_cache: bool = False, loss_only: bool = False, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Returns ``{"logits"}`` plus, with labels, ``{"loss", "num_items"}`` (mean CE over targets). Training
        with labels, or ``loss_only=True`` (the Trainer's evaluation passes it when it keeps no logits), returns
        only ``{"loss", "num_items"}``: the LM head runs at the positions that predict a label, in chunks
        (models/speed/lm_loss.py; see :attr:`vlmtrain_target_logits_module`).

        ``image_counts`` (images per sample, optional) makes the placeholder check exact per sample.
        """
        embeds = self.embed(input_ids, pixel_values, image_counts)
        if position_ids is None and attention_mask is not None and attention_mask.dim() == 2:
            position_ids = position_ids_from_mask(attention_mask)
        if labels is not None and (self.training or loss_only) and self.vlmtrain_target_logits_module is not None:
            return self._target_loss(embeds, attention_mask, position_ids, labels, **kwargs)
        out = self.decoder(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                           use_cache=use_cache, **kwargs)
        result: dict[str, torch.Tensor] = {"logits": out.logits}
        if labels is not None:
            result["loss"], result["num_items"] = causal_lm_loss(out.logits, labels)
        return result

    @property
    def vlmtrain_target_logits_module(self) -> str | None:
        """The decoder's output layer, when training applies it only at target positions (models/speed/flops.py
        counts it per target then): a decoder whose logits are ``lm_head(hidden)`` and nothing more (no
        soft-capping or scaling). None: training computes the full logits."""
        dec = self.decoder
        base = getattr(dec, getattr(dec, "base_model_prefix", "") or "", None)
        if not isinstance(base, nn.Module) or not isinstance(getattr(dec, "lm_head", None), nn.Module):
            return None
        if any(getattr(dec.config, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
            return None
        return "decoder.lm_head"

    def _target_loss(self, embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, labels: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:
        """Training's loss with logits only where a target is predicted, a chunk at a time (lm_loss.lm_loss_sum):
        on a VQA batch most positions are prompt and image tokens, and the B x L x vocab logits and their
        log-softmax were ~15% of a step."""
        dec = self.decoder
        hidden = getattr(dec, dec.base_model_prefix)(inputs_embeds=embeds, attention_mask=attention_mask,
                                                     position_ids=position_ids, use_cache=False, **kwargs)[0]
        total, num_items = lm_loss_sum(hidden, dec.lm_head, labels)
        return {"loss": total / num_items.clamp(min=1), "num_items": num_items}

    # -- generation -------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel_values: torch.Tensor | None = None, max_new_tokens: int = 32, do_sample: bool = False,
                 pad_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
                 use_cache: bool = True, temperature: float = 1.0, top_k: int | None = None,
                 image_counts: torch.Tensor | list[int] | None = None, synced_gpus: bool = False,
                 **kwargs: Any) -> torch.LongTensor:
        """Greedy (or sampled) decoding of left-padded prompts; returns prompt ids followed by new ids.

        A sample stops at its first eos; later positions hold ``pad_token_id``. ``use_cache=False`` recomputes
        the whole sequence each step (a reference for the KV-cache path). ``synced_gpus`` (as in transformers,
        for FSDP): decoding goes on until every rank's samples are done, so every rank runs as many forwards.
        """
        if kwargs:
            raise TypeError(f"VisionLanguageModel.generate got unsupported arguments {sorted(kwargs)}.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if (attention_mask[:, -1] == 0).any():
            raise ValueError("generate needs left-padded prompts (the last column of attention_mask has zeros).")
        eos = _eos_ids(eos_token_id, self.decoder)
        if pad_token_id is None:
            pad_token_id = self.config.text_config.pad_token_id
            pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        eos_t = torch.tensor(eos, dtype=input_ids.dtype, device=input_ids.device)
        embed_tokens = self.get_input_embeddings()
        embeds, mask = self.embed(input_ids, pixel_values, image_counts), attention_mask
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        past, step_embeds, new = None, embeds, []
        cache_name = _cache_argument(self.decoder)
        for _ in range(max_new_tokens):
            if past is None:  # prefill (and every step without a cache)
                out = self.decoder(inputs_embeds=step_embeds, attention_mask=mask, use_cache=use_cache,
                                   position_ids=position_ids_from_mask(mask), logits_to_keep=1)
            else:  # one token; its position is the count of real tokens before it
                out = self.decoder(inputs_embeds=step_embeds, attention_mask=mask, **{cache_name: past},
                                   position_ids=mask.sum(-1, keepdim=True) - 1, use_cache=True, logits_to_keep=1)
            past = out.get(cache_name) if use_cache else None
            token = _next_token(out.logits[:, -1].float(), do_sample, temperature, top_k)
            token = torch.where(done, torch.full_like(token, pad_token_id), token)
            new.append(token)
            done |= torch.isin(token, eos_t)
            finished = done.all().float()
            if synced_gpus:
                torch.distributed.all_reduce(finished, op=torch.distributed.ReduceOp.MIN)
            if bool(finished):
                break
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            token_embeds = embed_tokens(token)[:, None]
            step_embeds = token_embeds if use_cache else torch.cat([step_embeds, token_embeds], dim=1)
        if not new:
            return input_ids
        return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)


def _cache_argument(decoder: nn.Module) -> str:
    """The decoder's name for the KV cache, in its forward and its output: ``cache`` (recent transformers, where
    ``past_key_values`` still works but warns) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(type(decoder).forward).parameters else "past_key_values"


def _eos_ids(eos_token_id: int | list[int] | None, decoder: PreTrainedModel) -> list[int]:
    if eos_token_id is None:
        gen = getattr(decoder, "generation_config", None)
        eos_token_id = gen.eos_token_id if gen is not None else None
        if eos_token_id is None:
            eos_token_id = decoder.config.eos_token_id
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def _next_token(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / max(temperature, 1e-5)
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1).squeeze(-1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token CE over targets, number of targets); labels align with input ids, -100 is ignored.

    With no targets the loss is 0 (still attached to the graph), not NaN.
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
    num_items = (shift_labels != IGNORE_INDEX).sum()
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / num_items.clamp(min=1), num_items


AutoConfig.register(VLMConfig.model_type, VLMConfig, exist_ok=True)
AutoModel.register(VLMConfig, VisionLanguageModel, exist_ok=True)
