"""TrainingArguments.use_liger_kernel / liger_kernel_config: Liger Kernel's Triton kernels (RMSNorm, rotary
embeddings, SwiGLU / GeGLU, LayerNorm) in a Hub VLM of a family Liger covers, keeping vlmtrain's own chunked LM
loss (models/speed/lm_loss.py): Liger's fused linear cross-entropy and cross-entropy, which would replace the model's
forward or transformers' loss, are never applied.

vlmtrain applies Liger's building blocks itself, module by module on the model instance, as Liger's per-family
patch does (the modules :func:`liger_plan` finds: every RMSNorm, the text MLPs, the vision tower's LayerNorms, the
attention modules' rotary functions), and imports only those blocks (KERNEL_MODULES): Liger's per-model patch
modules (``liger_kernel.transformers.monkey_patch``, ``liger_kernel.transformers.model.*``, what transformers'
Trainer calls with ``use_liger_kernel=True``) import output classes that transformers 5.23 removed, and are never
imported. Nothing changes in transformers' modeling modules: the rotary functions are swapped through a copy of
each attention forward (models/speed/fused_elementwise.py), so a model built later in the process is transformers' own.

Bad input is a ConfigError before training, naming the setting: liger-kernel not installed, no CUDA device (the
kernels are Triton, GPU only), a model of a family Liger does not cover, a loss kernel or an unknown option in
liger_kernel_config, a kernel that finds no module in the model. :func:`apply_liger_kernel` is vlmtrain.Trainer's
``liger_kernel`` part (trainer/parts.py); the hub_vlm kind checks a run's config with :func:`check_liger` before
loading the model.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ...errors import ConfigError
from .fused_elementwise import forward_with_globals, is_gated_mlp, is_norm, rotary_names

INSTALL = "pip install 'vlmtrain[liger]'"
LOSS_KERNELS = ("fused_linear_cross_entropy", "cross_entropy")
"""Liger's loss options, always off: vlmtrain computes the LM loss itself (chunked, at the targets only)."""

COVERED: dict[str, str] = {
    "qwen3_vl": "RMSNorm (text model, q/k norms included), RoPE (text and vision), SwiGLU (text MLPs)",
    "qwen2_5_vl": "RMSNorm (text model and vision blocks), RoPE (text and vision), SwiGLU (text MLPs)",
    "gemma3": "RMSNorm (text model, projector), RoPE, GeGLU (text MLPs), LayerNorm (SigLIP vision tower)",
    "smolvlm": "RMSNorm, RoPE and SwiGLU (its Llama text model), LayerNorm (vision tower)",
}
"""model_type -> what Liger's kernels replace (FAMILY_KERNELS: the options), for vlmtrain's Hub VLM families that
Liger covers (liger-kernel 0.6-0.8; LLaVA-OneVision and Idefics3 it does not). Qwen3-VL's SwiGLU is on by default
(Liger's qwen3_vl patch takes a ``swiglu`` option but applies nothing; its SwiGLU forward is what it binds for
Qwen2.5-VL) unless liger_kernel_config says ``swiglu: false``. The rotary functions are Liger's plain ones for
Qwen2.5-VL too: transformers 5.x mixes the multimodal sections in the rotary embedding and calls the plain
functions."""


def liger_version() -> str | None:
    """The installed liger-kernel's version, None when it is not installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    try:
        return importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:  # (installed without metadata, e.g. a copied tree)
        return "unknown"


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def devices_off_cuda(model: nn.Module) -> list[str]:
    """The device types other than CUDA (and meta: weights still to come) that the model's parameters are on."""
    return sorted({p.device.type for p in model.parameters()} - {"cuda", "meta"})


def check_kernel_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """liger_kernel_config as Liger's keyword arguments: a mapping of option -> bool, with the loss kernels off
    (one set to true is an error: vlmtrain keeps its own LM loss)."""
    if config is None:
        return {}
    if not isinstance(config, Mapping) or not all(isinstance(v, bool) for v in config.values()):
        raise ConfigError(f"liger_kernel_config must map Liger's options to true/false (e.g. {{'rope': false}}), "
                          f"got {config!r}.")
    for key, value in config.items():
        if key in LOSS_KERNELS and value:
            raise ConfigError(f"liger_kernel_config[{key!r}]=true: vlmtrain computes the LM loss itself (chunked, "
                              f"at the target tokens only, without full logits), so Liger's "
                              f"{' and '.join(LOSS_KERNELS)} stay off. Drop the key, or set it false.")
    return dict(config)


def check_liger(model_type: str, config: Mapping[str, Any] | None = None) -> None:
    """Whether use_liger_kernel can apply to a model of ``model_type``: its liger_kernel_config, a family Liger
    covers, liger-kernel installed, a CUDA device. A ConfigError naming what is missing otherwise."""
    check_kernel_config(config)
    if model_type not in COVERED:
        raise ConfigError(f"use_liger_kernel=true: vlmtrain applies Liger's kernels to the Hub VLM families Liger "
                          f"covers ({', '.join(COVERED)}); this model's family, {model_type!r}, is not one of them. "
                          f"Set use_liger_kernel: false for this model.")
    if liger_version() is None:
        raise ConfigError(f"use_liger_kernel=true needs liger-kernel, which is not installed: {INSTALL} (or pip "
                          f"install liger-kernel), or set use_liger_kernel: false.")
    if not cuda_available():
        raise ConfigError("use_liger_kernel=true: Liger's kernels are Triton kernels and run on a CUDA GPU, and "
                          "none is visible here. Train on a GPU, or set use_liger_kernel: false.")


def liger_target(model: nn.Module) -> nn.Module:
    """The transformers model Liger patches: the outermost transformers PreTrainedModel the model is or holds
    (inside score heads or peft's LoRA wrapper). A ConfigError when there is none."""
    from transformers import PreTrainedModel

    for module in model.modules():  # (pre-order: the outermost first)
        if isinstance(module, PreTrainedModel):
            return module
    raise ConfigError(f"use_liger_kernel=true patches a transformers Hub VLM (model.kind hub_vlm) of a family Liger "
                      f"covers ({', '.join(COVERED)}); {type(model).__name__} is not one and holds none. Set "
                      f"use_liger_kernel: false for this model.")


FAMILY_KERNELS: dict[str, dict[str, bool]] = {
    "qwen3_vl": {"rope": True, "rms_norm": True, "swiglu": True},
    "qwen2_5_vl": {"rope": True, "rms_norm": True, "swiglu": True},
    "gemma3": {"rope": True, "rms_norm": True, "geglu": True, "layer_norm": True},
    "smolvlm": {"rope": True, "rms_norm": True, "swiglu": True, "layer_norm": True},
}
"""model_type -> Liger's kernel options for it (the names of Liger's patch for the family) and their defaults."""
ROTARY = {"apply_rotary_pos_emb": "liger_rotary_pos_emb", "apply_rotary_pos_emb_vision": "liger_rotary_pos_emb_vision"}
"""transformers' rotary functions -> Liger's (liger_kernel.transformers.rope) that replace them."""
VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""Module names of the vision towers: Liger's SwiGLU / GeGLU go to the text MLPs only, its LayerNorm to the towers."""
KERNEL_MODULES = {"rms_norm": "liger_kernel.transformers.rms_norm", "swiglu": "liger_kernel.transformers.swiglu",
                  "geglu": "liger_kernel.transformers.geglu", "layer_norm": "liger_kernel.transformers.layer_norm",
                  "rope": "liger_kernel.transformers.rope"}
"""The only modules of liger-kernel vlmtrain imports: its building blocks, never its per-model patches
(liger_kernel.transformers.monkey_patch / .model.*, which fail to import with transformers >= 5.23)."""


def liger_plan(target: nn.Module, options: Mapping[str, bool] | None = None) -> dict[str, list[str]]:
    """Which modules of ``target`` (a transformers model of a covered family) get which Liger kernel: kernel
    option -> qualified module names, for the options on (the family's defaults updated by ``options``).
    rms_norm: every RMSNorm; swiglu / geglu: the gated MLPs outside the vision tower; layer_norm: the vision
    tower's LayerNorms; rope: the attention modules that call transformers' rotary functions (ROTARY)."""
    kernels = {k: v for k, v in {**FAMILY_KERNELS[target.config.model_type], **(options or {})}.items()
               if v and k in KERNEL_MODULES}
    plan: dict[str, list[str]] = {k: [] for k in kernels}
    mlp = "swiglu" if "swiglu" in kernels else "geglu" if "geglu" in kernels else None
    for name, module in target.named_modules():
        vision = any(part in VISION_TOWERS for part in name.split("."))
        if "rms_norm" in plan and is_norm(module):
            plan["rms_norm"].append(name)
        elif "layer_norm" in plan and vision and isinstance(module, nn.LayerNorm):
            plan["layer_norm"].append(name)
        elif mlp and not vision and is_gated_mlp(module):
            plan[mlp].append(name)
        elif "rope" in plan and set(rotary_names(module)) & set(ROTARY):
            plan["rope"].append(name)
    return plan


def apply_liger_kernel(model: nn.Module, liger_kernel_config: Mapping[str, Any] | None = None) -> dict[str, list[str]]:
    """TrainingArguments.use_liger_kernel: Liger's kernels in the transformers model inside ``model``, in place on
    the instance (:func:`liger_plan` says where), with ``liger_kernel_config`` as Liger's options for the family
    (transformers' semantics: unset ones take the defaults) and its loss kernels off. vlmtrain binds Liger's
    building blocks (LigerRMSNorm, LigerSwiGLUMLP / LigerGEGLUMLP, LigerLayerNorm forwards, its rotary functions)
    itself, as Liger's own patch would, without importing that patch. Call it with the model on its CUDA device.
    Returns the plan applied."""
    target = liger_target(model)
    model_type = target.config.model_type
    options = check_kernel_config(liger_kernel_config)
    check_liger(model_type, options)
    on_cpu = devices_off_cuda(model)
    if on_cpu:
        raise ConfigError(f"use_liger_kernel=true: the model is on {', '.join(on_cpu)}, but Liger's kernels run on "
                          f"CUDA. Train on the GPU (use_cpu: false), or set use_liger_kernel: false.")
    accepted = set(FAMILY_KERNELS[model_type])
    unknown = sorted(set(options) - accepted - set(LOSS_KERNELS))
    if unknown:
        raise ConfigError(f"liger_kernel_config: Liger's {model_type} patch has no option {', '.join(unknown)}; its "
                          f"options: {', '.join(sorted(accepted))}.")
    plan = liger_plan(target, options)
    missing = [k for k, names in plan.items() if not names]
    if missing:
        raise ConfigError(f"use_liger_kernel=true: this {model_type} model has no module for Liger's {missing[0]} "
                          f"kernel (the modeling code of transformers {_transformers_version()} differs from what "
                          f"vlmtrain expects). Set liger_kernel_config: {{{missing[0]}: false}}, or use_liger_kernel: "
                          f"false.")
    _check_activation(target, plan)
    kernels = {k: _import_kernel(k) for k in plan}
    modules = dict(target.named_modules())
    for kernel, names in plan.items():
        for name in names:
            _BIND[kernel](modules[name], kernels[kernel], model_type)
    return plan


def check_liger_args(args: Any) -> dict[str, Any] | None:
    """The arguments' Liger settings on their own (no model needed; the YAML path calls it before the weights
    load): liger_kernel_config needs use_liger_kernel and keeps the loss kernels off; fuse_elementwise would
    compile what the kernels replace. Returns the checked liger_kernel_config. transformers checks none of them
    in its arguments."""
    config = args.liger_kernel_config
    if not (args.use_liger_kernel or config is not None):
        return None
    if not args.use_liger_kernel:
        raise ConfigError(f"liger_kernel_config={config!r} configures Liger's kernels, but use_liger_kernel is "
                          f"false: set use_liger_kernel: true, or drop liger_kernel_config.")
    if args.fuse_elementwise:
        raise ConfigError(f"fuse_elementwise={args.fuse_elementwise!r} with use_liger_kernel: Liger's kernels already "
                          f"replace the norms, MLPs and rotary embeddings it would compile; set one of them.")
    return check_kernel_config(config)


def liger_kernel_part(model: nn.Module, args: Any) -> dict[str, list[str]]:
    """The Trainer's ``liger_kernel`` part (trainer/parts.py): :func:`check_liger_args` before the first step,
    then :func:`apply_liger_kernel` (its checks of the model, the device, liger-kernel)."""
    check_liger_args(args)
    return apply_liger_kernel(model, args.liger_kernel_config)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _check_activation(target: nn.Module, plan: Mapping[str, list[str]]) -> None:
    """Liger's SwiGLU computes silu and its GeGLU tanh-approximated gelu: the text MLPs' activation must be it."""
    text = target.config.get_text_config(decoder=True)
    act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None)
    wants = {"swiglu": ("silu", "swish"), "geglu": ("gelu_pytorch_tanh", "gelu_new")}
    for kernel, acts in wants.items():
        if kernel in plan and act not in acts:
            raise ConfigError(f"use_liger_kernel=true: Liger's {kernel} computes {acts[0]}, but this model's text "
                              f"MLPs use {act!r}. Set liger_kernel_config: {{{kernel}: false}}.")


def _import_kernel(kernel: str) -> types.ModuleType:
    """Liger's module of ``kernel`` (KERNEL_MODULES); a ConfigError naming liger-kernel's version if it does not
    import."""
    try:
        return importlib.import_module(KERNEL_MODULES[kernel])
    except ImportError as err:
        raise ConfigError(f"use_liger_kernel=true: liger-kernel {liger_version()}'s {KERNEL_MODULES[kernel]} does "
                          f"not import ({err}). Install a liger-kernel that has it ({INSTALL}), set "
                          f"liger_kernel_config: {{{kernel}: false}}, or use_liger_kernel: false.") from err


def _bind(module: nn.Module, liger_class: type, **attributes: Any) -> None:
    """Liger's forward (and name) on the module instance, with the attributes Liger's forward reads."""
    for key, value in attributes.items():
        setattr(module, key, value)
    module.forward = types.MethodType(liger_class.forward, module)
    module._get_name = types.MethodType(lambda self: liger_class.__name__, module)


def _bind_rms_norm(module: nn.Module, kernels: types.ModuleType, model_type: str) -> None:
    # Gemma scales by (1 + weight) computed in float32 ("gemma" casting), and is not done in place (Liger's choice)
    gemma = {"offset": 1.0, "casting_mode": "gemma", "in_place": False} if model_type == "gemma3" else {
        "offset": 0.0, "casting_mode": "llama", "in_place": True}
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None) or 1e-6
    _bind(module, kernels.LigerRMSNorm, variance_epsilon=eps, row_mode=None, impl=None, mode=None, **gemma)


def _bind_layer_norm(module: nn.Module, kernels: types.ModuleType, model_type: str) -> None:
    _bind(module, kernels.LigerLayerNorm, variance_epsilon=module.eps, hidden_size=module.normalized_shape,
          impl=None, mode=None)


def _bind_rope(module: nn.Module, kernels: types.ModuleType, model_type: str) -> None:
    replacements = {n: getattr(kernels, ROTARY[n]) for n in rotary_names(module) if n in ROTARY}
    module.forward = types.MethodType(forward_with_globals(type(module).forward, replacements), module)


_BIND = {"rms_norm": _bind_rms_norm, "layer_norm": _bind_layer_norm, "rope": _bind_rope,
         "swiglu": lambda module, kernels, _: _bind(module, kernels.LigerSwiGLUMLP),
         "geglu": lambda module, kernels, _: _bind(module, kernels.LigerGEGLUMLP)}


@contextlib.contextmanager
def modeling_globals_restored(keep: str | None = None) -> Iterator[None]:
    """Within it, transformers' modeling modules (``transformers.models.*.modeling_*``) may be changed (Liger
    swaps classes and functions there); on leaving, every name changed, added or removed is put back as it was,
    except the changed names that contain ``keep`` (a name added, which transformers' code cannot call, goes)."""
    modules = {name: module for name, module in sys.modules.items()
               if name.startswith("transformers.models.") and ".modeling_" in name and module is not None}
    before = {name: dict(vars(module)) for name, module in modules.items()}
    try:
        yield
    finally:
        for name, module in modules.items():
            now, then = vars(module), before[name]
            for key in set(now) | set(then):
                if (keep and keep in key and key in then) or now.get(key, _MISSING) is then.get(key, _MISSING):
                    continue
                if key in then:
                    setattr(module, key, then[key])
                else:
                    delattr(module, key)


_MISSING = object()
