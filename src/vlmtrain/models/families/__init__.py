"""Hub VLM families: one module per family (defining FAMILY), one registry line per model_type here.

A family module states only what differs; what they share lives once: processor loading and the image-only
processor classes (processors.py), the tiny builders' tokenizer and save (tiny.py), the chat templates
(templates/), per-family image-token counts for the FLOP count (image_tokens.py; Qwen's in qwen_common.py).

Modules are imported on first use, so the core never imports what a run does not need.
"""

from __future__ import annotations

import importlib
import json
import os

from ...errors import ConfigError
from .base import Family, Layout

# model_type (config.json) -> module that defines FAMILY
REGISTRY: dict[str, str] = {
    "qwen3_vl": "vlmtrain.models.families.qwen3_vl",
    "qwen2_5_vl": "vlmtrain.models.families.qwen2_5_vl",
    "idefics3": "vlmtrain.models.families.idefics3",
    "smolvlm": "vlmtrain.models.families.idefics3",
    "llava_onevision": "vlmtrain.models.families.llava_onevision",
    "gemma3": "vlmtrain.models.families.gemma3",
}


def get_family(model_type: str) -> Family:
    """The family record of a model_type; a ConfigError naming the supported ones otherwise."""
    if model_type not in REGISTRY:
        raise ConfigError(f"model_type {model_type!r} is not a supported Hub VLM family; supported: "
                          f"{', '.join(sorted(REGISTRY))}.")
    return importlib.import_module(REGISTRY[model_type]).FAMILY


def model_type_of(pretrained: str) -> str:
    """The model_type of a Hub id or a local directory (its config.json)."""
    path = os.path.join(pretrained, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f).get("model_type", "")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(pretrained).model_type


def family_of(pretrained: str, key: str | None = None) -> Family:
    """The family of a Hub id or local checkpoint directory; with ``key`` (the setting that names it, e.g.
    ``model.pretrained``) one that transformers cannot load is a one-line ConfigError naming the key."""
    try:
        return get_family(model_type_of(pretrained))
    except OSError as err:
        if key is None:
            raise
        raise ConfigError(f"{key}: {pretrained!r} is no local directory and transformers could not load it as a "
                          f"Hub id: {str(err).splitlines()[0]}") from None


__all__ = ["REGISTRY", "Family", "Layout", "family_of", "get_family", "model_type_of"]
