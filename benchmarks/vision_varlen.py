"""The Qwen-VL vision tower's attention as one variable-length call (benchmark option --vision-attn varlen).

transformers' Qwen2.5-VL / Qwen3-VL vision attention runs one attention call per image (24-27 blocks x every image
of the batch, forward and recompute: 824 cuDNN calls a 2B step in the profile of docs/speed.md) unless the vision
config asks for a flash-attention implementation, in which case it passes the images' boundaries (``cu_seqlens``)
to one call. This registers an attention implementation whose name contains "flash" (so transformers takes that
path) and that computes it with PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` on CUDA (torch >= 2.10,
no flash-attn package), and with one sdpa call per image elsewhere (the CPU smoke test). An experiment of the
benchmark, not a vlmtrain option yet: the step-1 loss check against the other contenders is its correctness
check on the GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NAME = "flash_varlen_torch"


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                     max_length_q: int | None = None, max_length_k: int | None = None, is_causal: bool = False,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: query/key/value [1, heads, tokens, head_dim] of the images
    laid end to end, ``cu_seq_lens_*`` their boundaries -> ([1, tokens, heads, head_dim], None)."""
    if cu_seq_lens_q is None or query.shape[0] != 1 or is_causal or attention_mask is not None or dropout:
        raise ValueError(f"{NAME} serves the Qwen-VL vision tower only (one row, image boundaries, no mask, no "
                         f"dropout, not causal)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    default_scale = q.shape[-1] ** -0.5
    if scaling is not None and abs(scaling - default_scale) > 1e-12:
        raise ValueError(f"{NAME}: scaling {scaling} differs from 1/sqrt(head_dim)")
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seq_lens_q.to(device=q.device, dtype=torch.int32)
        longest = int(max_length_q if max_length_q is not None else (cu[1:] - cu[:-1]).max())
        out = varlen_attn(q, k, v, cu, cu, longest, longest)
    else:  # one call per image, as transformers does without flash-attention
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
                         for a, b in zip(bounds, bounds[1:])])
    return out.unsqueeze(0), None


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name for
    ``config.vision_config._attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, varlen_attention)
    return NAME
