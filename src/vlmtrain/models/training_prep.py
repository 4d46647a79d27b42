"""What the Trainer has done to a model's structure before training, for TrainingArguments'
activation_checkpointing and torch_compile: transformers' activation checkpointing switched on in the models it
holds, and regional compilation of its transformer layers. ``import vlmtrain`` puts them in the trainer's
``activation_checkpointing`` and ``compile_model`` slots (trainer/plugins.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .protocol import REGIONAL_COMPILE_ATTR


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer layers: the outermost instances of transformers' GradientCheckpointingLayer (every
    decoder layer and vision block of a transformers model)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(f"{o}.") for o in found):
            found[name] = module
    return list(found.values())


def compile_model(model: nn.Module, wrapped: nn.Module, backend: str, mode: str | None) -> nn.Module:
    """TrainingArguments.torch_compile. A model marked for regional compilation (REGIONAL_COMPILE_ATTR) has each of
    its transformer layers compiled in place (``nn.Module.compile``: parameter names and state dict unchanged;
    torchtitan's way: one small graph per layer type, reused by every copy, instead of one for the whole model,
    so compiling takes seconds and a graph break stays local) and ``wrapped`` (the model as DDP/FSDP wrap it) is
    returned as is; any other model is compiled whole: ``torch.compile(wrapped)``."""
    if not any(getattr(m, REGIONAL_COMPILE_ATTR, False) for m in model.modules()):
        return torch.compile(wrapped, backend=backend, mode=mode)
    layers = transformer_layers(model)
    if not layers:
        raise ConfigError(f"torch_compile: {type(model).__name__} asks to be compiled layer by layer but has no "
                          f"transformer layer (transformers' GradientCheckpointingLayer) to compile.")
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:  # (a second train() keeps the compiled layers)
            layer.compile(backend=backend, mode=mode)
    return wrapped


def _checkpointable(model: nn.Module) -> list[nn.Module]:
    """The model itself if it offers activation checkpointing, else its outermost submodules that do (e.g. the
    transformers model inside a wrapper that adds heads)."""
    def offers(m: nn.Module) -> bool:
        return hasattr(m, "activation_checkpointing_enable") or hasattr(m, "gradient_checkpointing_enable")

    if offers(model):
        return [model]
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if offers(module) and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = module
    return list(found.values())


def enable_activation_checkpointing(model: nn.Module, kwargs: dict[str, Any] | None) -> None:
    """transformers' activation_checkpointing_enable() (or its older name gradient_checkpointing_enable) on the
    model, or on the transformers models inside it, with TrainingArguments.activation_checkpointing_kwargs split
    as transformers' Trainer splits them (every_n_layers, offload; the rest go to torch.utils.checkpoint)."""
    kwargs = dict(kwargs or {})
    options = {"every_n_layers": kwargs.pop("every_n_layers", 1), "offload": kwargs.pop("offload", False)}
    targets = _checkpointable(model)
    if not targets:
        raise ConfigError(f"activation_checkpointing (gradient_checkpointing) needs a model with "
                          f"activation_checkpointing_enable(), as transformers models have; {type(model).__name__} "
                          f"has none and holds none. Turn it off, or use torch.utils.checkpoint in the model.")
    for target in targets:
        try:
            if hasattr(target, "activation_checkpointing_enable"):
                target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None, **options)
            else:  # a model outside transformers that has only the older name
                target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, **options)
        except ValueError as e:  # transformers: "<class> does not support activation checkpointing."
            raise ConfigError(f"activation_checkpointing (gradient_checkpointing): {e} Turn it off for this "
                              f"model.") from e
