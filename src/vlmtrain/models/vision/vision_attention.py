"""model.attn_implementation: varlen_torch, the vision half — a Qwen-VL vision tower attends over all of a
batch's images in one variable-length attention call instead of one call per image.

transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention lays every image's patches end to end in one
sequence and, unless its config asks for a flash-attention implementation, splits it at the images' boundaries
(``cu_seqlens``; Qwen2.5-VL's windowed blocks: at each window's) and calls the attention function once per
image: 24-27 blocks x every image of the batch, forward and recompute (824 cuDNN calls a step for Qwen3-VL-2B
at 16 images, docs/speed.md). With an implementation whose name contains "flash" it hands the boundaries to
one call instead (``cu_seq_lens_q/k``, ``max_length_q/k``). :data:`NAME` is such an implementation: it is
registered with transformers' ``AttentionInterface`` and computes non-causal attention within each image with
:func:`vlmtrain.models.speed.varlen_attention._varlen`, the text half's kernel call: PyTorch's own
``torch.nn.attention.varlen.varlen_attn`` on CUDA (torch >= 2.10, bfloat16 / float16, no flash-attn package),
one ``scaled_dot_product_attention`` per image elsewhere. Images never attend to each other.

Only vision towers that take image boundaries get it (:data:`VISION_MODEL_TYPES`); the SigLIP towers of
Idefics3 / SmolVLM, LLaVA-OneVision and Gemma 3 attend over fixed-size crops or views stacked as a batch,
already one call per layer, and keep their attention.
"""

from __future__ import annotations

from typing import Any

import torch

from vlmtrain.models.speed.varlen_attention import NAME as TEXT_NAME
from vlmtrain.models.speed.varlen_attention import _varlen

NAME = "flash_varlen_torch_vision"
"""Registered in transformers for the vision config (``_attn_implementation``): "flash" in the name is what
makes transformers' Qwen-VL vision attention pass the image boundaries to a single call."""

VISION_MODEL_TYPES = ("qwen3_vl_vision", "qwen2_5_vl_vision", "qwen2_vl_vision")
"""Vision configs (``model_type``) whose attention is one call over image boundaries with :data:`NAME`."""


def register() -> str:
    """Register :func:`vision_varlen_attention` with transformers (idempotent); returns :data:`NAME`."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, vision_varlen_attention)
    return NAME


def use_varlen_vision_attention(model: torch.nn.Module) -> bool:
    """Set :data:`NAME` as the attention of ``model``'s vision tower if it is one of :data:`VISION_MODEL_TYPES`
    (returns whether it was); other towers keep theirs."""
    vision = getattr(model.config, "vision_config", None)
    if getattr(vision, "model_type", None) not in VISION_MODEL_TYPES:
        return False
    vision._attn_implementation = register()
    return True


def vision_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                            max_length_q: int | None = None, max_length_k: int | None = None,
                            is_causal: bool = False, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface as Qwen-VL vision attention calls it with a flash
    implementation: ``query`` / ``key`` / ``value`` [1, heads, patches, head_dim] of the images laid end to end,
    ``cu_seq_lens_q`` (= ``cu_seq_lens_k``) their cumulative lengths -> ([1, patches, heads, head_dim], None)."""
    if cu_seq_lens_q is None or query.shape[0] != 1 or is_causal or attention_mask is not None or dropout:
        raise ValueError(f"attn_implementation={NAME!r} (model.attn_implementation: {TEXT_NAME}) serves a Qwen-VL "
                         f"vision tower only: one row of images with their boundaries (cu_seq_lens_q), no mask, no "
                         f"dropout, not causal; got {type(module).__name__} with a query of shape "
                         f"{tuple(query.shape)}, cu_seq_lens_q {'missing' if cu_seq_lens_q is None else 'given'}, "
                         f"mask {'given' if attention_mask is not None else 'none'}, dropout {dropout}, causal "
                         f"{is_causal}")
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k,
                                                                                              cu_seq_lens_q):
        raise ValueError(f"attn_implementation={NAME!r}: the vision tower's key boundaries differ from its query "
                         f"boundaries")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [patches, heads, head_dim]
    cu = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
    longest = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
    return _varlen(q, k, v, cu, longest, scaling, causal=False).unsqueeze(0), None
