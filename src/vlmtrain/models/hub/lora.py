"""LoRA through peft (the optional `lora` extra): `model.lora: {r, alpha, dropout, target_modules}`.

By default the adapters go on the language model's linear layers only (peft's ``all-linear`` would also wrap
the vision tower's and the merger's). A model wrapped with score heads (an object with ``.base`` and
``.heads``, see models/objectives/heads.py) gets its adapters on ``.base``; the heads stay fully trainable.

``target_modules`` may be:
  - absent: every ``nn.Linear`` under the language model (``text_module``), lm_head excluded;
  - a list of module names (``[q_proj, v_proj]``): those layers, under the language model only;
  - ``all-linear`` or any other string: handed to peft as is (a string is a regex over module names there).
``modules_to_save`` (optional) lists modules trained in full next to the adapters (saved with them); the
aliases ``vision`` / ``projector`` / ``text`` name the family's module groups (``module_groups``, else those the
model kind attached: models/protocol.py's MODULE_GROUPS_ATTR).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ...errors import ConfigError

LORA_KEYS = ("r", "alpha", "dropout", "target_modules", "modules_to_save")


def _require_peft() -> Any:
    try:
        import peft
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError("model.lora needs peft: pip install 'vlmtrain[lora]' (or pip install peft).") from e
    return peft


def has_heads(model: nn.Module) -> bool:
    """True for a model wrapped with score heads (``.base`` the transformers model, ``.heads`` the heads)."""
    return isinstance(getattr(model, "base", None), nn.Module) and isinstance(getattr(model, "heads", None),
                                                                           nn.Module)


def base_of(model: nn.Module) -> nn.Module:
    """The model under score heads (itself when there are none); a PeftModel when LoRA was applied."""
    return model.base if has_heads(model) else model


def is_lora(model: nn.Module) -> bool:
    """True when the model (or the base under its heads) carries peft adapters."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(base_of(model), PeftModel)


def _linear_names(model: nn.Module, text_module: str) -> list[str]:
    prefix = f"{text_module}." if text_module else ""
    return [name for name, mod in model.named_modules()
            if isinstance(mod, nn.Linear) and name.startswith(prefix) and name.split(".")[-1] != "lm_head"]


def _targets(model: nn.Module, target_modules: Any, text_module: str) -> str:
    """peft's target_modules: a regex over the language model's linear layers with the requested leaf names."""
    linears = _linear_names(model, text_module)
    if not linears:
        raise ConfigError(f"model.lora: {type(model).__name__} has no nn.Linear under {text_module!r} (the "
                          f"language model) to put adapters on; set model.lora.target_modules.")
    leaves = sorted({name.split(".")[-1] for name in linears})
    if target_modules is None:
        wanted = leaves
    else:
        if isinstance(target_modules, str) or not all(isinstance(t, str) for t in target_modules):
            raise ConfigError(f"model.lora.target_modules must be a list of module names, 'all-linear' or a regex "
                              f"string, got {target_modules!r}.")
        wanted = list(target_modules)
        unknown = [t for t in wanted if t not in leaves]
        if unknown:
            raise ConfigError(f"model.lora.target_modules {unknown} name no linear layer of the language model "
                              f"({text_module}); its linear layers are {leaves}.")
    prefix = re.escape(text_module) + r"\." if text_module else ""
    return prefix + r"(?:.*\.)?(?:" + "|".join(re.escape(w) for w in wanted) + ")"


def _modules_to_save(model: nn.Module, names: Any, groups: Mapping[str, tuple[str, ...]]) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"model.lora.modules_to_save must be a list of module names, got {names!r}.")
    modules = dict(model.named_modules())
    out: list[str] = []
    for name in names:
        if name in groups:  # an alias: every module its prefixes name (a list's items, peft wraps no list)
            for prefix in (p for p in groups[name] if p in modules):
                mod = modules[prefix]
                listed = isinstance(mod, nn.ModuleList | nn.ModuleDict)
                out.extend([f"{prefix}.{child}" for child, _ in mod.named_children()] if listed else [prefix])
        elif name in modules or any(m.endswith(f".{name}") for m in modules):
            out.append(name)
        else:
            raise ConfigError(f"model.lora.modules_to_save: {name!r} names no module of {type(model).__name__} "
                              f"(nor an alias: {sorted(groups) or 'none defined'}).")
    return out


def lora_config(model: nn.Module, spec: Mapping[str, Any], text_module: str,
                module_groups: Mapping[str, tuple[str, ...]] | None = None) -> Any:
    """The peft LoraConfig for `spec` on `model` (the transformers model, not its heads wrapper)."""
    peft = _require_peft()
    unknown = [k for k in spec if k not in LORA_KEYS]
    if unknown:
        import difflib

        near = {k: difflib.get_close_matches(k, LORA_KEYS, n=1) for k in unknown}
        hint = "; ".join(f"model.lora.{k}" + (f" (did you mean {v[0]!r}?)" if v else "") for k, v in near.items())
        raise ConfigError(f"unknown key(s) {hint}; model.lora takes {', '.join(LORA_KEYS)}.")
    r, alpha, dropout = spec.get("r", 8), spec.get("alpha"), spec.get("dropout", 0.0)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ConfigError(f"model.lora.r must be a positive integer, got {r!r}.")
    alpha = 2 * r if alpha is None else alpha
    if not isinstance(alpha, int | float) or alpha <= 0:
        raise ConfigError(f"model.lora.alpha must be a positive number, got {alpha!r}.")
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {dropout!r}.")
    target = spec.get("target_modules")
    targets = target if isinstance(target, str) else _targets(model, target, text_module)
    if module_groups is None:
        from ..protocol import module_groups as find_groups  # the aliases a model kind attached

        module_groups = find_groups(model)
    groups = module_groups
    return peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout), target_modules=targets,
                           modules_to_save=_modules_to_save(model, spec.get("modules_to_save"), groups))


@contextlib.contextmanager
def peft_wrapping() -> Iterator[None]:
    """Around peft's PeftModel(...) (get_peft_model, PeftModel.from_pretrained): peft 0.21's __init__ reads
    transformers' deprecated ``model.is_gradient_checkpointing`` (transformers 5 warns: "`is_gradient_checkpointing`
    is deprecated ... Use `is_activation_checkpointing`"), a FutureWarning per process and load that vlmtrain
    cannot avoid: that one warning is ignored here, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def apply_lora(model: nn.Module, spec: Mapping[str, Any], text_module: str,
               module_groups: Mapping[str, tuple[str, ...]] | None = None) -> nn.Module:
    """Wrap `model` with LoRA adapters (peft) per `spec` ({r, alpha, dropout, target_modules[, modules_to_save]}).

    Returns the PeftModel; for a model with score heads, the same wrapper with ``.base`` replaced by the
    PeftModel (heads stay trainable). Base weights are frozen (peft); adapters are float32 even on a bf16 base.
    """
    peft = _require_peft()
    base = base_of(model)
    config = lora_config(base, spec, text_module, module_groups)
    with peft_wrapping():
        wrapped = peft.get_peft_model(base, config)
    if has_heads(model):
        model.base = wrapped
        return model
    return wrapped


def merge_lora(model: nn.Module) -> nn.Module:
    """The plain model with the adapters merged into its weights (heads wrapper kept, its base unwrapped)."""
    if not is_lora(model):
        raise ValueError(f"{type(model).__name__} carries no LoRA adapter to merge.")
    if has_heads(model):
        model.base = model.base.merge_and_unload()
        return model
    return model.merge_and_unload()


# Files of a checkpoint that are not the model's own (training state, the adapter itself, peft's model card).
_NOT_EXPORTED = ("adapter_model.safetensors", "adapter_config.json", "trainable.safetensors", "trainer_state.json",
                 "optimizer.pt", "scheduler.pt", "README.md", "training_args.bin")


def export_merged(checkpoint: str, output_dir: str, base: str | None = None) -> str:
    """Write a LoRA checkpoint (adapter_model.safetensors + adapter_config.json) as full merged weights into
    output_dir: model safetensors + config (loadable by from_pretrained), the processor and heads files copied.
    `base`: the base model (default: the adapter config's base_model_name_or_path). Returns output_dir."""
    import os
    import shutil

    import safetensors.torch
    import transformers

    peft = _require_peft()
    adapter_config = os.path.join(checkpoint, "adapter_config.json")
    if not os.path.isfile(adapter_config):
        raise FileNotFoundError(f"{checkpoint!r} holds no LoRA adapter (no adapter_config.json): its weights are "
                                "already full, nothing to merge.")
    if base is None:  # (a relative directory: from the working directory, else from the checkpoint)
        from .local_paths import adapter_base

        base = adapter_base(checkpoint)
    try:
        config = transformers.AutoConfig.from_pretrained(base)
    except OSError as err:
        from .local_paths import base_not_loadable

        raise base_not_loadable(checkpoint, base, err) from None
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise FileNotFoundError(f"the base model {base!r} names no transformers class in config.json "
                                f"(architectures: {arch!r}).")
    with peft_wrapping():
        model = peft.PeftModel.from_pretrained(cls.from_pretrained(base, config=config), checkpoint)
    extra = os.path.join(checkpoint, "trainable.safetensors")
    if os.path.isfile(extra):  # trained base tensors outside the adapter
        model.load_state_dict(safetensors.torch.load_file(extra), strict=False)
    merged = model.merge_and_unload()
    os.makedirs(output_dir, exist_ok=True)
    for name in os.listdir(checkpoint):  # processor/tokenizer and heads files
        src = os.path.join(checkpoint, name)
        if os.path.isfile(src) and name not in _NOT_EXPORTED and not name.startswith(("rng_state", "loop_state_")):
            if os.path.abspath(src) != os.path.abspath(os.path.join(output_dir, name)):
                shutil.copy2(src, os.path.join(output_dir, name))
    merged.save_pretrained(output_dir)
    return output_dir
