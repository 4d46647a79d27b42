"""RewardTrainer's VLM path (TRL's RewardTrainer takes no VLM): the Hub VLM gets a ``reward`` score head
(models/heads.py) and each batch is a pair batch: the chosen samples, then the rejected ones, processed and laid
out by the family's own processing (data/hub_processing.py, data/hub_collate.py), with one margin per pair as the
head's label. Pairs come in TRL's layout: ``prompt`` / ``chosen`` / ``rejected`` (strings or message lists, or
message lists alone with the prompt implicit), an optional ``images`` column and ``margin``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..data.processing import SkipSample
from ..errors import ConfigError
from ..models.families import REGISTRY, get_family

HEAD = "reward"


def is_hub_vlm(model: str | nn.Module) -> bool:
    """Whether the model (a path or an object) is of a Hub VLM family vlmtrain knows."""
    from ..models.families import model_type_of

    model_type = model_type_of(model) if isinstance(model, str) else getattr(model.config, "model_type", "")
    return model_type in REGISTRY


def _text(content: Any) -> str:
    """A message's text: the string, or its text parts joined (image parts: the sample's images)."""
    if isinstance(content, str):
        return content
    return " ".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def _turns(messages: list[Mapping[str, Any]]) -> list[dict[str, str]]:
    turns: list[dict[str, str]] = []
    for m in messages:
        if m.get("role") == "user":
            turns.append({"user": _text(m.get("content", ""))})
        elif m.get("role") == "assistant" and turns and "assistant" not in turns[-1]:
            turns[-1]["assistant"] = _text(m.get("content", ""))
        else:
            raise ConfigError(f"a VLM reward pair's prompt has a {m.get('role')!r} message where vlmtrain's samples "
                              "take alternating user / assistant turns (no system turn yet).")
    return turns


def pair_samples(pair: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TRL-layout pair as two vlmtrain samples (the chosen, then the rejected answer to the same prompt and
    images; the images go first in the first user turn)."""
    chosen, rejected, prompt = pair.get("chosen"), pair.get("rejected"), pair.get("prompt")
    if chosen is None or rejected is None:
        raise ConfigError(f"a reward pair without 'chosen' or 'rejected' (it has {sorted(pair)}).")
    if prompt is None:
        if not isinstance(chosen, list):
            raise ConfigError("a VLM reward pair of plain strings needs a 'prompt' column (the answer's start "
                              "cannot be told from the prompt's).")
        prompt, chosen, rejected = chosen[:-1], chosen[-1:], rejected[-1:]
    turns = _turns(prompt) if isinstance(prompt, list) else [{"user": prompt}]
    answers = [_text(a[-1]["content"]) if isinstance(a, list) else a for a in (chosen, rejected)]
    images = pair.get("images") or []
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return tuple({"images": images, "texts": [*turns[:-1], {**turns[-1], "assistant": a}]}  # type: ignore[return-value]
                 for a in answers)


class VisionPairCollator:
    """Reward pairs with images as one pair batch for a Hub VLM with a ``reward`` head: the B chosen samples,
    then the B rejected ones, as the family's collator lays samples out, no LM targets, and ``labels_reward``
    (each pair's margin, 0 without). A pair whose chosen or rejected sample the processing skips (too long, a
    bad image, ...) is skipped whole and counted in ``skipped``."""

    keeps_columns = True  # (it reads images and texts: the Trainer keeps every column)

    def __init__(self, hub_processor: Any) -> None:
        from ..data.hub_collate import HubVLMCollator

        self.processor = hub_processor
        self.collate = HubVLMCollator(hub_processor)
        self.skipped: Counter[str] = Counter()

    def __call__(self, pairs: list[Mapping[str, Any]]) -> dict[str, Any]:
        chosen, rejected, margins = [], [], []
        for pair in pairs:
            try:
                c, r = (self.processor.process(s) for s in pair_samples(pair))
            except SkipSample as err:
                self.skipped[err.reason] += 1
                continue
            chosen.append(c)
            rejected.append(r)
            margins.append(float(pair.get("margin") or 0.0))
        if not chosen:
            raise ConfigError(f"every reward pair of a batch was skipped ({dict(self.skipped)}): check the pairs' "
                              "images and lengths (max_length).")
        batch = self.collate(chosen + rejected)
        batch.pop("labels", None)  # the reward head's loss alone: no LM targets
        batch[f"labels_{HEAD}"] = torch.tensor(margins, dtype=torch.float32)
        return batch


def vision_reward_setup(model: str | nn.Module, processing_class: Any, args: Any, peft_config: Any
                        ) -> tuple[nn.Module, Any, VisionPairCollator]:
    """(WithHeads(VLM, {reward}), processor, collator) for RewardTrainer: the VLM loaded from its path if need
    be, with ``peft_config``'s adapters, and a one-output ``reward`` head (``center_rewards_coefficient``)."""
    from ..data.hub_processing import HubVLMProcessor
    from ..models.heads import WithHeads

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
