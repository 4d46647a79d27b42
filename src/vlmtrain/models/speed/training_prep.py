"""What the Trainer has done to a model's structure before training, for TrainingArguments'
activation_checkpointing and torch_compile: transformers' activation checkpointing switched on in the models it
holds, and regional compilation of its transformer layers. They are vlmtrain.Trainer's
``activation_checkpointing`` and ``compile_model`` parts (trainer/parts.py)."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from ..protocol import REGIONAL_COMPILE_ATTR
from . import varlen_attention
from .checkpointing_policies import CONTEXTS, SELECTIVE_EVERY, checkpointing_mode


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer layers: the outermost instances of transformers' GradientCheckpointingLayer (every
    decoder layer and vision block of a transformers model)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(f"{o}.") for o in found):
            found[name] = module
    return list(found.values())


EAGER_ARGUMENT = "cu_seqlens"
"""Regional compile leaves out (runs eagerly) the submodules of a layer whose forward takes this argument: the
Qwen-VL vision attention, which splits its sequence at each image's boundary (python ints read from
``cu_seqlens``) and attends image by image. Traced, it would break the graph at the split and recompile for every
new number of images and image size; left out, the rest of the block (norms, MLP) compiles once."""


def compile_model(model: nn.Module, wrapped: nn.Module, backend: str, mode: str | None) -> nn.Module:
    """TrainingArguments.torch_compile. A model marked for regional compilation (REGIONAL_COMPILE_ATTR) has each of
    its transformer layers compiled in place (as ``nn.Module.compile`` does: parameter names and state dict
    unchanged; torchtitan's way: one small graph per layer type, reused by every copy, instead of one for the
    whole model, so compiling takes seconds and a graph break stays local) and ``wrapped`` (the model as DDP/FSDP
    wrap it) is returned as is; any other model is compiled whole: ``torch.compile(wrapped)``. Each layer type
    compiles once whatever the lengths and image counts: its own code object, dynamic shapes without duck sizing,
    inputs handed over alike, and the attention that reads python ints from the data left out (docs/speed.md)."""
    if not any(getattr(m, REGIONAL_COMPILE_ATTR, False) for m in model.modules()):
        return torch.compile(wrapped, backend=backend, mode=mode)
    layers = transformer_layers(model)
    if not layers:
        raise ConfigError(f"torch_compile: {type(model).__name__} asks to be compiled layer by layer but has no "
                          f"transformer layer (transformers' GradientCheckpointingLayer) to compile.")
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is not None or getattr(layer, COMPILED_INSIDE, False):
            continue  # (a second train() keeps the compiled layers)
        eager = [m for m in list(layer.modules())[1:]  # (the layer itself takes the boundaries to hand them on)
                 if EAGER_ARGUMENT in inspect.signature(m.forward).parameters]
        for module in eager:
            module.forward = torch.compiler.disable(module.forward)
        if (eager or _varlen_attention(layer)) and _compile_inside_checkpoint(layer, backend, mode):
            continue
        layer.forward = types.MethodType(own_code_copy(type(layer).forward, type(layer).__name__), layer)
        layer._compiled_call_impl = without_duck_sizing(
            torch.compile(layer._call_impl, backend=backend, mode=mode, dynamic=True))
    return wrapped


COMPILED_INSIDE = "vlmtrain_compiled_inside_checkpoint"
"""Set on a layer whose forward (without transformers' checkpointing wrapper) is compiled (_compile_inside_checkpoint)."""


def _varlen_attention(layer: nn.Module) -> bool:
    """The layer attends with model.attn_implementation varlen_torch (its documents: python ints, run eagerly)."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == varlen_attention.NAME
               for m in layer.modules())


def _compile_inside_checkpoint(layer: nn.Module, backend: str, mode: str | None) -> bool:
    """Compile the layer's own forward and leave transformers' checkpointing wrapper around it eager (False where
    the installed transformers' wrapper has no such inner forward). A layer whose graph breaks (an attention run
    eagerly) cannot be compiled with its checkpoint: dynamo traces torch.utils.checkpoint as one region that must
    not break, and runs the whole layer eagerly instead. Inside the checkpoint it compiles as without it, and the
    recomputation in backward runs the compiled forward again."""
    wrapper = type(layer).forward
    names = wrapper.__code__.co_freevars
    if "forward" not in names:
        return False
    cells = dict(zip(names, wrapper.__closure__))
    inner = own_code_copy(cells["forward"].cell_contents, type(layer).__name__)
    compiled = without_duck_sizing(torch.compile(inner, backend=backend, mode=mode, dynamic=True))
    closure = tuple(types.CellType(compiled) if n == "forward" else cells[n] for n in names)
    own = types.FunctionType(wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, closure)
    own.__kwdefaults__ = wrapper.__kwdefaults__
    layer.forward = types.MethodType(functools.wraps(wrapper)(own), layer)
    setattr(layer, COMPILED_INSIDE, True)
    return True


def without_duck_sizing(compiled: Any) -> Any:
    """``compiled`` called with duck sizing off: by default dynamo gives sizes that happen to be equal when it
    compiles (e.g. a batch's 1,024 vision patches and a hidden size of 1,024) one symbol, and that guess then
    specializes the patch count to the hidden size and recompiles at the next batch. Positional tensors that are
    not views are handed over as views of themselves: dynamo guards a view input (the first vision block's, a
    reshape of the patch embedding) by its base too, and would otherwise compile a second graph for the rest."""
    from torch.fx.experimental import _config as fx_config

    @functools.wraps(compiled)
    def call(*args: Any, **kwargs: Any) -> Any:
        args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and not a._is_view() else a for a in args)
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


@functools.cache
def own_code_copy(fn: Any, owner: str) -> Any:
    """``fn`` with a code object of ``owner``'s own. transformers wraps every layer class's forward in the same
    function (GradientCheckpointingLayer's forward_with_checkpointing; some forwards also in a shared deprecation
    decorator), and dynamo keeps its compiled graphs, its recompile limit and its record of which sizes changed
    (automatic dynamic shapes) per code object: shared, a vision block's 2-D inputs and a decoder layer's 3-D ones
    would evict and recompile each other's graphs. One copy per class (cached), shared by its instances, set on
    each (``type(layer).forward`` stays the wrapper, which checks that it is the outermost one)."""
    code = fn.__code__.replace(co_name=f"{owner}_{fn.__code__.co_name}",
                               co_qualname=f"{owner}.{fn.__code__.co_name}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return functools.wraps(fn)(own)


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
    as transformers' Trainer splits them (every_n_layers, offload; the rest go to torch.utils.checkpoint) plus
    vlmtrain's ``mode`` and ``selective_every_n_layers`` (models/speed/checkpointing_policies.py: ``selective`` and
    ``attention`` become torch.utils.checkpoint's context_fn)."""
    mode = checkpointing_mode(kwargs)
    kwargs = dict(kwargs or {})
    kwargs.pop("mode", None)
    every = kwargs.pop(SELECTIVE_EVERY, 1)
    options = {"every_n_layers": kwargs.pop("every_n_layers", 1), "offload": kwargs.pop("offload", False)}
    if mode in CONTEXTS:
        kwargs = {"use_reentrant": False, **kwargs}
        if every == 1:
            kwargs["context_fn"] = CONTEXTS[mode]
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
    if every > 1:
        _selective_every(targets, every)


def _selective_every(targets: list[nn.Module], every: int) -> None:
    """The checkpointed transformer layers (in module order, counted as transformers counts every_n_layers) at
    0, k, 2k, ... get the ``selective`` context; the others keep full recomputation."""
    layers = [m for t in targets for m in transformer_layers(t) if getattr(m, "gradient_checkpointing", False)]
    if not layers:
        raise ConfigError(f"activation_checkpointing_kwargs.{SELECTIVE_EVERY}: the model has no checkpointed "
                          f"transformer layer (transformers' GradientCheckpointingLayer) to pick from; drop "
                          f"{SELECTIVE_EVERY}.")
    for layer in layers[::every]:
        layer._gradient_checkpointing_func = functools.partial(layer._gradient_checkpointing_func,
                                                               context_fn=CONTEXTS["selective"])
