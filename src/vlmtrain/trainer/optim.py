"""Optimizer (parameter groups with per-module learning rates) and learning-rate schedules."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .args import TrainingArgumentsCore

DEFAULT_GROUP = "default"


MODULE_GROUPS_ATTR = "vlmtrain_module_groups"
"""A model (or a class) may carry {alias: (parameter-name prefixes, ...)} under this attribute, e.g. a Hub VLM
{'vision': ('model.visual.blocks', ...), 'projector': (...), 'text': ('model.language_model', 'lm_head')}: the
model kind sets it from the family record, so module_learning_rates accept the family-independent aliases
``vision`` / ``projector`` / ``text``. Found through wrappers (score heads, peft)."""


def module_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The {alias: prefixes} of `model` or of the first submodule that declares them ({} when none does)."""
    for module in model.modules():
        groups = getattr(module, MODULE_GROUPS_ATTR, None)
        if groups:
            return {alias: (prefixes,) if isinstance(prefixes, str) else tuple(prefixes)
                    for alias, prefixes in groups.items()}
    return {}


def _on_path(parts: list[str], pattern: str) -> bool:
    kp = pattern.split(".")
    return any(parts[i:i + len(kp)] == kp for i in range(len(parts) - len(kp) + 1))


def _module_key(name: str, patterns: list[tuple[str, str]]) -> str | None:
    """The key whose pattern names the longest module on `name`'s path ('vision' matches 'vision.x.w' and
    'm.vision.w'); patterns are (pattern, key) pairs, an alias key having one pair per prefix. On a tie the
    earlier pair wins (explicit keys come before aliases)."""
    parts = name.split(".")
    best: tuple[str, str] | None = None
    for pattern, key in patterns:
        if _on_path(parts, pattern) and (best is None or len(pattern) > len(best[0])):
            best = (pattern, key)
    return best[1] if best else None


def _patterns(keys: list[str], groups: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    explicit = [(k, k) for k in keys if k not in groups]
    return explicit + [(prefix, k) for k in keys if k in groups for prefix in groups[k]]


def _no_decay_names(model: nn.Module) -> set[str]:
    """Biases, normalization weights and other 1-D parameters get no weight decay."""
    names = set()
    for mod_name, module in model.named_modules():
        is_norm = "norm" in type(module).__name__.lower()
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if is_norm or p_name.endswith("bias") or p.ndim < 2:
                names.add(full)
    return names


def _parameter_lrs(model: nn.Module, args: TrainingArgumentsCore) -> list[tuple[str, nn.Parameter, str | None, float]]:
    """(name, parameter, module_learning_rates key or None, learning rate) of every parameter; a ConfigError
    names keys that match no parameter."""
    lrs = dict(args.module_learning_rates or {})
    keys = list(lrs)
    groups_of = module_groups(model) if keys else {}
    patterns = _patterns(keys, groups_of)
    out, used = [], set()
    for name, p in model.named_parameters():
        key = _module_key(name, patterns)
        if key is not None:
            used.add(key)
        out.append((name, p, key, lrs[key] if key is not None else args.learning_rate))
    unused = [k for k in keys if k not in used]
    if unused:
        top = sorted({n.split(".")[0] for n, _ in model.named_parameters()})
        aliases = f"; aliases: {sorted(groups_of)}" if groups_of else ""
        raise ConfigError(f"module_learning_rates keys {unused} match no parameter of {type(model).__name__}; "
                          f"its top-level modules are {top}{aliases}.")
    return out


def freeze_zero_lr(model: nn.Module, args: TrainingArgumentsCore) -> None:
    """Freeze (requires_grad=False) the parameters whose learning rate is 0, as :func:`build_param_groups`
    does. The Trainer calls it before DDP / FSDP wrap the model: DDP fixes at construction which parameters
    it waits gradients for, so a module frozen after wrapping would fail at the second step."""
    for _, p, _, lr in _parameter_lrs(model, args):
        if lr == 0:
            p.requires_grad_(False)


def build_param_groups(model: nn.Module, args: TrainingArgumentsCore) -> list[dict]:
    """One group per (module learning rate, decay or not). Parameters whose learning rate is 0 are frozen:
    requires_grad is set to False and they stay out of the optimizer. Keys are module names or the aliases of
    :func:`module_groups`; under score heads or peft, names gain `base.` / `base_model.model.` prefixes, which
    matching ignores. Parameters already frozen (requires_grad=False, e.g. a LoRA base) stay frozen."""
    no_decay = _no_decay_names(model)
    groups: dict[tuple[str, bool], dict] = {}
    for name, p, key, lr in _parameter_lrs(model, args):
        if lr == 0:
            p.requires_grad_(False)
            continue
        if not p.requires_grad:
            continue
        decay = name not in no_decay
        group = groups.setdefault((key or DEFAULT_GROUP, decay), {
            "params": [], "lr": lr, "weight_decay": args.weight_decay if decay else 0.0,
            "name": key or DEFAULT_GROUP,
        })
        group["params"].append(p)
    if not groups:
        raise ConfigError("No trainable parameters: every parameter is frozen (learning rate 0 or "
                          "requires_grad=False).")
    return list(groups.values())


def create_optimizer(model: nn.Module, args: TrainingArgumentsCore,
                     cls_and_kwargs: tuple[type, dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """args.optim's optimizer over :func:`build_param_groups`' groups; with ``cls_and_kwargs`` (Trainer(
    optimizer_cls_and_kwargs=(cls, kwargs))) ``cls`` over them, the groups' lr and weight_decay kept unless
    ``kwargs`` sets them."""
    groups = build_param_groups(model, args)
    if cls_and_kwargs is not None:
        cls, kwargs = cls_and_kwargs
        for group in groups:
            group.update({k: v for k, v in kwargs.items() if k in ("lr", "weight_decay")})
        return cls(groups, **{k: v for k, v in kwargs.items() if k not in ("lr", "weight_decay")},
                   lr=kwargs.get("lr", args.learning_rate))
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=args.optim == "adamw_torch_fused" or None)


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """`learning_rate` (the default group's) plus `learning_rate_<module>` for each per-module group."""
    lrs: dict[str, float] = {}
    for group in optimizer.param_groups:
        lrs.setdefault(group.get("name", DEFAULT_GROUP), group["lr"])
    out = {"learning_rate": lrs.get(DEFAULT_GROUP, next(iter(lrs.values())))}
    out.update({f"learning_rate_{name}": lr for name, lr in lrs.items() if name != DEFAULT_GROUP})
    return out


# Schedules as multipliers of each group's peak learning rate (the same curves as transformers'), each after the
# linear warmup they share (_warmed_up).
def _warmed_up(schedule: Callable[..., float], step: int, warmup: int, total: int, **kwargs: float) -> float:
    """The multiplier at ``step``: rising linearly over the first ``warmup`` steps, then ``schedule``'s."""
    return step / max(1, warmup) if step < warmup else schedule(step, warmup, total, **kwargs)


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _linear(step: int, warmup: int, total: int) -> float:
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, warmup: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0) -> float:
    progress = (step - warmup) / max(1, total - warmup)
    factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))
    return factor * (1 - min_lr_rate) + min_lr_rate


def _polynomial(step: int, warmup: int, total: int, end_rate: float = 0.0, power: float = 1.0) -> float:
    if step > total:
        return end_rate
    remaining = 1 - (step - warmup) / max(1, total - warmup)
    return (1 - end_rate) * remaining**power + end_rate


def create_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArgumentsCore,
                     num_training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = args.get_warmup_steps(num_training_steps)
    kw = dict(args.lr_scheduler_kwargs or {})
    kind, options = args.lr_scheduler_type, {}
    if kind == "constant":
        schedule, warmup = _constant, 0
    elif kind == "constant_with_warmup":
        schedule = _constant
    elif kind == "linear":
        schedule = _linear
    elif kind in ("cosine", "cosine_with_min_lr"):
        schedule = _cosine
        min_rate = kw.get("min_lr_rate", kw["min_lr"] / args.learning_rate if "min_lr" in kw else 0.0)
        options = {"num_cycles": kw.get("num_cycles", 0.5), "min_lr_rate": min_rate}
    else:  # polynomial
        schedule = _polynomial
        end_rate = kw.get("lr_end", 1e-7) / args.learning_rate if args.learning_rate > 0 else 0.0
        options = {"end_rate": end_rate, "power": kw.get("power", 1.0)}
    fn = functools.partial(_warmed_up, schedule, warmup=warmup, total=num_training_steps, **options)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
