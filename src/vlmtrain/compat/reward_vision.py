"""RewardTrainer's VLM path (TRL's RewardTrainer takes no VLM): the Hub VLM gets a ``reward`` score head
(models/objectives/heads.py) and each batch is a pair batch: the chosen samples, then the rejected ones, processed and laid
out by the family's own processing (data/hub_processing.py, data/hub_collate.py), with one margin per pair as the
head's label. Pairs come in TRL's layout: ``prompt`` / ``chosen`` / ``rejected`` (strings or message lists, or
message lists alone with the prompt implicit), an optional ``images`` column and ``margin``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data.vision_reward_pairs import HEAD, VisionPairCollator, pair_samples  # noqa: F401 (their home before)
from ..models.families import REGISTRY, get_family


def is_hub_vlm(model: str | nn.Module) -> bool:
    """Whether the model (a path or an object) is of a Hub VLM family vlmtrain knows."""
    from ..models.families import model_type_of

    model_type = model_type_of(model) if isinstance(model, str) else getattr(model.config, "model_type", "")
    return model_type in REGISTRY


def vision_reward_setup(model: str | nn.Module, processing_class: Any, args: Any, peft_config: Any
                        ) -> tuple[nn.Module, Any, VisionPairCollator]:
    """(WithHeads(VLM, {reward}), processor, collator) for RewardTrainer: the VLM loaded from its path if need
    be, with ``peft_config``'s adapters, and a one-output ``reward`` head (``center_rewards_coefficient``)."""
    from ..data.hub_processing import HubVLMProcessor
    from ..models.objectives.heads import WithHeads

    if isinstance(model, str):
        from ..models.families import model_type_of

        family = get_family(model_type_of(model))
        if processing_class is None:
            processing_class = family.load_processor(model)
        from transformers import AutoModelForImageTextToText

        kwargs = {"dtype": torch.float32, **(args.model_init_kwargs or {})}
        model = AutoModelForImageTextToText.from_pretrained(model, **kwargs)
    else:
        family = get_family(model.config.model_type)
        if processing_class is None:
            processing_class = family.load_processor(model.config._name_or_path)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    heads = WithHeads(model, {HEAD: {"type": "reward", "center_rewards_coefficient": args.center_rewards_coefficient}})
    hub_processor = HubVLMProcessor(processing_class, family, max_length=args.max_length or 1 << 30,
                                    max_images=64, prompts=False)
    return heads, processing_class, VisionPairCollator(hub_processor)
