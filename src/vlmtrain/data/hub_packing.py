"""Padding-free packing for Hub VLMs: processed samples -> rows of ``pack_length`` tokens, each sample alone.

Samples are placed whole into rows (:func:`~vlmtrain.data.packing.pack_lengths`: a sample is never split, so
no row cuts an image's token run; a sample longer than the row is an error). Per row, the per-token tensors
are the samples' own, concatenated; the image tensors follow the family's batch layout in row order (the order
the model meets the image tokens); no ``attention_mask`` is passed. Positions restart at 0 for each sample, and
transformers' masking builds a block-diagonal causal mask from them (sdpa / eager / flex: the dense or block
mask of ``find_packed_sequence_indices``; flash-attention: varlen over ``cu_seq_lens`` derived from them when
the batch is one row, see ``flatten``). Families with multimodal rotary positions (Qwen3-VL, Qwen2.5-VL;
``Family.rope_positions``) get ``position_ids`` [4, rows, L]: row 0 the restarting text position (what the mask
is built from), rows 1-3 each sample's own ``get_rope_index`` positions, concatenated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from vlmtrain.data.packing import IGNORE_INDEX

_SKIP = ("input_ids", "labels", "attention_mask", "num_images", "head_labels")


def pack_hub_items(items: Sequence[dict[str, Any]], bins: Sequence[Sequence[int]], pack_length: int, family: Any,
                   pad_token_id: int, rope_positions: Callable[[dict[str, Any]], torch.Tensor] | None = None,
                   flatten: bool = False) -> dict[str, Any]:
    """Lay processed items (:class:`~vlmtrain.data.hub_processing.HubVLMProcessor` output) out in packed rows.

    ``bins``: each row's item indices, in row order. Returns ``input_ids`` / ``labels`` / every per-token key
    ([rows, pack_length]; padding at a row's end has the pad id, label -100 and its own run of positions),
    ``position_ids`` ([rows, pack_length], or [4, rows, pack_length] with ``rope_positions``: one sample -> its
    [3, L] positions), the image keys by ``family.batch_layout`` in row order (``pad_images``: per row) and
    ``use_cache=False``. Each sample's first label is -100 (the previous sample never predicts it). ``flatten``:
    the rows joined into one row [1, rows * pack_length] (flash-attention takes document boundaries from the
    positions only for a single row).
    """
    rows = len(bins)
    order = [i for members in bins for i in members]
    lengths = [int(len(items[i]["input_ids"])) for i in range(len(items))]
    for r, members in enumerate(bins):
        if sum(lengths[i] for i in members) > pack_length:
            raise ValueError(f"packed row {r} holds {sum(lengths[i] for i in members)} tokens, more than "
                             f"pack_length={pack_length}")
    layout, pad_values = family.batch_layout, dict(family.pad_values)
    out: dict[str, Any] = {
        "input_ids": _rows(items, bins, "input_ids", pack_length, pad_token_id),
        "labels": _rows(items, bins, "labels", pack_length, IGNORE_INDEX, first=IGNORE_INDEX),
    }
    text = torch.zeros(rows, pack_length, dtype=torch.long)
    rope = torch.zeros(3, rows, pack_length, dtype=torch.long) if rope_positions is not None else None
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            n = lengths[i]
            text[r, at:at + n] = torch.arange(n)
            if rope is not None:
                pos = torch.as_tensor(rope_positions(items[i]))
                if pos.shape != (3, n):
                    raise ValueError(f"rope_positions gave shape {tuple(pos.shape)} for a sample of {n} tokens; "
                                     f"expected (3, {n})")
                rope[:, r, at:at + n] = pos
            at += n
        text[r, at:] = torch.arange(pack_length - at)
        if rope is not None:
            rope[:, r, at:] = torch.arange(pack_length - at)
    out["position_ids"] = text if rope is None else torch.cat([text[None], rope])
    per_token = ["input_ids", "labels", "position_ids"]
    names = [k for k in dict.fromkeys(k for it in items for k in it) if k not in _SKIP and not k.startswith("prompt_")]
    for key in names:
        how = layout.get(key)
        if how is None:  # undeclared: per-token if as long as its sample (as HubVLMCollator decides)
            how = "pad" if all(it.get(key) is not None and torch.as_tensor(it[key]).ndim >= 1
                               and len(it[key]) == len(it["input_ids"]) for it in items) else "stack"
        present = [torch.as_tensor(items[i][key]) for i in order if items[i].get(key) is not None]
        if not present:
            continue
        if how == "pad":
            if len(present) != len(items):
                raise ValueError(f"per-token key {key!r} is missing from some samples")
            out[key] = _rows(items, bins, key, pack_length, pad_values.get(key, 0))
            per_token.append(key)
        elif how == "concat":
            out[key] = torch.cat(present)
        elif callable(how):  # a family's own concatenation over samples (e.g. LLaVA-OneVision's crops)
            out[key] = how(present)
        elif how == "pad_images":
            groups = [order] if flatten else list(bins)
            out[key] = pad_images([_row_images(items, members, key) for members in groups], present[0])
        else:
            raise ValueError(f"family {family.name!r}: key {key!r} (layout {how!r}) is per sample and cannot be "
                             f"packed into rows; declare its layout ('pad', 'concat', 'pad_images').")
    if flatten:
        for key in per_token:
            out[key] = out[key].reshape(*out[key].shape[:-2], 1, rows * pack_length)
    out["use_cache"] = False
    return out


def _rows(items: Sequence[dict[str, Any]], bins: Sequence[Sequence[int]], key: str, width: int, pad: Any,
          first: Any = None) -> torch.Tensor:
    """[rows, width]: each row's items' ``key`` concatenated, then ``pad``; ``first``: each item's first value."""
    like = torch.as_tensor(items[bins[0][0]][key])
    out = torch.full((len(bins), width), pad, dtype=like.dtype)
    for r, members in enumerate(bins):
        at = 0
        for i in members:
            value = torch.as_tensor(items[i][key]).reshape(-1)
            out[r, at:at + len(value)] = value
            if first is not None:
                out[r, at] = first
            at += len(value)
    return out


def _row_images(items: Sequence[dict[str, Any]], members: Sequence[int], key: str) -> torch.Tensor | None:
    values = [torch.as_tensor(items[i][key]) for i in members if items[i].get(key) is not None
              and len(items[i][key])]
    return torch.cat(values) if values else None


def pad_images(values: list[Any], like: torch.Tensor) -> torch.Tensor:
    """A ``pad_images`` key's batch: [N_i, ...] per sample or per packed row (None: no images) -> [B, max N_i,
    ...], zero-padded, of ``like``'s dtype and trailing shape."""
    most = max((len(v) for v in values if v is not None), default=0)
    out = like.new_zeros((len(values), most, *like.shape[1:]))
    for i, v in enumerate(values):
        if v is not None and len(v):
            out[i, : len(v)] = torch.as_tensor(v)
    return out
