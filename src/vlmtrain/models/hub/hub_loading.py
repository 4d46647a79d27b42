"""Loading a Hub VLM (model.kind: hub_vlm): from the Hub or a local directory for training (:func:`load_model`),
and from a checkpoint vlmtrain wrote for evaluation and inference (:func:`load_checkpoint`,
:func:`load_for_inference`, :func:`generate`). The kind itself (checks, build, the registry entry) is
vlmtrain/models/kinds/hub_vlm.py."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from vlmtrain.errors import CheckpointError, ConfigError
from vlmtrain.models.speed.varlen_attention import (
    NAME as VARLEN_TORCH,  # (model.attn_implementation: varlen_torch)
)
from vlmtrain.models.speed.varlen_attention import use_varlen_text_attention
from vlmtrain.models.vision.vision_attention import use_varlen_vision_attention


def load_model(pretrained: str, torch_dtype: str = "float32", attn_implementation: str | None = None,
               stop_token_id: int | None = None, device: Any = None) -> Any:
    """The transformers VLM of a Hub id or directory (AutoModelForImageTextToText), with the family's module
    groups attached (module_learning_rates / LoRA aliases vision, projector, text) and a ``loss_only`` forward
    (models/lm_loss.enable_lm_loss); with ``stop_token_id``
    (the family's end of turn), generation stops there too. ``device``: load the weights straight onto it
    (``device_map``), in ``torch_dtype``, never a float32 copy first. A patch embedding Conv3d whose stride is
    its kernel (Qwen2.5-VL, Qwen3-VL) computes as the equal matmul (models/vision/patch_embed.py; same weights and
    state dict). ``attn_implementation`` 'varlen_torch': loaded with sdpa, then the text model's attention is
    models/speed/varlen_attention.py's and a Qwen-VL vision tower's models/vision/vision_attention.py's (all
    images in one call; other vision towers keep sdpa)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmtrain.models.families import family_of
    from vlmtrain.models.hub.local_paths import absolute_if_local
    from vlmtrain.models.meta import from_pretrained
    from vlmtrain.models.protocol import MODULE_GROUPS_ATTR, REGIONAL_COMPILE_ATTR
    from vlmtrain.models.speed.lm_loss import enable_lm_loss
    from vlmtrain.models.vision.patch_embed import linear_patch_embeddings

    pretrained = absolute_if_local(pretrained)  # the name a LoRA adapter records as its base: any cwd finds it
    kwargs: dict[str, Any] = {"dtype": getattr(torch, torch_dtype)}
    if device is not None:
        kwargs["device_map"] = torch.device(device)
    if attn_implementation:  # (varlen_torch is set after loading with sdpa)
        kwargs["attn_implementation"] = "sdpa" if attn_implementation == VARLEN_TORCH else attn_implementation
    model = from_pretrained(AutoModelForImageTextToText, pretrained, **kwargs)  # (meta device: config only)
    if attn_implementation == VARLEN_TORCH:
        use_varlen_text_attention(model)
        use_varlen_vision_attention(model)
    linear_patch_embeddings(model)
    family = family_of(pretrained)
    setattr(model, MODULE_GROUPS_ATTR, dict(family.module_groups))
    _attach_flop_info(model, family)
    setattr(model, REGIONAL_COMPILE_ATTR, True)  # torch_compile compiles each layer (models/speed/training_prep.py)
    _stop_at(model, stop_token_id)
    _dummy_vision(model, family)  # a batch without images still runs the vision tower under several ranks
    _freeze_unused(model, family)
    # forward(..., loss_only=True): LM head at the targets only, chunked (models/speed/lm_loss.py)
    enable_lm_loss(model)
    return model


def _attach_flop_info(model: Any, family: Any) -> None:
    """What the logged tflops count a family's images and odd matmuls by (models/speed/flops.py)."""
    from vlmtrain.models.speed.flops import IMAGE_TOKENS_ATTR, MATMUL_PARAMETERS_ATTR, WINDOWED_ATTENTION_ATTR

    if family.image_tokens is not None:
        setattr(model, IMAGE_TOKENS_ATTR, functools.partial(family.image_tokens, model.config))
    if family.windowed_attention is not None:
        setattr(model, WINDOWED_ATTENTION_ATTR, family.windowed_attention(model.config))
    if family.matmul_parameters:
        setattr(model, MATMUL_PARAMETERS_ATTR, family.matmul_parameters)


def enable_family_dummy_vision(model: Any, family: Any) -> None:
    """The family's dummy image path (below) on a transformers VLM loaded elsewhere (e.g. given to DPOTrainer as
    an object); a model that has it already is left as it is."""
    from vlmtrain.models.vision.dummy_vision import VISION_INPUT_ATTR

    inner = getattr(model, model.base_model_prefix, None)
    if inner is None or not hasattr(inner, VISION_INPUT_ATTR):
        _dummy_vision(model, family)


def _dummy_vision(model: Any, family: Any) -> None:
    """Under several processes, a forward without images runs the vision tower on the family's dummy image, with
    a zero contribution (models/vision/dummy_vision.py), so every rank runs the same collectives."""
    from vlmtrain.models.vision.dummy_vision import enable_dummy_vision

    if family.dummy_image is None:
        return
    inner = getattr(model, model.base_model_prefix, None)
    if inner is None or not hasattr(inner, "get_image_features"):
        raise TypeError(f"{type(model).__name__}.{model.base_model_prefix} has no get_image_features: the "
                        f"{family.name} family's dummy image cannot run (every rank must run its vision tower).")
    own = model.base_model_prefix + "."  # (the family's prefixes name the top model's parameters)
    fed = tuple(p.removeprefix(own) for group in ("vision", "projector") for p in family.module_groups[group])
    enable_dummy_vision(inner, family.dummy_image, family.dummy_video, fed)


def _freeze_unused(model: Any, family: Any) -> None:
    """Parameters no forward uses (the family's ``unused_parameters``) stay frozen: they would never get a
    gradient, which DDP refuses without ``ddp_find_unused_parameters``."""
    if family.unused_parameters is not None:
        prefixes = family.unused_parameters(model.config)
        for name, param in model.named_parameters():
            if name.startswith(prefixes):
                param.requires_grad_(False)


def _stop_at(model: Any, stop_token_id: int | None) -> None:
    """Generation stops at ``stop_token_id`` (the family's end of turn) too."""
    if stop_token_id is not None and model.generation_config is not None:
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        model.generation_config.eos_token_id = [stop_token_id, *[e for e in eos if e != stop_token_id]]


def end_of_turn_id(processor: Any, family: Any) -> int | None:
    """The id of the family's end-of-turn token in the processor's tokenizer (None if it has none)."""
    tokenizer = processor.tokenizer
    token_id = tokenizer.convert_tokens_to_ids(family.end_of_turn)
    return None if token_id is None or token_id == tokenizer.unk_token_id else token_id


def owns_checkpoint(config: dict[str, Any]) -> bool:
    from vlmtrain.models.families import REGISTRY

    return config.get("model_type") in REGISTRY


def base_of_checkpoint(checkpoint: str) -> str:
    """Where a checkpoint's full weights are: itself, or for a LoRA checkpoint (adapter only) the base model
    its adapter_config.json names (a relative directory is tried from the working directory, then from the
    checkpoint; one found nowhere is a ConfigError naming the file and the setting)."""
    from vlmtrain.models.hub.local_paths import adapter_base

    return adapter_base(checkpoint) or checkpoint


def load_checkpoint(checkpoint: str, torch_dtype: str = "float32", stop_token_id: int | None = None,
                    device: Any = None) -> Any:
    """A Hub VLM checkpoint as vlmtrain wrote it, in eval mode: full weights (model.safetensors, shards, or an
    FSDP ``dcp/`` dump) or base + LoRA adapter, plus its score heads (heads.json / heads.safetensors) when it
    has them, as a :class:`~vlmtrain.models.objectives.heads.WithHeads`. The base weights are read in ``torch_dtype``
    straight onto ``device`` (default CPU); heads stay float32. A file that does not fit the model is a
    CheckpointError naming it and what was expected."""
    import torch

    from vlmtrain.models.files.sharded_files import has_sharded_weights

    if has_sharded_weights(checkpoint) and not _has_full_weights(checkpoint):
        return _load_dcp(checkpoint, torch_dtype, stop_token_id, device)
    model = load_model(base_of_checkpoint(checkpoint), torch_dtype, stop_token_id=stop_token_id, device=device)
    if os.path.isfile(os.path.join(checkpoint, "heads.json")):
        from vlmtrain.models.files.head_files import read_head_configs
        from vlmtrain.models.objectives.heads import WithHeads

        model = WithHeads(model, read_head_configs(checkpoint))
        model.heads.to(_device_of(model.base))
    if os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
        from peft import PeftModel

        from vlmtrain.models.hub.lora import peft_wrapping

        try:
            with peft_wrapping():
                if hasattr(model, "heads"):
                    model.base = PeftModel.from_pretrained(model.base, checkpoint)
                else:
                    model = PeftModel.from_pretrained(model, checkpoint)
        except (RuntimeError, ValueError, KeyError) as err:
            raise CheckpointError(f"{os.path.join(checkpoint, 'adapter_model.safetensors')} does not fit the base "
                                  f"model {base_of_checkpoint(checkpoint)!r}: {str(err)[:300]}") from err
    if hasattr(model, "heads"):
        from vlmtrain.models.files.head_files import check_saved_heads

        check_saved_heads(model, checkpoint)
        _load_heads_and_extras(model, checkpoint)  # (the base was loaded above)
    return (model.to(torch.device(device)) if device is not None else model).eval()


def _load_heads_and_extras(model: Any, checkpoint: str) -> None:
    """The heads' weights, and under LoRA the trainable base tensors peft's adapter file does not hold
    (trainable.safetensors, as checkpoints hold them: models/files/model_files.py)."""
    from vlmtrain.models.files.head_files import load_heads

    extra_path = os.path.join(checkpoint, "trainable.safetensors")
    if os.path.isfile(os.path.join(checkpoint, "adapter_config.json")) and os.path.isfile(extra_path):
        import safetensors.torch

        unexpected = model.base.load_state_dict(safetensors.torch.load_file(extra_path), strict=False).unexpected_keys
        if unexpected:
            raise CheckpointError(f"{extra_path!r} holds tensors the model does not have: {unexpected[:5]}.")
    load_heads(model, checkpoint)


def _has_full_weights(checkpoint: str) -> bool:
    return any(os.path.isfile(os.path.join(checkpoint, n)) for n in ("model.safetensors", "model.safetensors.index.json",
                                                                      "adapter_config.json"))


def _device_of(model: Any) -> Any:
    return next(model.parameters()).device


def _load_dcp(checkpoint: str, torch_dtype: str, stop_token_id: int | None, device: Any) -> Any:
    """An FSDP checkpoint (``dcp/``): the whole model's weights, gathered in this process (fsdp.read_model_weights),
    put into the architecture of its config.json; heads from heads.json, else the run's config.yaml."""
    import torch

    from vlmtrain.models.files.head_files import read_head_configs
    from vlmtrain.models.files.sharded_files import read_model_weights
    from vlmtrain.models.objectives.heads import WithHeads

    state = read_model_weights(checkpoint)
    heads = None
    if os.path.isfile(os.path.join(checkpoint, "heads.json")):
        heads = read_head_configs(checkpoint)
    elif any(k.startswith("heads.") for k in state):
        heads = run_config_section(checkpoint, "model").get("heads")
        if not heads:
            raise CheckpointError(f"{checkpoint}/dcp holds score heads but neither {checkpoint}/heads.json nor the "
                                  f"run's config.yaml (model.heads) says what they are.")
    with torch.device(device or "cpu"):  # (random init where the weights go; they are overwritten below)
        model = _from_config(checkpoint, getattr(torch, torch_dtype), stop_token_id)
        if heads:
            model = WithHeads(model, heads)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    tied = [k for k in missing if k.endswith("lm_head.weight")]
    if [k for k in missing if k not in tied] or unexpected:
        raise CheckpointError(f"the weights in {os.path.join(checkpoint, 'dcp')} do not fit "
                              f"{type(model).__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}.")
    for key in list(state):  # one tensor at a time into the model's own (dtype, device)
        own[key].copy_(state.pop(key))
    return model.eval()


def _from_config(checkpoint: str, dtype: Any, stop_token_id: int | None) -> Any:
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmtrain.models.families import family_of
    from vlmtrain.models.protocol import MODULE_GROUPS_ATTR
    from vlmtrain.models.vision.patch_embed import linear_patch_embeddings

    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(checkpoint), dtype=dtype)
    linear_patch_embeddings(model)
    family = family_of(checkpoint)
    setattr(model, MODULE_GROUPS_ATTR, dict(family.module_groups))
    _stop_at(model, stop_token_id)
    _dummy_vision(model, family)
    return model


def run_config_section(checkpoint: str, section: str) -> dict[str, Any]:
    """``section`` of the run's config.yaml (in the checkpoint directory or its parent run directory); {} when
    there is none."""
    import yaml

    for where in (checkpoint, os.path.dirname(os.path.abspath(checkpoint))):
        path = os.path.join(where, "config.yaml")
        if os.path.isfile(path):
            with open(path) as f:
                return (yaml.safe_load(f) or {}).get(section) or {}
    return {}


def load_for_inference(checkpoint: str, device: Any, dtype: Any, max_length: int | None = None,
                       max_images: int | None = None) -> dict[str, Any]:
    """The parts :class:`vlmtrain.inference.InferenceModel` needs for a Hub VLM checkpoint: ``model`` (eval
    mode, weights in ``dtype`` on ``device``; heads float32), ``processor`` (the family's image-only
    processor, the checkpoint's own when it saved one), ``process`` (one the_cauldron sample -> per-sample
    tensors, the training HubVLMProcessor; raises SkipSample), ``collate`` (processed items -> a batch) and
    ``generate`` (samples -> answers). ``max_length`` / ``max_images`` default to the run's config.yaml
    (data.max_length / data.max_images, next to the checkpoint or in its run directory), else no limit; videos
    are sampled and sized by the run's data.video_* settings (:func:`_run_video_settings`)."""
    import torch

    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import family_of

    base = checkpoint if os.path.isfile(os.path.join(checkpoint, "config.json")) else base_of_checkpoint(checkpoint)
    family = family_of(base)
    has_processor = os.path.isfile(os.path.join(checkpoint, "tokenizer_config.json"))
    processor = family.load_processor(checkpoint if has_processor else base)
    dtype_name = str(dtype).removeprefix("torch.")
    model = load_checkpoint(checkpoint, dtype_name, stop_token_id=end_of_turn_id(processor, family), device=device)
    model.eval()
    run_data = run_config_section(checkpoint, "data")
    if max_length is None:
        max_length = run_data.get("max_length") or 1 << 20
    if max_images is None:
        max_images = run_data.get("max_images") or 1 << 10
    heads = getattr(model, "head_configs", None) or {}
    label_check = None
    if heads:
        from vlmtrain.models.objectives.heads import check_head_labels

        label_check = functools.partial(check_head_labels, heads)
    video = _run_video_settings(run_data, max_length)
    hub = HubVLMProcessor(processor, family, max_length=max_length, max_images=max_images, label_check=label_check,
                          prompts=False, video=video)
    collator = HubVLMCollator(hub)
    prompts = HubVLMProcessor(processor, family, max_length=max_length, max_images=max_images, prompts=True,
                              video=video)
    return {"model": model, "processor": processor, "process": hub.process, "collate": collator,
            "generate": _generator(model, processor, prompts, torch.device(device))}


def _run_video_settings(run_data: dict[str, Any], max_length: int) -> Any:
    """The run's video sampling (``run_data``: its config.yaml's data section, with data.video_* /
    max_video_tokens; the defaults where it has none), so that inference samples and sizes clips as training
    did."""
    import types

    from vlmtrain.data.video import VIDEO_KEYS, VideoSettings

    return VideoSettings.from_data(types.SimpleNamespace(max_length=max_length,
                                                         **{k: run_data.get(k) for k in VIDEO_KEYS}))


def _generator(model: Any, processor: Any, prompts: Any, device: Any) -> Callable[..., list[str]]:
    """generate(samples, max_new_tokens) for load_for_inference: greedy answers, each to its sample's last user
    turn, stopping at the end-of-turn token (``prompts``: the HubVLMProcessor that builds generation prompts)."""
    import torch

    from vlmtrain.data.hub_collate import HubVLMCollator

    prompt_collator = HubVLMCollator(prompts)

    def generate(samples: list[dict[str, Any]], max_new_tokens: int = 32, skip: bool = False) -> list[Any]:
        """Greedy answers to samples (each answering its last user turn), stopping at the end-of-turn token. A
        sample the processing skips is a ConfigError, or with ``skip`` its SkipSample in place of its answer."""
        from vlmtrain.data.processing import SkipSample

        items, skipped = [], {}
        for i, sample in enumerate(samples):
            try:
                items.append(prompts.process(sample))
            except SkipSample as e:
                if not skip:
                    raise ConfigError(f"cannot use this input: {e.reason} ({e})") from None
                skipped[i] = e
        answers = iter(_answers(items, max_new_tokens) if items else [])
        return [skipped[i] if i in skipped else next(answers) for i in range(len(samples))]

    def _answers(items: list[dict[str, Any]], max_new_tokens: int) -> list[str]:
        batch = prompt_collator(items)
        inputs = {k[len("prompt_"):]: v.to(device) if isinstance(v, torch.Tensor) else v
                  for k, v in batch.items() if k.startswith("prompt_")}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=processor.tokenizer.pad_token_id)
        new = out[:, inputs["input_ids"].shape[1]:]
        return [processor.tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]

    return generate


def load_generator(checkpoint: str, device: str | None = None) -> Callable[..., str]:
    """Load a Hub VLM checkpoint (LoRA ones included) once, float32; the returned answer(prompt, images,
    max_new_tokens) generates greedily, stopping at the family's end-of-turn token."""
    import torch

    parts = load_for_inference(checkpoint, torch.device(device or "cpu"), torch.float32, max_length=1 << 20,
                               max_images=1 << 10)

    def answer(prompt: str, images: list[Any] | None = None, max_new_tokens: int = 32) -> str:
        return parts["generate"]([{"images": list(images or []), "texts": [{"user": prompt}]}], max_new_tokens)[0]

    return answer


def generate(checkpoint: str, prompt: str, images: list[str] | None = None, max_new_tokens: int = 32) -> str:
    """Greedy answer to one prompt (with images) from a Hub VLM checkpoint (see load_generator)."""
    return load_generator(checkpoint)(prompt, images, max_new_tokens)
