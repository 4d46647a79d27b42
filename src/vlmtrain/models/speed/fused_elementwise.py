"""TrainingArguments.fuse_elementwise: the elementwise regions of a transformers model (its RMSNorms, gated MLPs
and rotary embeddings) compiled one by one with torch.compile, so that inductor fuses each into a few kernels,
without compiling the model or its layers whole: the path for a machine without Liger Kernel, or a family Liger
does not cover (models/speed/liger.py), and for a model whose attention breaks the graph of a whole-layer compile.

Each region is compiled once per class (its forward has a code object of the class's own, so dynamo's graphs and
recompile counts are per region), with dynamic shapes and without duck sizing: a new sequence length, batch of
images or pack reuses the graphs of the first step. A module's forward is swapped on the instance only; the
rotary functions too, through a copy of each attention forward that resolves ``apply_*rotary*`` to the compiled
function (transformers' modeling module and any other model in the process keep the plain ones). The parameters,
their names and the state dict stay the model's. It is vlmtrain.Trainer's ``fuse_elementwise`` part
(trainer/parts.py), applied where the Trainer prepares the model, before activation checkpointing.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from .training_prep import own_code_copy, without_duck_sizing

MODES = ("compile",)
FUSED = "vlmtrain_fused_elementwise"
"""Set on a module whose forward fuse_elementwise swapped (a second call leaves it as it is)."""


def is_norm(module: nn.Module) -> bool:
    """An RMSNorm of a transformers model (every family names its class ``...RMSNorm``; Gemma's, which scales by
    1 + weight, too: the compiled forward is the class's own)."""
    return type(module).__name__.endswith("RMSNorm")


def is_gated_mlp(module: nn.Module) -> bool:
    """A gated MLP, down(act(gate(x)) * up(x)): SwiGLU (Llama, Qwen) or GeGLU (Gemma)."""
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def rotary_names(module: nn.Module) -> list[str]:
    """The rotary functions (``apply_*rotary*`` of its modeling module) that the module's own forward calls."""
    return _rotary_names(_innermost(type(module).forward))


def _rotary_names(fn: Any) -> list[str]:
    return sorted(n for n in fn.__code__.co_names if n.startswith("apply_") and "rotary" in n
                  and isinstance(fn.__globals__.get(n), types.FunctionType))


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"fuse_elementwise={mode!r}: the choices are {', '.join(MODES)} (or null: off).")


def fuse_elementwise(model: nn.Module, mode: str = "compile", backend: str = "inductor") -> dict[str, list[str]]:
    """TrainingArguments.fuse_elementwise: the model's RMSNorms, gated MLPs and the rotary functions of its
    attention modules compiled region by region, in place. Returns what was fused: ``norm``, ``gated_mlp`` and
    ``rotary`` -> the qualified names of those modules (for ``rotary``, the attention modules). A ConfigError
    for another mode, or a model with none of them."""
    _check_mode(mode)
    fused: dict[str, list[str]] = {"norm": [], "gated_mlp": [], "rotary": []}
    for name, module in model.named_modules():
        if getattr(module, FUSED, False):
            continue
        kind = "norm" if is_norm(module) else "gated_mlp" if is_gated_mlp(module) else None
        if kind is not None:
            module.forward = types.MethodType(_compiled(type(module).forward, type(module).__name__, backend), module)
        elif rotary_names(module):
            kind = "rotary"
            module.forward = types.MethodType(_with_rotary_compiled(type(module).forward, backend), module)
        if kind is not None:
            setattr(module, FUSED, True)
            fused[kind].append(name)
    if not any(fused.values()) and not any(getattr(m, FUSED, False) for m in model.modules()):
        raise ConfigError(f"fuse_elementwise={mode!r} compiles a transformers model's RMSNorms, gated MLPs "
                          f"(gate_proj/up_proj/down_proj) and rotary embeddings; {type(model).__name__} has none. "
                          f"Set fuse_elementwise: null for this model (train.torch_compile compiles any model).")
    return fused


def check_fuse_args(args: Any) -> None:
    """The arguments' fuse_elementwise setting on its own (no model needed; the YAML path calls it before the
    weights load): a known mode, and not with torch_compile, which compiles whole layers, these modules included."""
    if not args.fuse_elementwise:
        return
    _check_mode(args.fuse_elementwise)
    if args.torch_compile or args.torch_compile_backend or args.torch_compile_mode:
        raise ConfigError(f"fuse_elementwise={args.fuse_elementwise!r} with torch_compile: torch_compile compiles "
                          f"every transformer layer whole, its norms, MLPs and rotary embeddings included; set one of "
                          f"them.")


def fuse_elementwise_part(model: nn.Module, args: Any) -> dict[str, list[str]]:
    """The Trainer's ``fuse_elementwise`` part (trainer/parts.py): :func:`check_fuse_args` before the first step,
    then :func:`fuse_elementwise` with the arguments' mode."""
    check_fuse_args(args)
    return fuse_elementwise(model, args.fuse_elementwise)


@functools.cache
def _compiled(fn: Any, owner: str, backend: str) -> Any:
    """``fn`` compiled with dynamic shapes, under a code object of ``owner``'s own; one per (function, owner),
    shared by the instances."""
    return without_duck_sizing(torch.compile(own_code_copy(fn, owner), backend=backend, dynamic=True))


def forward_with_globals(forward: Any, replacements: dict[str, Any]) -> Any:
    """A copy of ``forward`` whose innermost function (under the functools.wraps wrappers around it, e.g.
    transformers' deprecate_kwarg) resolves the global names in ``replacements`` to them: the function it calls
    swapped for one module instance, not in its modeling module."""
    inner = getattr(forward, "__wrapped__", None)
    if inner is None:
        return _function(forward, {**forward.__globals__, **replacements}, forward.__closure__)
    new_inner = forward_with_globals(inner, replacements)
    cells = forward.__closure__ or ()
    if not any(_content(c) is inner for c in cells):
        raise ConfigError(f"{forward.__qualname__} wraps {inner.__qualname__} in a way vlmtrain cannot copy, so "
                          f"its {', '.join(replacements)} cannot be swapped on its own.")
    closure = tuple(types.CellType(new_inner) if _content(c) is inner else c for c in cells)
    copy = _function(forward, forward.__globals__, closure)
    copy.__wrapped__ = new_inner
    return copy


def _with_rotary_compiled(forward: Any, backend: str) -> Any:
    """A copy of ``forward`` that calls compiled versions of its rotary functions."""
    inner = _innermost(forward)
    owner = inner.__module__.rsplit(".", 1)[-1]
    return forward_with_globals(forward, {n: _compiled(inner.__globals__[n], owner, backend)
                                          for n in _rotary_names(inner)})


def _innermost(fn: Any) -> Any:
    while getattr(fn, "__wrapped__", None) is not None:
        fn = fn.__wrapped__
    return fn


def _content(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return None


def _function(fn: Any, globals_: dict, closure: tuple | None) -> Any:
    copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy = functools.wraps(fn)(copy)
    del copy.__wrapped__  # (the original's: the copy's own is set by its caller)
    return copy
