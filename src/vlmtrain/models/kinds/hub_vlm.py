"""model.kind: hub_vlm — a transformers VLM (Qwen3-VL, Qwen2.5-VL, SmolVLM/Idefics3, LLaVA-OneVision,
Gemma 3) loaded from model.pretrained, processed by its own processor (with the family's training template,
checked against the checkpoint's at load), with optional score heads (model.heads) and LoRA (model.lora)."""

from __future__ import annotations

import functools
import os
from typing import Any

from vlmtrain.errors import ConfigError
from vlmtrain.models.hub.hub_loading import (
    VARLEN_TORCH,
    end_of_turn_id,
    generate,
    load_for_inference,
    load_generator,
    load_model,
    owns_checkpoint,
)
from vlmtrain.models.kinds import ModelKind

DTYPES = ("float32", "bfloat16")
PACKING_KEYS = ("pack_length", "pack_window", "max_images_per_pack", "max_patches_per_pack")
"""data.* keys that only packed rows use (refused when a Hub VLM pads)."""


def check(cfg: Any) -> None:
    m = cfg.model
    if not m.pretrained:
        raise ConfigError("model.kind='hub_vlm' needs model.pretrained: a Hub id (e.g. Qwen/Qwen3-VL-8B-Instruct) "
                          "or a local directory written by save_pretrained.")
    if cfg.data.packing:
        check_packing(cfg)
    else:  # padded batches: a packing key would do nothing (never a silent padded run)
        for key in PACKING_KEYS:
            if getattr(cfg.data, key) is not None:
                raise ConfigError(f"data.{key}={getattr(cfg.data, key)} is a packing setting, but Hub VLM batches "
                                  f"are packed only with data.packing: true (got {cfg.data.packing!r}). Set "
                                  f"data.packing: true, or drop data.{key}.")
    if cfg.data.max_patches_per_pack is not None and cfg.data.max_images_per_pack is not None:
        raise ConfigError("data.max_patches_per_pack and data.max_images_per_pack both cap a packed row; set one.")
    if m.heads is not None:
        from vlmtrain.models.objectives.heads import parse_heads

        parse_heads(m.heads)  # an unknown head type or loss fails before anything is loaded
        if cfg.train.label_smoothing_factor:  # (the Trainer refuses it too: vlmtrain/compat/loss_extras.py)
            raise ConfigError(f"train.label_smoothing_factor={cfg.train.label_smoothing_factor} with model.heads: "
                              "the smoothed LM loss would replace the model's loss and drop the heads' losses. "
                              "Set train.label_smoothing_factor: 0 for a model with heads.")


PACKING_ATTENTION = ("sdpa", "eager", "flash_attention_2", VARLEN_TORCH)
"""model.attn_implementation values that keep packed samples apart (null is transformers' default, sdpa)."""


def check_packing(cfg: Any) -> None:
    """data.packing: true with a Hub VLM: a ConfigError for what cannot pack (score heads; an attention kernel
    other than those in PACKING_ATTENTION). The family is checked in validate (it needs the checkpoint)."""
    m = cfg.model
    if m.heads:
        raise ConfigError("data.packing=true with model.heads: score heads pool each row's last token, and a "
                          "packed row holds several samples. Set data.packing: false (or null) for a model with heads.")
    if m.attn_implementation is not None and m.attn_implementation not in PACKING_ATTENTION:
        raise ConfigError(f"data.packing=true with model.attn_implementation={m.attn_implementation!r}: packed Hub VLM "
                          f"rows are kept apart only with {', '.join(PACKING_ATTENTION)} (or null, sdpa). Set one of "
                          f"those, or data.packing: false.")


def validate(cfg: Any) -> None:
    from vlmtrain.data.hub_processing import check_image_size, check_video_settings
    from vlmtrain.models.families import family_of

    # an unsupported model_type names the supported ones; data.max_pixels & co. must apply to the family
    family = family_of(cfg.model.pretrained, key="model.pretrained")
    check_image_size(family, cfg.data)
    check_video_settings(family, cfg.data)
    if cfg.data.packing and family.packing_unsupported:
        raise ConfigError(f"data.packing=true: the {family.name} family cannot pack: {family.packing_unsupported} "
                          f"Set data.packing: false (or null).")
    if cfg.data.packing and cfg.model.attn_implementation == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError("data.packing=true with model.attn_implementation='flash_attention_2', but the "
                              "flash_attn package is not installed (pip install flash-attn), or set "
                              "model.attn_implementation: sdpa.")
    if cfg.model.attn_implementation == VARLEN_TORCH:
        check_varlen_torch(cfg)
    if cfg.train.use_liger_kernel:  # (before the weights load: the family, liger-kernel, a CUDA device)
        from vlmtrain.models.families import model_type_of
        from vlmtrain.models.speed.liger import check_liger

        check_liger(model_type_of(cfg.model.pretrained), cfg.train.liger_kernel_config)
    if cfg.data.max_patches_per_pack is not None:
        check_patch_budget(cfg)


def check_patch_budget(cfg: Any, max_image_patches: int | None = None) -> None:
    """data.max_patches_per_pack where it cannot apply: a vision tower other than Qwen-VL's (validate), a value
    that is not whole merge x merge blocks, or (``max_image_patches``: the processor's largest image, known in
    build) one smaller than a sample of data.max_images such images."""
    from transformers import AutoConfig

    from vlmtrain.models.vision.vision_attention import VISION_MODEL_TYPES

    budget = cfg.data.max_patches_per_pack
    vision = getattr(AutoConfig.from_pretrained(cfg.model.pretrained), "vision_config", None)
    if getattr(vision, "model_type", None) not in VISION_MODEL_TYPES:
        raise ConfigError(f"data.max_patches_per_pack pads a Qwen-VL vision tower (patches of any number per "
                          f"image); {cfg.model.pretrained}'s is {getattr(vision, 'model_type', None)!r}, whose "
                          f"images are fixed-size crops: use data.max_images_per_pack.")
    blocks = vision.spatial_merge_size ** 2
    if budget % blocks:
        raise ConfigError(f"data.max_patches_per_pack={budget} must be a multiple of spatial_merge_size^2 = "
                          f"{blocks} (an image is whole {vision.spatial_merge_size}x{vision.spatial_merge_size} "
                          f"blocks of patches).")
    if max_image_patches is not None and budget < cfg.data.max_images * max_image_patches:
        raise ConfigError(f"data.max_patches_per_pack={budget} is smaller than one sample can be: "
                          f"data.max_images={cfg.data.max_images} images of up to {max_image_patches} patches "
                          f"each (the image size cap: data.max_pixels / max_image_tokens) = "
                          f"{cfg.data.max_images * max_image_patches}. Raise data.max_patches_per_pack, or lower "
                          f"data.max_images or the image size.")


def check_varlen_torch(cfg: Any, cuda: bool | None = None) -> None:
    """model.attn_implementation: varlen_torch where it cannot run: a text model with other than full causal
    attention layers (Gemma 3's sliding windows) or attention dropout; on a CUDA machine (``cuda``; default:
    torch sees a GPU) a torch without ``torch.nn.attention.varlen`` (< 2.10), or float32 weights and compute
    (its flash kernel takes bfloat16 / float16)."""
    import importlib.util

    import torch
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(cfg.model.pretrained).get_text_config(decoder=True)
    odd = sorted(set(getattr(text, "layer_types", None) or ()) - {"full_attention"})
    if odd or getattr(text, "attention_dropout", 0.0):
        what = f"{', '.join(odd)} layers" if odd else f"attention_dropout={text.attention_dropout}"
        raise ConfigError(f"model.attn_implementation={VARLEN_TORCH!r} computes full causal attention without "
                          f"dropout per document, but {cfg.model.pretrained}'s text model has {what}. Set "
                          f"model.attn_implementation: sdpa.")
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return  # (elsewhere: one sdpa call per document, any dtype)
    if importlib.util.find_spec("torch.nn.attention.varlen") is None:
        raise ConfigError(f"model.attn_implementation={VARLEN_TORCH!r} on CUDA needs torch.nn.attention.varlen "
                          f"(torch >= 2.10; installed {torch.__version__}). Upgrade torch, or set "
                          f"model.attn_implementation: sdpa.")
    if cfg.model.torch_dtype == "float32" and not cfg.train.bf16:
        raise ConfigError(f"model.attn_implementation={VARLEN_TORCH!r} on CUDA runs a flash kernel that takes "
                          f"bfloat16, but model.torch_dtype is float32 and train.bf16 is off. Set "
                          f"model.torch_dtype: bfloat16 or train.bf16: true, or model.attn_implementation: sdpa.")


def build(cfg: Any, source: dict[str, Any], checkpoint: str | None = None) -> dict[str, Any]:
    """The model (+ heads, + LoRA), the family's processor (the checkpoint's own when it holds one), the
    collator and the metrics. Head metrics come from the model (WithHeads.head_metrics) with no user code;
    with predict_with_generate, generated answers are scored by exact match, cut at the end-of-turn token."""
    import torch

    from vlmtrain.data.hub_processing import apply_image_size, check_training_template
    from vlmtrain.data.metrics import exact_match_metric
    from vlmtrain.models.families import family_of
    from vlmtrain.models.meta import model_init

    m, d = cfg.model, cfg.data
    family = family_of(m.pretrained)
    has_processor = checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json"))
    processor = family.load_processor(checkpoint if has_processor else m.pretrained)
    check_training_template(processor, family)  # a mismatch is an error, never an all-zero loss mask
    apply_image_size(processor, family, d)  # (saved with the processor: inference resizes as training did)
    torch.manual_seed(cfg.train.seed)  # heads and adapters initialize under the run's seed
    stop = end_of_turn_id(processor, family)
    with model_init():  # (meta device on FSDP ranks that receive their shards from rank 0)
        model = load_model(m.pretrained, m.torch_dtype, m.attn_implementation, stop_token_id=stop)
        if d.max_patches_per_pack is not None:  # (every step's vision tower sees a multiple of it)
            from vlmtrain.models.vision.vision_padding import pad_vision_patches

            ip = processor.image_processor
            check_patch_budget(cfg, ip.size["longest_edge"] // ip.patch_size ** 2)
            pad_vision_patches(model, d.max_patches_per_pack)
        model_config = model.config  # (packing: Qwen's multimodal positions are computed from it per sample)
        heads = {}
        if m.heads:
            from vlmtrain.models.objectives.heads import WithHeads

            model = WithHeads(model, m.heads)
            heads = model.head_configs
        if m.lora:
            from vlmtrain.models.hub.lora import apply_lora

            model = apply_lora(model, m.lora, family.text_module, dict(family.module_groups))
    hub_processor, collator = _processing(cfg, processor, family, heads, model_config)
    metrics = None
    if cfg.train.predict_with_generate:
        metrics = exact_match_metric(processor.tokenizer, eos_token_id=stop)
    return {**source, "model": model, "tokenizer": processor, "data_collator": collator,
            "compute_metrics": metrics, "padded_collator": collator.without_packing(),
            "process": hub_processor.process}


def _hub_processor(cfg: Any, processor: Any, family: Any, heads: dict[str, Any]) -> Any:
    """The training HubVLMProcessor: data.max_length, max_images, video settings and (packing) patch budget,
    the heads' label checks."""
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.data.video import VideoSettings
    from vlmtrain.models.objectives.heads import check_head_labels

    d = cfg.data
    # Generation prompts cost a second processor call per sample: only in evaluation batches (the collator's
    # without_packing twin), and only when evaluation generates.
    return HubVLMProcessor(
        processor, family, max_length=d.max_length, max_images=d.max_images,
        label_check=functools.partial(check_head_labels, heads) if heads else None, prompts=False,
        head_names=tuple(heads), video=VideoSettings.from_data(d),
        max_patches=d.max_patches_per_pack if d.packing else None)


def _processing(cfg: Any, processor: Any, family: Any, heads: dict[str, Any], model_config: Any) -> tuple[Any, Any]:
    """The training HubVLMProcessor and collator (packing with data.packing; head labels with heads)."""
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.models.objectives.heads import head_label_tensors

    m, d = cfg.model, cfg.data
    hub_processor = _hub_processor(cfg, processor, family, heads)
    # Without heads a sample's `labels` dict is not for the model: collated to nothing.
    packing = {}
    if d.packing:  # (check_packing refused heads; flash-attention finds documents from one row's positions)
        packing = {"pack_length": d.pack_length or d.max_length, "model_config": model_config,
                   "max_images_per_pack": d.max_images_per_pack, "max_patches_per_pack": d.max_patches_per_pack,
                   "flatten": m.attn_implementation == "flash_attention_2"}
    collator = HubVLMCollator(hub_processor, label_collate=functools.partial(head_label_tensors, heads)
                              if heads else _no_head_labels, eval_prompts=cfg.train.predict_with_generate,
                              pad_to_multiple_of=d.pad_to_multiple_of, **packing)
    return hub_processor, collator


def _no_head_labels(raw: list[Any]) -> dict[str, Any]:
    return {}


def record_check(cfg: Any) -> Any:
    """The checks training makes on a raw sample: its processing by the training HubVLMProcessor (the
    checkpoint's processor with the run's image size, data.max_length, max_images, video settings and patch
    budget, model.heads' label checks), without the model: check_record's checks, the tokenizer's, and the
    sample's tokens and vision patches against max_length and max_patches_per_pack (too_long, too_many_patches)."""
    from vlmtrain.data.hub_processing import apply_image_size
    from vlmtrain.models.families import family_of
    from vlmtrain.models.objectives.head_config import parse_heads

    family = family_of(cfg.model.pretrained, key="model.pretrained")
    processor = family.load_processor(cfg.model.pretrained)
    apply_image_size(processor, family, cfg.data)
    return _hub_processor(cfg, processor, family, parse_heads(cfg.model.heads)).process


def pairs(cfg: Any, processor: Any = None) -> Any:
    """The pair collator of train.objective dpo (data/hub_pairs.py): pairs with images in TRL's vision layout,
    laid out as vlmtrain.DPOTrainer lays them out; processor None: the checkpoint's, with the run's image size."""
    from vlmtrain.data.hub_pairs import HubPairCollator
    from vlmtrain.data.video import VideoSettings
    from vlmtrain.models.families import family_of
    from vlmtrain.models.objectives.head_config import parse_heads
    from vlmtrain.models.objectives.heads import check_head_labels, head_label_tensors

    family = family_of(cfg.model.pretrained, key="model.pretrained")
    if processor is None:
        from vlmtrain.data.hub_processing import apply_image_size

        processor = family.load_processor(cfg.model.pretrained)
        apply_image_size(processor, family, cfg.data)
    video = None if family.video is None else family.video(processor, VideoSettings.from_data(cfg.data))
    heads = parse_heads(cfg.model.heads)  # (score heads beside DPO: their labels, one per pair)
    labels = (functools.partial(check_head_labels, heads), functools.partial(head_label_tensors, heads)) if heads \
        else (None, None)
    rope = None
    if cfg.data.packing and family.rope_positions is not None:  # (each packed sequence's own rotary positions)
        from transformers import AutoConfig

        rope = functools.partial(family.rope_positions, AutoConfig.from_pretrained(cfg.model.pretrained))
    return HubPairCollator(processor, cfg.data.max_length, cfg.data.max_images, *labels, video=video,
                           padding_free=bool(cfg.data.packing), rope_positions=rope)


def reward_pairs(cfg: Any, processor: Any) -> Any:
    """The pair collator of train.objective reward: each pair (vlmtrain's own layout or TRL's, with images) as
    its chosen and rejected sample through the run's HubVLMProcessor, each reward head's label the pair's margin
    (``labels: {<head>: margin}``, or TRL's ``margin``; 0 without)."""
    from vlmtrain.data.vision_reward_pairs import VisionPairCollator
    from vlmtrain.models.families import family_of
    from vlmtrain.models.objectives.head_config import parse_heads
    from vlmtrain.models.objectives.heads import pair_margin_tensors

    heads = parse_heads(cfg.model.heads)
    rewards = [name for name, c in heads.items() if c.type == "reward"]

    def margins(pairs: list[Any]) -> dict[str, Any]:
        return pair_margin_tensors(heads, [p.get("labels") or ({n: p["margin"] for n in rewards} if "margin" in p
                                                               else None) for p in pairs])

    return VisionPairCollator(_hub_processor(cfg, processor, family_of(cfg.model.pretrained), heads), margins)


KIND = ModelKind("hub_vlm", build=build, check=check, validate=validate, owns_checkpoint=owns_checkpoint,
                 generate=generate, load_generator=load_generator, load_for_inference=load_for_inference,
                 record_check=record_check, pairs=pairs, reward_pairs=reward_pairs)
