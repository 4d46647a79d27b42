"""model.kind: hub_vlm — a transformers VLM (Qwen3-VL, Qwen2.5-VL, SmolVLM/Idefics3, LLaVA-OneVision,
Gemma 3) loaded from model.pretrained, processed by its own processor, with optional score heads and LoRA."""

from __future__ import annotations

from typing import Any

from vlmtrain.errors import ConfigError
from vlmtrain.models.kinds import ModelKind


def check(cfg: Any) -> None:
    if not cfg.model.pretrained:
        raise ConfigError("model.kind='hub_vlm' needs model.pretrained: a Hub id (e.g. Qwen/Qwen3-VL-8B-Instruct) "
                          "or a local directory written by save_pretrained.")


def build(cfg: Any, source: dict[str, Any], checkpoint: str | None = None) -> dict[str, Any]:
    raise NotImplementedError("hub_vlm is being wired in (issue 13)")


def owns_checkpoint(config: dict[str, Any]) -> bool:
    from vlmtrain.models.families import REGISTRY

    return config.get("model_type") in REGISTRY


KIND = ModelKind("hub_vlm", build=build, check=check, owns_checkpoint=owns_checkpoint)
