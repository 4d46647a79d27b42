"""model.attn_implementation: varlen_torch — a Hub VLM's text attention as variable-length attention over
documents, with no dense mask: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (a flash kernel, torch
>= 2.10, CUDA, bf16/fp16) on CUDA, one ``scaled_dot_product_attention`` call per document elsewhere.

With sdpa, transformers turns a packed row's restarting positions into a dense block-diagonal mask, and CUDA
sdpa cannot use its flash kernel with a mask. This implementation is registered with transformers'
``AttentionInterface`` under :data:`NAME` and set on the text model only (the vision tower keeps sdpa), and its
mask function with ``AttentionMaskInterface`` is transformers' ``flash_attention_mask``: no 4D mask is built,
the attention function gets ``attention_mask=None`` (or the 2D padding mask of a padded batch) and the text
positions as the ``position_ids`` keyword (for Qwen3-VL / Qwen2.5-VL row 0 of the [4, rows, L] positions). The
documents are the runs of consecutive positions within a row (a new one wherever the position does not go up
by one: the rule of transformers' ``find_packed_sequence_indices``), or in a padded batch each row's unmasked
tokens; rows never share a document. Each attends causally within itself. Boundaries are not taken from
``cu_seq_lens_*`` keywords: a model's forward would hand those to Qwen's vision tower too.

A KV-cache call (generation: fewer queries than keys) is computed by sdpa with the padding mask and a causal
mask aligned to the last key, on any device.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F

NAME = "varlen_torch"
"""The model.attn_implementation value, and the name it is registered under in transformers."""

_HALF = (torch.bfloat16, torch.float16)


def register() -> str:
    """Register the attention function and its mask function with transformers (idempotent); returns
    :data:`NAME`, the value for a text config's ``_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)  # no 4D mask: None, or a batch's 2D padding mask
    return NAME


def use_varlen_text_attention(model: torch.nn.Module) -> None:
    """Set :data:`NAME` as the attention of ``model``'s text model (its vision tower keeps its own)."""
    register()
    model.config.get_text_config(decoder=True)._attn_implementation = NAME


@torch.compiler.disable  # (documents are python ints read from the positions: traced, a graph per count of them)
def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     position_ids: torch.Tensor | None = None, is_causal: bool | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: ``query`` [B, heads, Tq, D], ``key`` / ``value``
    [B, kv_heads, Tk, D] (grouped-query heads allowed) -> ([B, Tq, heads, D], None); positions outside any
    document (a padded batch's padding) get zeros."""
    if dropout:
        raise ValueError(f"attn_implementation={NAME!r} has no attention dropout (got {dropout}); set the model "
                         f"config's attention_dropout to 0, or use model.attn_implementation: sdpa.")
    if sliding_window is not None or softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"attn_implementation={NAME!r} computes full causal attention per document: this "
                         f"model's sliding window / logit softcap / attention sinks are not supported; use "
                         f"model.attn_implementation: sdpa.")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attn_implementation={NAME!r} takes no {attention_mask.dim()}D attention mask (only a "
                         f"batch's 2D padding mask)")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    if q_len != k_len:  # a KV-cache step: not a training path
        return _cached_attention(query, key, value, attention_mask, scaling, causal), None
    q, k, v = (t.transpose(1, 2).reshape(batch * q_len, t.shape[1], t.shape[3]) for t in (query, key, value))
    if attention_mask is not None:
        index, cu, longest = _unpadded(attention_mask)
        q, k, v = (t.index_select(0, index) for t in (q, k, v))
    else:
        index = None
        cu, longest = _documents(position_ids, batch, q_len, query.device)
    out = _varlen(q, k, v, cu, longest, scaling, causal)
    if index is not None:
        out = out.new_zeros(batch * q_len, *out.shape[1:]).index_copy(0, index, out)
    return out.reshape(batch, q_len, *out.shape[1:]), None


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
            scaling: float | None, causal: bool) -> torch.Tensor:
    """q [T, heads, D], k / v [T, kv_heads, D], documents at ``cu`` (int32 cumulative lengths) -> [T, heads, D]."""
    if q.is_cuda:
        if q.dtype not in _HALF and torch.is_autocast_enabled("cuda"):  # (train.bf16: fp32 norms upcast q and k)
            q, k, v = (t.to(torch.get_autocast_dtype("cuda")) for t in (q, k, v))
        if q.dtype not in _HALF:
            raise ValueError(f"attn_implementation={NAME!r} on CUDA runs the flash kernel of "
                             f"torch.nn.attention.varlen, which takes bfloat16 or float16, not {q.dtype}: set "
                             f"model.torch_dtype: bfloat16 (or train.bf16), or model.attn_implementation: sdpa.")
        from torch.nn.attention.varlen import varlen_attn

        options = _varlen_options(causal)
        if "enable_gqa" not in options and k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **options)
    bounds = cu.tolist()
    gqa = k.shape[1] != q.shape[1]
    parts = [F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                            is_causal=causal, scale=scaling, enable_gqa=gqa).transpose(0, 1)
             for a, b in zip(bounds, bounds[1:])]
    return torch.cat(parts)


@functools.cache
def _varlen_options(causal: bool) -> dict[str, Any]:
    """varlen_attn's causal and grouped-query keywords in the installed torch (2.10 had ``is_causal``; later
    versions say causal as ``window_size=(-1, 0)`` and take ``enable_gqa``)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    options: dict[str, Any] = {}
    if "window_size" in params:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        options["is_causal"] = causal
    if "enable_gqa" in params:
        options["enable_gqa"] = True
    return options


# The same position_ids / padding mask reaches every layer of one forward (and its recomputation): their
# boundaries are found once (one host sync), kept while that tensor is the one last seen.
_last: dict[str, tuple[weakref.ref, int, Any]] = {}


def _remembered(kind: str, tensor: torch.Tensor, compute: Any) -> Any:
    seen = _last.get(kind)
    if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:  # (not changed in place)
        return seen[2]
    result = compute()
    _last[kind] = (weakref.ref(tensor), tensor._version, result)
    return result


@torch.compiler.disable
def _documents(position_ids: torch.Tensor | None, batch: int, length: int,
               device: torch.device) -> tuple[torch.Tensor, int]:
    """(cumulative document lengths as int32 on ``device``, longest document) of rows of ``length`` tokens: a
    document starts at each row's start and wherever the position does not go up by one."""
    if position_ids is None:  # each row is one document
        return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device), length

    def compute() -> tuple[torch.Tensor, int]:
        pos = position_ids.expand(batch, length) if position_ids.shape[0] != batch else position_ids
        starts = torch.ones(batch, length, dtype=torch.bool, device=pos.device)
        starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
        at = starts.reshape(-1).nonzero().flatten()
        cu = torch.cat([at, at.new_tensor([batch * length])]).to(device=device, dtype=torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())

    if position_ids.shape[-1] != length:
        raise ValueError(f"attn_implementation={NAME!r}: position_ids of shape {tuple(position_ids.shape)} for "
                         f"{length} tokens")
    return _remembered("positions", position_ids, compute)


@torch.compiler.disable
def _unpadded(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(flat indices of the unmasked tokens, their rows' cumulative lengths as int32, longest row)."""
    def compute() -> tuple[torch.Tensor, torch.Tensor, int]:
        mask = attention_mask.bool()
        lengths = mask.sum(1, dtype=torch.int32)
        cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return mask.reshape(-1).nonzero().flatten(), cu, int(lengths.max())

    return _remembered("mask", attention_mask, compute)


def _cached_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None, causal: bool) -> torch.Tensor:
    """Queries that are the last ``Tq`` of ``Tk`` keys (a KV cache): sdpa with the padding mask and, when causal,
    a causal mask aligned to the last key -> [B, Tq, heads, D]."""
    q_len, k_len = query.shape[2], key.shape[2]
    allowed = torch.ones(query.shape[0], 1, q_len, k_len, dtype=torch.bool, device=query.device)
    if causal:
        allowed = allowed & torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, -k_len:].bool()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2)
