"""A run's memory plan from its config (``vlmtrain plan``, ``data.pack_length: auto``): the model kind's model
built on the meta device (no weights read), a micro-batch of the run's token budget made up, and one step of it
traced by :mod:`vlmtrain.parallel.memory_plan`.

What the made-up micro-batch holds: ``per_device_train_batch_size`` rows of ``data.pack_length`` tokens (packing;
padded: ``data.max_length``). A Qwen-VL Hub VLM's rows carry ``data.max_patches_per_pack`` vision patches each
(else as many as make half the row's tokens image tokens), as one image per row.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from vlmtrain.config import RunConfig
from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)
AUTO = "auto"
MAX_AUTO_PACK_LENGTH = 131072
"""The largest token budget ``data.pack_length: auto`` considers."""
QWEN_VL = ("qwen3_vl", "qwen2_5_vl")


def build_meta_model(cfg: RunConfig) -> Any:
    """The run's model (LoRA adapters, score heads and activation checkpointing included) on the meta device."""
    import torch

    from vlmtrain.models.hub.lora import apply_lora

    m = cfg.model
    with torch.device("meta"):
        if m.kind == "causal_lm":
            from vlmtrain.models.hub.causal_lm import build_causal_lm
            from vlmtrain.models.speed.lm_loss import enable_lm_loss

            model = build_causal_lm(config=m.config or None, pretrained=m.pretrained, dtype=getattr(torch, m.torch_dtype))
            enable_lm_loss(model)
            text_module, groups = "", None
        elif m.kind == "hub_vlm":
            from vlmtrain.models.families import family_of
            from vlmtrain.models.hub.hub_loading import load_model

            family = family_of(m.pretrained, "model.pretrained")
            if family.name not in QWEN_VL:
                raise ConfigError(f"vlmtrain's memory plan covers model.kind causal_lm and the Qwen-VL Hub VLMs "
                                  f"({', '.join(QWEN_VL)}); {m.pretrained!r} is {family.name}. Set data.pack_length "
                                  f"to a number.")
            model = load_model(m.pretrained, m.torch_dtype, m.attn_implementation)
            if m.heads:
                from vlmtrain.models.objectives.heads import WithHeads

                model = WithHeads(model, m.heads)
            text_module, groups = family.text_module, dict(family.module_groups)
        else:
            raise ConfigError(f"vlmtrain's memory plan covers model.kind causal_lm and hub_vlm (Qwen-VL); got "
                              f"{m.kind!r}. Set data.pack_length to a number.")
        if m.lora:
            model = apply_lora(model, m.lora, text_module, groups)
    if cfg.train.activation_checkpointing:
        from vlmtrain.models.speed.training_prep import enable_activation_checkpointing

        kwargs = cfg.train.activation_checkpointing_kwargs
        enable_activation_checkpointing(model, kwargs if isinstance(kwargs, dict) else None)
    return model


def _config_of(model: Any) -> Any:
    from vlmtrain.models.hub.lora import base_of

    base = base_of(model)
    base = getattr(base, "base_model", base)
    return getattr(getattr(base, "model", base), "config", None) or base.config


def made_up_batch(cfg: RunConfig, model: Any, rows: int, length: int, patches: int | None = None) -> dict[str, Any]:
    """A micro-batch of ``rows`` x ``length`` tokens for ``model`` (see the module's docstring)."""
    import torch

    config = _config_of(model)
    text = getattr(config, "text_config", config)
    ids = torch.arange(rows * length).reshape(rows, length) % min(1000, text.vocab_size - 1) + 1
    batch: dict[str, Any] = {}
    if cfg.model.kind == "hub_vlm":
        vision = config.vision_config
        merge = vision.spatial_merge_size
        patches = patches or 2 * length
        patches = max(merge * merge, patches // (merge * merge) * merge * merge)
        image_tokens = patches // (merge * merge)
        if image_tokens > length - 2:
            raise ConfigError(f"data.max_patches_per_pack={patches} makes {image_tokens} image tokens, more than a "
                              f"row of {length} tokens holds.")
        ids[:, 1:1 + image_tokens] = config.image_token_id
        batch["pixel_values"] = torch.zeros(rows * patches, vision.in_channels * vision.temporal_patch_size
                                            * vision.patch_size ** 2, dtype=torch.float32)
        batch["image_grid_thw"] = torch.tensor([[1, merge, patches // merge]] * rows)
        if config.model_type == "qwen3_vl":
            batch["mm_token_type_ids"] = (ids == config.image_token_id).long()
        batch["position_ids"] = torch.arange(length).expand(4, rows, length).contiguous()
    elif cfg.data.packing:
        batch["position_ids"] = torch.arange(length).expand(rows, length).contiguous()
    if not cfg.data.packing:
        batch["attention_mask"] = torch.ones_like(ids)
    labels = ids.clone()
    if cfg.model.kind == "hub_vlm":
        labels[labels == config.image_token_id] = -100
    batch.update(input_ids=ids, labels=labels)
    if getattr(model, "vlmtrain_accepts_loss_only", False):
        batch["loss_only"] = True
    return batch


def estimate_step_memory(cfg: RunConfig, device_bytes: int | None = None, *, pack_length: int | None = None,
                         rows: int | None = None, patches: int | None = None, fsdp_degree: int = 1) -> Any:
    """The peak memory of one training step of ``cfg``'s run per device (a
    :class:`vlmtrain.parallel.memory_plan.MemoryPlan`: bytes per part and total), against ``device_bytes``.
    ``pack_length`` / ``rows`` / ``patches``: the micro-batch's tokens per row, rows and vision patches per row
    (default: the config's); ``fsdp_degree``: devices the model is sharded over."""
    import torch

    from vlmtrain.parallel.memory_plan import MemoryPlan, shard, trace_step_memory

    d = cfg.data
    length = pack_length or (d.pack_length if isinstance(d.pack_length, int) and d.packing else None) or d.max_length
    rows = rows or cfg.train.per_device_train_batch_size
    model = build_meta_model(cfg)
    batch = made_up_batch(cfg, model, rows, length, patches or d.max_patches_per_pack)
    parts = trace_step_memory(model, batch, autocast=torch.bfloat16 if cfg.train.bf16 else None,
                              weight_decay=cfg.train.weight_decay)
    parts = shard(parts, model, fsdp_degree)
    notes = [f"(traced on the meta device: {rows} row(s) x {length} tokens"
             + (f", {batch['pixel_values'].shape[0] // rows} vision patches per row" if "pixel_values" in batch else "")
             + (f"; FSDP over {fsdp_degree} devices" if fsdp_degree > 1 else "") + ")"]
    return MemoryPlan(parts, tokens=rows * length, device_bytes=device_bytes, notes=notes)


def configured_device_bytes(cfg: RunConfig) -> int | None:
    """The memory the run plans against: ``data.device_memory`` if set, else the CUDA device's total memory, else
    None (no CUDA, no setting)."""
    from vlmtrain.parallel.memory_plan import device_memory

    if cfg.data.device_memory is not None:
        return device_memory(cfg.data.device_memory)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[1]
    return None


def _fsdp_degree(cfg: RunConfig, nproc: int | None = None) -> int:
    return (nproc or int(os.environ.get("WORLD_SIZE", "1"))) if cfg.train.fsdp else 1


def covered(cfg: RunConfig) -> bool:
    """Whether the plan knows how to make up a micro-batch for the run's model (causal_lm, Qwen-VL Hub VLMs)."""
    if cfg.model.kind == "causal_lm":
        return True
    if cfg.model.kind != "hub_vlm" or not cfg.model.pretrained:
        return False
    from vlmtrain.models.families import model_type_of

    try:
        return model_type_of(cfg.model.pretrained) in QWEN_VL
    except OSError:
        return False


def plan_report(cfg: RunConfig, device: str | None = None, nproc: int = 1) -> str:
    """What ``vlmtrain plan`` prints: the estimate per part and the total against the device (``device``: a name or
    size; default: data.device_memory, else the CUDA device); with data.pack_length auto, the budget it picks."""
    from vlmtrain.parallel.memory_plan import device_memory

    if device is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, device_memory=device))
    device_bytes = device_memory(device) if device is not None else configured_device_bytes(cfg)
    head = ""
    if cfg.data.pack_length == AUTO:
        length = auto_pack_length(cfg, nproc)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack_length=length))
        head = f"data.pack_length: auto -> {length}\n"
    kwargs = cfg.train.activation_checkpointing_kwargs
    if isinstance(kwargs, dict) and kwargs.get("mode") == AUTO:
        cfg = plan_checkpointing(cfg)
        head += f"activation_checkpointing_kwargs.mode: auto -> {cfg.train.activation_checkpointing_kwargs}\n"
    return head + estimate_step_memory(cfg, device_bytes, fsdp_degree=_fsdp_degree(cfg, nproc)).table()


def plan_token_budget(cfg: RunConfig) -> RunConfig:
    """Before training: ``data.pack_length: auto`` becomes the largest token budget whose plan fits the device
    (one log line); a fixed ``data.pack_length`` whose plan cannot fit is a ConfigError naming the estimate, the
    device's memory and the setting. Without CUDA and ``data.device_memory``, a fixed budget is not checked."""
    d = cfg.data
    if d.pack_length != AUTO:
        if not d.packing or d.pack_length is None or not covered(cfg):
            return cfg
        device = configured_device_bytes(cfg)
        if device is None:  # (no CUDA, no data.device_memory: nothing to check against)
            return cfg
        try:
            plan = estimate_step_memory(cfg, device, fsdp_degree=_fsdp_degree(cfg))
        except ConfigError:
            raise
        except Exception as e:  # (a model the trace cannot run: the run goes on unchecked, and says so)
            logger.warning("memory plan of data.pack_length=%s not made (%s: %s); training unchecked",
                           d.pack_length, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return cfg
        if not plan.fits():
            from vlmtrain.parallel.memory_plan import MARGIN, gib

            raise ConfigError(f"data.pack_length={d.pack_length} (data.packing: true) needs an estimated {gib(plan.total)} per step, more "
                              f"than {1 - MARGIN:.0%} of the device's {gib(plan.device_bytes)} (data.device_memory="
                              f"{d.device_memory or 'the CUDA device'}): lower data.pack_length or set it to auto (see `vlmtrain plan`).")
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(d, pack_length=auto_pack_length(cfg)))


def auto_pack_length(cfg: RunConfig, nproc: int | None = None) -> int:
    """The largest token budget (a multiple of 64, at least data.max_length) whose plan fits the device."""
    from vlmtrain.parallel.memory_plan import MARGIN, gib, largest_fitting

    device = configured_device_bytes(cfg)
    if device is None:
        raise ConfigError("data.pack_length: auto plans against the GPU's memory; without CUDA set "
                          "data.device_memory (e.g. 80GiB or h100-80gb) or a number for data.pack_length.")
    degree = _fsdp_degree(cfg, nproc)
    low = -(-cfg.data.max_length // 64) * 64

    def estimate(length: int) -> Any:
        return estimate_step_memory(cfg, device, pack_length=length, fsdp_degree=degree)

    found = largest_fitting(estimate, low, MAX_AUTO_PACK_LENGTH)
    if found is None:
        plan = estimate(low)
        raise ConfigError(f"data.pack_length: auto: even data.max_length={cfg.data.max_length} tokens need an "
                          f"estimated {gib(plan.total)} per step, more than {1 - MARGIN:.0%} of the device's "
                          f"{gib(device)}: lower data.max_length, use LoRA, activation checkpointing or more FSDP "
                          f"devices.")
    length, plan = found
    logger.warning("data.pack_length: auto -> %d tokens (estimated peak %s of the device's %s)", length,
                   gib(plan.total), gib(device))
    return length


def plan_checkpointing(cfg: RunConfig) -> RunConfig:
    """Before training: ``activation_checkpointing_kwargs: {mode: auto}`` becomes the policy that recomputes least
    (:data:`~vlmtrain.models.speed.checkpointing_policies.AUTO_CANDIDATES`) whose estimated step fits the device (one
    log line); a ConfigError when none fits, or when the plan cannot be made (no device memory known, a model the
    plan does not cover, ``data.pack_length: auto`` too)."""
    from vlmtrain.models.speed.checkpointing_policies import AUTO_CANDIDATES, AUTO_MODE, choose_policy
    from vlmtrain.parallel.memory_plan import MARGIN, gib

    t = cfg.train
    kwargs = t.activation_checkpointing_kwargs
    if not isinstance(kwargs, dict) or kwargs.get("mode") != AUTO_MODE:
        return cfg
    where = "activation_checkpointing_kwargs.mode: auto"
    if not t.activation_checkpointing:
        raise ConfigError(f"{where} chooses how layers are checkpointed, but train.activation_checkpointing is off: "
                          "turn it on, or drop the mode.")
    if cfg.data.pack_length == AUTO:
        raise ConfigError(f"{where} with data.pack_length: auto: the plan chooses one of them for a given other; set "
                          "data.pack_length to a number (see `vlmtrain plan`), or a mode.")
    if not covered(cfg):
        raise ConfigError(f"{where}: vlmtrain's memory plan covers model.kind causal_lm and the Qwen-VL Hub VLMs "
                          f"({', '.join(QWEN_VL)}); give the mode itself (full, selective or attention).")
    device = configured_device_bytes(cfg)
    if device is None:
        raise ConfigError(f"{where} plans against the GPU's memory; without CUDA set data.device_memory (e.g. "
                          "80GiB or h100-80gb), or give the mode itself.")
    degree, totals = _fsdp_degree(cfg), {}
    others = {k: v for k, v in kwargs.items() if k != "mode"}
    candidates = [{**others, "mode": mode, **extra} for mode, extra in AUTO_CANDIDATES]
    for i in reversed(range(len(candidates))):  # (a tie goes to the policy that recomputes less: the later one)
        totals[i] = estimate_step_memory(_with_checkpointing(cfg, candidates[i]), device, fsdp_degree=degree).total
    best = choose_policy(totals, int(device * (1 - MARGIN)))
    if best is None:
        raise ConfigError(f"{where}: even full checkpointing needs an estimated {gib(totals[0])} per step, more than "
                          f"{1 - MARGIN:.0%} of the device's {gib(device)}: lower the token budget "
                          "(data.pack_length / data.max_length, per_device_train_batch_size), use LoRA or more FSDP "
                          "devices.")
    mode, extra = AUTO_CANDIDATES[best]
    logger.warning("%s -> %s (estimated peak %s of the device's %s)", where,
                   ", ".join(f"{k}: {v}" for k, v in {"mode": mode, **extra}.items()), gib(totals[best]), gib(device))
    return _with_checkpointing(cfg, candidates[best])


def _with_checkpointing(cfg: RunConfig, kwargs: dict[str, Any]) -> RunConfig:
    """``cfg`` with train.activation_checkpointing_kwargs (and transformers' older name, which mirrors it) set."""
    import copy

    train = copy.copy(cfg.train)
    train.activation_checkpointing_kwargs = kwargs
    if getattr(train, "gradient_checkpointing_kwargs", None) is not None:
        train.gradient_checkpointing_kwargs = kwargs
    return dataclasses.replace(cfg, train=train)
