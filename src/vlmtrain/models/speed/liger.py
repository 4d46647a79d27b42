"""TrainingArguments.use_liger_kernel / liger_kernel_config: Liger Kernel's Triton kernels (RMSNorm, rotary
embeddings, SwiGLU / GeGLU, LayerNorm) in a Hub VLM of a family Liger covers, keeping vlmtrain's own chunked LM
loss (models/lm_loss.py): Liger's fused linear cross-entropy and cross-entropy, which would replace the model's
forward or transformers' loss, are never applied.

Liger's own per-family patch (``liger_kernel.transformers.monkey_patch``, what transformers' Trainer calls with
``use_liger_kernel=True``) runs on the model instance: its norms and MLPs get Liger's forward, module by module.
Liger also swaps classes in transformers' modeling module of the family (so that models built later use its
layers); vlmtrain puts those back, so only the instance it trains changes. The rotary functions stay swapped:
Liger offers them only as the modeling module's function, which every model of that family in the process
calls (a Qwen3-VL built later in the same process, on CUDA, also runs Liger's RoPE).

Bad input is a ConfigError before training, naming the setting: liger-kernel not installed, no CUDA device (the
kernels are Triton, GPU only), a model of a family Liger does not cover, a loss kernel asked for in
liger_kernel_config. :func:`apply_liger_kernel` is vlmtrain.Trainer's ``liger_kernel`` part
(trainer/parts.py); the hub_vlm kind checks a run's config with :func:`check_liger` before loading the model.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ...errors import ConfigError

INSTALL = "pip install 'vlmtrain[liger]'"
LOSS_KERNELS = ("fused_linear_cross_entropy", "cross_entropy")
"""Liger's loss options, always off: vlmtrain computes the LM loss itself (chunked, at the targets only)."""

COVERED: dict[str, str] = {
    "qwen3_vl": "RMSNorm (text model, q/k norms included), RoPE (text and vision), SwiGLU (text MLPs)",
    "qwen2_5_vl": "RMSNorm (text model and vision blocks), RoPE (text and vision), SwiGLU (text MLPs)",
    "gemma3": "RMSNorm (text model, projector), RoPE, GeGLU (text MLPs), LayerNorm (SigLIP vision tower)",
    "smolvlm": "RMSNorm, RoPE and SwiGLU (its Llama text model), LayerNorm (vision tower)",
}
"""model_type -> what Liger patches, for vlmtrain's Hub VLM families that Liger covers (liger-kernel 0.6-0.8;
LLaVA-OneVision and Idefics3 it does not). Qwen3-VL's SwiGLU is vlmtrain's: Liger's qwen3_vl patch takes a
``swiglu`` option but applies nothing; vlmtrain binds Liger's SwiGLU forward to the text MLPs (gate, up, down,
silu: what Liger does for Qwen2.5-VL) unless liger_kernel_config says ``swiglu: false``. Qwen2.5-VL's RoPE is
vlmtrain's too where transformers (5.x) applies the multimodal sections in the rotary embedding and calls the plain
rotary functions Qwen3-VL has: Liger's Qwen2.5-VL patch replaces a function those versions no longer call, so
vlmtrain swaps in Liger's Qwen3-VL rotary functions (the same computation) unless ``rope: false``."""

_KEPT_GLOBALS = "rotary_pos_emb"  # modeling-module functions whose Liger version stays (apply_*rotary_pos_emb*)


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
    if not isinstance(config, Mapping):
        raise ConfigError(f"liger_kernel_config must be a mapping of Liger's options to true/false (e.g. "
                          f"{{rope: false}}), got {config!r}.")
    for key, value in config.items():
        if not isinstance(value, bool):
            raise ConfigError(f"liger_kernel_config[{key!r}] must be true or false, got {value!r}.")
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


def apply_liger_kernel(model: nn.Module, liger_kernel_config: Mapping[str, Any] | None = None) -> None:
    """TrainingArguments.use_liger_kernel: Liger's kernels in the transformers model inside ``model``, in place
    (the instance; see the module docstring for the rotary functions), with ``liger_kernel_config`` as Liger's
    options for the family (transformers' semantics: the keyword arguments of Liger's patch; unset ones take
    Liger's defaults) and its loss kernels off. Call it with the model on its CUDA device."""
    target = liger_target(model)
    model_type = target.config.model_type
    options = check_kernel_config(liger_kernel_config)
    check_liger(model_type, options)
    on_cpu = devices_off_cuda(model)
    if on_cpu:
        raise ConfigError(f"use_liger_kernel=true: the model is on {', '.join(on_cpu)}, but Liger's kernels run on "
                          f"CUDA. Train on the GPU (use_cpu: false), or set use_liger_kernel: false.")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    patch = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if patch is None:
        raise ConfigError(f"use_liger_kernel=true: the installed liger-kernel ({liger_version()}) has no patch for "
                          f"{model_type!r}. Install a newer one ({INSTALL}), or set use_liger_kernel: false.")
    accepted = _options_of(patch, target, MODEL_TYPE_TO_APPLY_LIGER_FN)
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ConfigError(f"liger_kernel_config: Liger's {model_type} patch has no option {', '.join(unknown)}; its "
                          f"options: {', '.join(sorted(accepted - set(LOSS_KERNELS)))}.")
    kwargs = {k: v for k, v in {**options, **dict.fromkeys(LOSS_KERNELS, False)}.items() if k in accepted}
    forward = target.__dict__.get("forward")  # (vlmtrain's loss_only forward, models/lm_loss.py)
    with modeling_globals_restored(keep=_KEPT_GLOBALS):
        try:
            patch(model=target, **kwargs)
        except ImportError as err:  # (e.g. liger-kernel 0.8.5's Qwen-VL patch with transformers >= 5.23)
            import transformers

            raise ConfigError(f"use_liger_kernel=true: liger-kernel {liger_version()}'s {model_type} patch does not "
                              f"work with transformers {transformers.__version__} ({err}). Install a transformers "
                              f"that release supports (liger-kernel 0.8.5: transformers <= 5.22.2 for Qwen-VL) or a "
                              f"newer liger-kernel, or set use_liger_kernel: false.") from err
    if target.__dict__.get("forward") is not forward:
        raise RuntimeError(f"liger-kernel {liger_version()} replaced {type(target).__name__}.forward although its "
                           f"loss kernels were off; vlmtrain's LM loss would be lost. Please report it.")
    if model_type == "qwen3_vl" and options.get("swiglu", True):
        _qwen3_vl_swiglu(target)
    if model_type == "qwen2_5_vl" and options.get("rope", True):
        _qwen2_5_vl_rope()


def _options_of(patch: Any, target: nn.Module, table: Mapping[str, Any]) -> set[str]:
    """The keyword options Liger's ``patch`` takes; a patch with ``**kwargs`` (SmolVLM) hands them to its text
    model's patch, whose options count too."""
    params = inspect.signature(patch).parameters
    names = {n for n, p in params.items() if p.kind is not p.VAR_KEYWORD and n != "model"}
    text = getattr(getattr(target.config, "text_config", None), "model_type", None)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()) and text in table:
        names |= {n for n in inspect.signature(table[text]).parameters if n not in ("model", "kwargs")}
    return names


def _qwen3_vl_swiglu(target: nn.Module) -> None:
    """Liger's SwiGLU forward (one kernel for silu(gate) * up, the product recomputed in backward) bound to each
    Qwen3-VL text MLP, as Liger binds it for Qwen2.5-VL."""
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    text_config = target.config.get_text_config(decoder=True)
    if text_config.hidden_act not in ("silu", "swish"):
        raise ConfigError(f"use_liger_kernel=true: Liger's SwiGLU computes silu, but this model's text MLPs use "
                          f"{text_config.hidden_act!r}. Set liger_kernel_config: {{swiglu: false}}.")
    language_model = target.model.language_model if hasattr(target, "model") else target.language_model
    for layer in language_model.layers:
        layer.mlp.forward = types.MethodType(LigerSwiGLUMLP.forward, layer.mlp)


def _qwen2_5_vl_rope() -> None:
    """Liger's rotary functions for Qwen2.5-VL's text and vision attention, where transformers has Qwen3-VL's
    plain ones there (no ``apply_multimodal_rotary_pos_emb``: the sections are mixed in the rotary embedding)."""
    from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    if "apply_multimodal_rotary_pos_emb" in vars(modeling):  # (older transformers: Liger's own patch applies)
        return
    modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
    modeling.apply_rotary_pos_emb_vision = liger_rotary_pos_emb_vision


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
