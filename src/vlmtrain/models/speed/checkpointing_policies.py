"""What activation checkpointing keeps and what it recomputes: the policies of activation_checkpointing_kwargs'
``mode`` (torchtitan's op-level and layer-level selective checkpointing, through torch.utils.checkpoint's
selective checkpoint contexts), their checks, and the choice of a policy for a memory budget."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from ...errors import ConfigError

if TYPE_CHECKING:  # (torch imported where used: TrainingArguments checks a mode without it)
    import torch

CHECKPOINTING_MODES = ("full", "selective", "attention")
"""The values of activation_checkpointing_kwargs' ``mode``: ``full`` recomputes each checkpointed layer's whole
forward in backward (transformers' behaviour); ``selective`` saves the outputs of its matrix products and attention
and recomputes only the rest (norms, rotary embeddings, activations, casts, reshapes: torchtitan's op-level
selective checkpointing), on every ``selective_every_n_layers``-th checkpointed layer (default 1: all of them; the
others recompute whole, as ``full``); ``attention`` saves only the attention's output and recomputes the rest,
matrix products included."""

SELECTIVE_EVERY = "selective_every_n_layers"
"""The activation_checkpointing_kwargs key of ``selective``'s layer interval."""


@functools.cache
def _matmul_ops() -> frozenset[Any]:
    import torch

    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm") if hasattr(aten, n))


@functools.cache
def _attention_ops() -> frozenset[Any]:
    """Every attention kernel of the installed torch: sdpa's math/flash/efficient/cuDNN kernels, the
    flash/efficient/cuDNN forwards behind varlen_attn, varlen attention and flex attention where torch has them."""
    import torch

    aten = torch.ops.aten
    names = ("_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
             "_flash_attention_forward", "_efficient_attention_forward", "_cudnn_attention_forward")
    ops = {getattr(aten, n) for n in names if hasattr(aten, n)}
    try:
        importlib.import_module("torch.nn.attention.varlen")  # (registers torch.ops.torch_attn's operators)

        ops |= {getattr(torch.ops.torch_attn, n) for n in ("_varlen_attn", "_varlen_attn_out")
                if hasattr(torch.ops.torch_attn, n)}
    except ImportError:  # (torch < 2.10)
        pass
    try:
        from torch._higher_order_ops.flex_attention import flex_attention

        ops.add(flex_attention)
    except ImportError:
        pass
    return frozenset(ops)


def _policy(saved: frozenset[Any], op: Any) -> torch.utils.checkpoint.CheckpointPolicy:
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "overloadpacket", op) in saved:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch.utils.checkpoint.CheckpointPolicy:
    """torch.utils.checkpoint's policy for ``selective``: keep matrix products and attention, recompute the rest."""
    return _policy(_matmul_ops() | _attention_ops(), op)


def _attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> torch.utils.checkpoint.CheckpointPolicy:
    """torch.utils.checkpoint's policy for ``attention``: keep the attention's output, recompute the rest."""
    return _policy(_attention_ops(), op)


def selective_checkpoint_context() -> Any:
    """A ``context_fn`` for torch.utils.checkpoint (non-reentrant) that applies the ``selective`` policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_selective_policy)


def attention_checkpoint_context() -> Any:
    """A ``context_fn`` for torch.utils.checkpoint (non-reentrant) that applies the ``attention`` policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_attention_policy)


CONTEXTS = {"selective": selective_checkpoint_context, "attention": attention_checkpoint_context}
"""The modes that set torch.utils.checkpoint's context_fn, and the context each sets."""


AUTO_MODE = "auto"
"""activation_checkpointing_kwargs' ``mode: auto``: the run's memory plan (vlmtrain/memory.py) picks the mode that
recomputes least among :data:`AUTO_CANDIDATES` whose estimated step fits the device, before the model is built."""

AUTO_CANDIDATES: tuple[tuple[str, dict[str, int]], ...] = (
    ("full", {}), ("attention", {}), ("selective", {SELECTIVE_EVERY: 4}), ("selective", {SELECTIVE_EVERY: 2}),
    ("selective", {}))
"""The policies ``mode: auto`` chooses among, from most recompute (least memory) to least."""


def checkpointing_mode(kwargs: Any, allow_auto: bool = False) -> str:
    """activation_checkpointing_kwargs' ``mode`` (``full`` when unset), checked against :data:`CHECKPOINTING_MODES`
    and against the other keys it needs (selective and attention: non-reentrant checkpointing, no context_fn of
    one's own; selective_every_n_layers: a positive int, with selective only). ``allow_auto``: ``auto`` accepted
    (in the arguments; the run's memory plan replaces it before the model is built)."""
    if not isinstance(kwargs, dict):
        return "full"
    mode = kwargs.get("mode", "full")
    if mode == AUTO_MODE:
        if not allow_auto:
            raise ConfigError("activation_checkpointing_kwargs.mode: auto is chosen by the memory plan of a run "
                              "started from a config (vlmtrain train, vlmtrain.run.train: see docs/memory.md); "
                              "with the Python Trainer give the mode itself (full, selective or attention).")
        for key in (SELECTIVE_EVERY, "context_fn"):
            if key in kwargs:
                raise ConfigError(f"activation_checkpointing_kwargs: mode 'auto' chooses {key} itself; drop {key}.")
        return mode
    if mode not in CHECKPOINTING_MODES:
        raise ConfigError(f"activation_checkpointing_kwargs.mode (gradient_checkpointing_kwargs.mode)={mode!r} is "
                          f"not one of {list(CHECKPOINTING_MODES)}: 'full' recomputes whole layers, 'selective' "
                          f"keeps matrix products and attention and recomputes the rest, 'attention' keeps only "
                          f"the attention's output.")
    if mode in CONTEXTS and kwargs.get("use_reentrant"):
        raise ConfigError(f"activation_checkpointing_kwargs: mode {mode!r} needs non-reentrant checkpointing; "
                          f"drop use_reentrant: true (or set it to false).")
    if mode in CONTEXTS and "context_fn" in kwargs:
        raise ConfigError(f"activation_checkpointing_kwargs: mode {mode!r} sets torch.utils.checkpoint's "
                          f"context_fn itself; pass either mode {mode!r} or a context_fn, not both.")
    every = kwargs.get(SELECTIVE_EVERY, 1)
    if SELECTIVE_EVERY in kwargs and mode != "selective":
        raise ConfigError(f"activation_checkpointing_kwargs: {SELECTIVE_EVERY} applies to mode 'selective' "
                          f"(got mode {mode!r}); add mode: selective, or drop {SELECTIVE_EVERY}.")
    if type(every) is not int or every < 1:
        raise ConfigError(f"activation_checkpointing_kwargs.{SELECTIVE_EVERY}={every!r}: give a whole number >= 1 "
                          f"(k: every k-th checkpointed layer selective, the others full).")
    return mode


P = TypeVar("P", bound=Hashable)


def choose_policy(per_layer_activation_bytes_by_policy: Mapping[P, int], budget_bytes: int) -> P | None:
    """The policy that keeps the most activations per layer (so recomputes the least) within ``budget_bytes`` per
    layer, or None when none fits. The policies are points of one trade-off (full < attention < selective on every
    k-th layer < selective < no checkpointing, in memory kept and in recompute saved), so the largest that fits is
    the cheapest to run."""
    fitting = {p: b for p, b in per_layer_activation_bytes_by_policy.items() if b <= budget_bytes}
    return max(fitting, key=fitting.__getitem__) if fitting else None
