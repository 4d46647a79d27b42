"""Analytic FLOPs of a training batch, for the logged ``tflops_per_second`` and ``mfu``.

What is counted (model FLOPs, the MFU convention; one multiply-add = 2 FLOPs):

- **Matmuls**: every ``nn.Linear`` and ``nn.Conv*`` module (LoRA adapters and a tied ``lm_head`` included,
  embedding lookups and norms not), and every parameter a model names under :data:`MATMUL_PARAMETERS_ATTR`, costs ``2 * weight.numel()`` per row it is applied to: the text model per
  real token (image placeholders included, padding not), the vision tower per patch of each image, the
  projector per image token it emits; an output layer the model applies only at target positions in training
  (:data:`TARGET_LOGITS_ATTR`) per target.
- **Attention scores and values**: ``4 * L^2 * heads * head_dim`` per layer forward (QK^T and AV) over each
  real sequence: a padded row's non-pad length, each document of a packed row (never the row), each image's
  patches in the vision tower (each of its windows, in a vision layer that attends within windows of the
  image: :data:`WINDOWED_ATTENTION_ATTR`). The full L x L square (no halving for causal masks), as FlopCounterMode counts
  eager attention and CUDA SDPA kernels; backward 2x forward (eager's matmuls; FlopCounterMode credits SDPA
  kernels 2.5x for recomputing the scores). A sliding window of w counts L * min(L, w).
- **Backward**, per module, from requires_grad when training starts: forward x (1 + 1 if its input needs a
  gradient + 1 if its weight is trainable). An input needs a gradient when a trainable parameter comes before
  the module in forward order (stages vision -> projector -> text, then module registration order). So a
  frozen vision tower before everything trainable costs its forward only (1x), a frozen decoder behind a
  trainable projector forward + input gradients (2x), a trainable module 3x; attention 3x once anything
  before it trains, else 1x.

Not counted: padding, the masked cross-document blocks a packed row's attention kernel may compute anyway,
activation-checkpointing recomputation (hardware FLOPs, not model FLOPs), elementwise ops, the loss.

A model says what the counter needs: its module groups (``vision`` / ``projector`` / ``text``, see
models/protocol.py MODULE_GROUPS_ATTR; a model without them is all text) and, when it has a vision tower, a
callable under :data:`IMAGE_TOKENS_ATTR` giving each image's (patches, image tokens) from a batch (Hub VLM
families: ``Family.image_tokens``, for every family vlmtrain ships). A model the
counter does not understand (no attention layers found, unknown matmul parameters, mixture-of-experts, a
vision tower without that callable) gets no count, with one warning.

The trainer logs these through its ``flop_counter`` part (trainer/parts.py), which vlmtrain.Trainer sets
with :func:`flop_counter`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..protocol import MODULE_GROUPS_ATTR, module_groups

TARGET_LOGITS_ATTR = "vlmtrain_target_logits_module"
"""A model whose training forward applies its output layer only at the positions that predict a target names
that module (relative to the model) under this attribute; the counter then counts it per target, not per
token (vlmtrain's VLM does, see models/own_vlm/vlm.py)."""
IMAGE_TOKENS_ATTR = "vlmtrain_image_tokens"
"""A model with a vision tower carries a callable under this name: batch -> [(patches the vision tower attends
over, tokens the projector emits), ...], one pair per image of the batch (vlmtrain's VLM defines it as a
method; the hub_vlm kind sets it from the family record). A pair may carry a third value, the image's query-key
pairs in a windowed vision layer (see WINDOWED_ATTENTION_ATTR)."""
WINDOWED_ATTENTION_ATTR = "vlmtrain_windowed_attention"
"""A model whose vision tower has attention layers that attend within windows of each image (Qwen2.5-VL: every
block outside ``fullatt_block_indexes``) names those attention modules (relative to the model carrying the
module groups) under this attribute; its IMAGE_TOKENS_ATTR callable then gives per image (patches, image tokens,
query-key pairs of one such layer over the image: the sum of its windows' squared lengths)."""
MATMUL_PARAMETERS_ATTR = "vlmtrain_matmul_parameters"
"""Names (relative to the model carrying the module groups) of parameters applied as a matmul weight outside
``nn.Linear`` / ``nn.Conv*`` (Gemma 3's ``mm_input_projection_weight``): counted as a Linear's weight, per row
of their stage."""
WINDOWS = "windows"  # StageCost.attention's key for the windowed vision layers

STAGES = ("vision", "projector", "text")  # forward order
_MATMULS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_UNKNOWN_TOLERANCE = 0.01  # matmul-shaped parameters the counter cannot place, as a fraction of those it can
_IGNORE_INDEX = -100


@dataclass
class StageCost:
    """Training FLOPs of one stage per unit of work."""

    per_row: float = 0.0
    """Per row (token, patch) through its matmuls, backward included."""
    attention: dict[int | str | None, float] | None = None
    """Sliding window (None: full; WINDOWS: windows of an image) -> training FLOPs per query-key pair, summed
    over the layers with it."""
    matmul_params: int = 0
    unknown_params: int = 0
    attention_layers: int = 0


class FlopCounter:
    """Training FLOPs (forward + backward) of a batch, from per-model constants computed once."""

    def __init__(self, stages: Mapping[str, StageCost], image_tokens: Callable[[Mapping[str, Any]], Any] | None):
        self.stages = dict(stages)
        self.image_tokens = image_tokens

    def __call__(self, batch: Mapping[str, Any]) -> float:
        """FLOPs of one micro-batch (as the collator made it, on any device); 0 for a batch with no input_ids; the
        text model's alone for a batch without images."""
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(ids, torch.Tensor):
            return 0.0
        lengths = document_lengths(batch)
        flops = _stage_flops(self.stages["text"], lengths)
        if "target_head" in self.stages:
            labels = batch.get("labels")
            rows = (labels[..., 1:] != _IGNORE_INDEX).sum() if isinstance(labels, torch.Tensor) else lengths.sum()
            flops += self.stages["target_head"].per_row * float(rows)
        if self.image_tokens is not None and ("vision" in self.stages or "projector" in self.stages):
            rows = list(self.image_tokens(batch))
            if not rows:  # a text-only batch: no image, no vision tower or projector work
                return flops
            per_image = torch.as_tensor(rows, dtype=torch.float64).reshape(len(rows), -1)
            if "vision" in self.stages:
                windows = self.stages["vision"].attention and WINDOWS in self.stages["vision"].attention
                if windows and per_image.shape[1] < 3:
                    raise ValueError(f"{IMAGE_TOKENS_ATTR} gave no query-key pairs per image for the vision layers "
                                     f"that attend within windows ({WINDOWED_ATTENTION_ATTR}).")
                flops += _stage_flops(self.stages["vision"], per_image[:, 0], per_image[:, 2] if windows else None)
            if "projector" in self.stages:
                flops += _stage_flops(self.stages["projector"], per_image[:, 1])
        return flops


def _stage_flops(cost: StageCost, lengths: torch.Tensor, window_pairs: torch.Tensor | None = None) -> float:
    """A stage's FLOPs over sequences of these lengths (each one its own attention span); ``window_pairs``: each
    sequence's query-key pairs in a layer attending within windows of it."""
    lengths = lengths.double()
    flops = cost.per_row * float(lengths.sum())
    for window, per_pair in (cost.attention or {}).items():
        if window == WINDOWS:
            flops += per_pair * float(window_pairs.sum())
            continue
        keys = lengths if window is None else lengths.clamp(max=window)
        flops += per_pair * float((lengths * keys).sum())
    return flops


def document_lengths(batch: Mapping[str, Any]) -> torch.Tensor:
    """The real sequences of a text batch: each row's non-pad length (attention_mask), else each document of a
    packed row (runs of position_ids restarting at 0; a row's trailing padding run is left out), else rows."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.sum(-1)
    pos = batch.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() == 3 and pos.shape[1:] == ids.shape:
        pos = pos[0]  # multimodal rotary positions [4, B, L]: row 0 is the text position, restarting per sample
    if isinstance(pos, torch.Tensor) and pos.shape == ids.shape and ids.dim() == 2:
        return _packed_documents(ids, pos, batch.get("labels"))
    return torch.full(ids.shape[:1], ids.shape[-1]) if ids.dim() == 2 else torch.tensor([ids.numel()])


def _packed_documents(ids: torch.Tensor, pos: torch.Tensor, labels: Any) -> torch.Tensor:
    rows, width = ids.shape
    starts = pos == 0
    starts[:, 0] = True
    first = starts.flatten().nonzero().squeeze(1)  # flat index of each run's first token
    ends = torch.cat([first[1:], first.new_tensor([rows * width])])
    lengths = ends - first
    if not isinstance(labels, torch.Tensor) or labels.shape != ids.shape:
        return lengths
    # Packing pads a row's end with its own run of positions: one repeated id, no target (packing.pack_items).
    flat_ids, flat_labels = ids.flatten(), labels.flatten()
    last_of_row = (ends % width == 0) & (ends > first)
    changes = torch.cat([flat_ids.new_zeros(1), (flat_ids[1:] != flat_ids[:-1]).long()]).cumsum(0)
    targets = (flat_labels != _IGNORE_INDEX).long().cumsum(0)
    one_id = changes[ends - 1] == changes[first]
    no_target = targets[ends - 1] - targets[first] + (flat_labels[first] != _IGNORE_INDEX).long() == 0
    return lengths[~(last_of_row & one_id & no_target) | (first % width == 0)]


def flop_counter(model: nn.Module) -> FlopCounter | None:
    """The counter for ``model`` as it trains now (requires_grad decides backward costs); None, with a warning,
    for a model it does not understand."""
    try:
        return _build(model)
    except _Unsupported as e:
        reason = str(e)
    except Exception as e:  # noqa: BLE001 - a metric never stops training
        reason = f"the model could not be analysed ({e!r})"
    warnings.warn(f"tflops_per_second / mfu are not logged: {reason}", stacklevel=3)
    return None


class _Unsupported(Exception):
    pass


def _build(model: nn.Module) -> FlopCounter:
    groups = module_groups(model)
    root = next((m for m in model.modules() if groups and getattr(m, MODULE_GROUPS_ATTR, None)), model)
    named = list(root.named_modules())
    stage_of = {name: _stage(name, groups) if groups else "text" for name, _ in named}
    moe = [type(m).__name__ for _, m in named if any(k in type(m).__name__ for k in ("Moe", "MoE", "Expert"))]
    if moe:
        raise _Unsupported(f"mixture-of-experts layers ({moe[0]}) run only some experts per token.")
    costs: dict[str, StageCost] = {}
    head_name, head = getattr(root, TARGET_LOGITS_ATTR, None), StageCost()
    windowed = set(getattr(root, WINDOWED_ATTENTION_ATTR, None) or ())
    matmul_params = set(getattr(root, MATMUL_PARAMETERS_ATTR, None) or ())
    _check_named(named, stage_of, windowed, matmul_params)
    upstream_grad = False  # a trainable parameter earlier in forward order: inputs from here on need gradients
    for stage in STAGES:
        cost = StageCost(attention={})
        open_attention: list[tuple[str, float, int | str | None]] = []
        deferred: list[tuple[str, StageCost, list[nn.Parameter]]] = []  # MATMUL_PARAMETERS_ATTR's, per module
        for name, module in named:
            if stage_of[name] != stage:
                continue
            while deferred and not name.startswith(deferred[-1][0] + "."):
                upstream_grad = _add_weights(*deferred.pop()[1:], upstream_grad)
            while open_attention and not name.startswith(open_attention[-1][0] + "."):
                _close_attention(cost, open_attention.pop(), upstream_grad)
            if _is_attention(module) and not open_attention:
                forward, window = _attention_shape(module, name)
                open_attention.append((name, forward, WINDOWS if name in windowed else window))
            in_head = head_name is not None and (name == head_name or name.startswith(head_name + "."))
            target = head if in_head else cost
            # a bare matmul weight is applied after the module's submodules (Gemma 3: norm, then projection)
            bare = [p for leaf, p in module.named_parameters(recurse=False) if f"{name}.{leaf}" in matmul_params]
            if bare:
                deferred.append((name, target, bare))
            upstream_grad = _add_module(target, module, upstream_grad, {id(p) for p in bare})
        while deferred:
            upstream_grad = _add_weights(*deferred.pop()[1:], upstream_grad)
        while open_attention:
            _close_attention(cost, open_attention.pop(), upstream_grad)
        if cost.matmul_params or cost.unknown_params:
            costs[stage] = cost
    if head.matmul_params:
        costs["target_head"] = head
    _check(model, root, named, stage_of, costs)
    image_tokens = getattr(root, IMAGE_TOKENS_ATTR, None) or _found(model, IMAGE_TOKENS_ATTR)
    if "vision" in costs and image_tokens is None:
        raise _Unsupported(f"{type(root).__name__} has a vision tower but does not say how many patches and "
                           f"image tokens each image has (a {IMAGE_TOKENS_ATTR} attribute; a Hub VLM family sets "
                           f"it from Family.image_tokens).")
    return FlopCounter(costs, image_tokens)


def _stage(name: str, groups: Mapping[str, tuple[str, ...]]) -> str | None:
    """The group whose prefix is the longest on ``name``'s path (as per-module learning rates match)."""
    parts, best, best_len = name.split("."), None, 0
    for alias, prefixes in groups.items():
        for prefix in prefixes:
            p = prefix.split(".")
            on_path = any(parts[i:i + len(p)] == p for i in range(len(parts) - len(p) + 1))
            if on_path and len(p) > best_len:
                best, best_len = alias, len(p)
    return best if best in STAGES else None


def _add_module(cost: StageCost, module: nn.Module, upstream_grad: bool, bare: set[int]) -> bool:
    """Add a module's own matmul cost (``bare``: ids of its parameters counted apart, see _add_weights); returns
    whether inputs after it need gradients."""
    own = [p for p in module.parameters(recurse=False) if id(p) not in bare]
    if isinstance(module, _MATMULS):
        return _add_weights(cost, [module.weight], upstream_grad) or any(p.requires_grad for p in own)
    if not isinstance(module, nn.Embedding):
        cost.unknown_params += sum(p.numel() for p in own if p.dim() >= 2)
    return upstream_grad or any(p.requires_grad for p in own)


def _add_weights(cost: StageCost, weights: list[nn.Parameter], upstream_grad: bool) -> bool:
    """Add matmul weights applied to every row: forward, input gradient if upstream, weight gradient if trained."""
    for weight in weights:
        cost.per_row += 2.0 * weight.numel() * (1 + upstream_grad + weight.requires_grad)
        cost.matmul_params += weight.numel()
    return upstream_grad or any(w.requires_grad for w in weights)


def _is_attention(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def _attention_shape(module: nn.Module, name: str) -> tuple[float, int | None]:
    """(forward FLOPs per query-key pair: 4 * heads * head_dim, sliding window or None)."""
    heads = getattr(module, "num_heads", None) or getattr(getattr(module, "config", None), "num_attention_heads",
                                                            None)
    head_dim = getattr(module, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int):
        width = heads * head_dim
    elif isinstance(getattr(module, "q_proj", None), nn.Linear):
        width = module.q_proj.out_features
    else:
        raise _Unsupported(f"attention module {name} ({type(module).__name__}) has no num_heads/head_dim or q_proj.")
    window = getattr(module, "sliding_window", None)
    return 4.0 * width, window if isinstance(window, int) and window > 0 else None


def _check_named(named: list, stage_of: dict, windowed: set[str], matmul_params: set[str]) -> None:
    """Windowed attention layers are vision attention modules; matmul parameters exist."""
    modules = dict(named)
    for name in sorted(windowed):
        if name not in modules or not _is_attention(modules[name]) or stage_of.get(name) != "vision":
            raise _Unsupported(f"{WINDOWED_ATTENTION_ATTR} names {name!r}, which is no attention module of the "
                               f"vision tower.")
    for name in sorted(matmul_params):
        owner, _, leaf = name.rpartition(".")
        if owner not in modules or leaf not in dict(modules[owner].named_parameters(recurse=False)):
            raise _Unsupported(f"{MATMUL_PARAMETERS_ATTR} names {name!r}, which is no parameter of the model.")


def _close_attention(cost: StageCost, entry: tuple[str, float, int | str | None], upstream_grad: bool) -> None:
    _, forward, window = entry
    cost.attention[window] = cost.attention.get(window, 0.0) + forward * (3 if upstream_grad else 1)
    cost.attention_layers += 1


def _check(model: nn.Module, root: nn.Module, named: list, stage_of: dict, costs: dict[str, StageCost]) -> None:
    """Refuse what the count would get wrong: no text transformer, matmul weights of unknown use."""
    if "text" not in costs or not costs["text"].attention_layers:
        raise _Unsupported(f"{type(model).__name__}: no attention layers found in its text model (the counter "
                           f"knows transformer decoders with *Attention modules).")
    if "vision" in costs and not costs["vision"].attention_layers:
        raise _Unsupported(f"{type(model).__name__}: no attention layers found in its vision tower.")
    counted = sum(c.matmul_params for c in costs.values())
    outside = sum(p.numel() for name, m in named if stage_of[name] is None
                  for p in m.parameters(recurse=False) if p.dim() >= 2 and not isinstance(m, nn.Embedding))
    outside += sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2) - sum(
        p.numel() for p in root.parameters() if p.dim() >= 2)  # wrappers' own (e.g. score heads)
    unknown = sum(c.unknown_params for c in costs.values())
    if unknown + outside > _UNKNOWN_TOLERANCE * counted:
        raise _Unsupported(f"{type(model).__name__} has {unknown + outside:,} matmul-shaped parameters outside "
                           f"Linear/Conv modules or module groups (vs {counted:,} counted).")


def _found(model: nn.Module, attr: str) -> Any:
    return next((getattr(m, attr) for m in model.modules() if getattr(m, attr, None) is not None), None)
