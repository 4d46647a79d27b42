"""Build a causal LM from a config dict (random init) or from pretrained weights."""

from __future__ import annotations

import difflib
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ...errors import ConfigError
from ..meta import from_pretrained


def check_model_type(config: dict[str, Any]) -> str:
    """The config's model_type, if transformers has a causal LM for it; else a ConfigError with suggestions."""
    model_type = config.get("model_type")
    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if not model_type:
        raise ConfigError(
            "model.config.model_type is required when model.pretrained is not set "
            "(a transformers causal LM type such as 'llama', 'qwen2' or 'gpt2')."
        )
    if model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        near = difflib.get_close_matches(str(model_type), causal, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
        what = (
            "has no causal LM class"
            if model_type in CONFIG_MAPPING
            else "is not a known transformers model type"
        )
        raise ConfigError(f"model.config.model_type={model_type!r} {what}.{hint}")
    return model_type


def build_causal_lm(
    config: dict[str, Any] | None = None,
    pretrained: str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    seed: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Return an ``AutoModelForCausalLM``.

    With ``pretrained`` (Hub name or local dir) the weights are loaded (``config`` entries other than
    ``model_type`` override config fields). Otherwise ``config["model_type"]`` picks the architecture,
    the remaining keys go to ``AutoConfig.for_model``, and the model is randomly initialized (under
    ``torch.manual_seed(seed)`` when ``seed`` is given, so the init is reproducible). ``dtype`` is the
    parameters' dtype (bfloat16: half the memory, and the optimizer then updates bfloat16 weights).
    With ``tokenizer``, vocab size and pad/bos/eos ids follow the tokenizer.
    """
    config = dict(config or {})
    if pretrained is not None:
        config.pop("model_type", None)
        model = from_pretrained(AutoModelForCausalLM, pretrained, dtype=dtype, **config)  # (meta device: config only)
    else:
        model_type = check_model_type(config)
        rest = {k: v for k, v in config.items() if k != "model_type"}
        if tokenizer is not None:
            # Token ids must agree with the tokenizer, or generate() never stops and padding is wrong.
            rest["vocab_size"] = len(tokenizer)
            for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
                rest[name] = getattr(tokenizer, name)
        model_config = AutoConfig.for_model(model_type, **rest)
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)

    if tokenizer is not None:
        if pretrained is not None and model.get_input_embeddings().num_embeddings < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer))
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(tokenizer, name)
            if value is not None:
                setattr(model.config, name, value)
                if model.generation_config is not None:
                    setattr(model.generation_config, name, value)
    return model
