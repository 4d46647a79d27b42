"""Padding for data's collators, and a plain collator that stacks or pads dict samples (the Trainer's own
default collator, with transformers' label conventions too, is trainer/collate.py's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

# Padding values by key; anything else pads with pad_token_id.
PAD_BY_KEY = {"labels": -100, "attention_mask": 0}


def pad_sequences(seqs: list[torch.Tensor], value: int | float, side: str = "right") -> torch.Tensor:
    """Pad 1-D (or [L, ...]) tensors along dim 0 to the longest one."""
    longest = max(s.shape[0] for s in seqs)
    out = seqs[0].new_full((len(seqs), longest, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        if side == "right":
            out[i, : s.shape[0]] = s
        else:
            out[i, longest - s.shape[0]:] = s
    return out


def to_tensor(value: Any) -> Any:
    """A tensor for a tensor, numpy array, number or list of numbers (numpy scalars too); other values as they
    are."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (int, float, bool, np.generic)):
        return torch.tensor(value)
    if isinstance(value, Sequence) and value and all(isinstance(v, (int, float, bool, np.generic)) for v in value):
        return torch.tensor(np.asarray(value) if isinstance(value[0], np.generic) else value)
    if isinstance(value, Sequence) and not value:
        return torch.tensor([], dtype=torch.long)
    return value


class PadCollator:
    """Collate dict samples (e.g. tokenized ones: ``input_ids``, ``labels``): tensors/number lists are stacked,
    or right-padded when lengths differ (labels with -100, attention_mask with 0, the rest with pad_token_id);
    other values become lists; keys whose value is None (in the first sample) are left out. The Trainer's
    default collator (trainer/collate.py) does the same, plus transformers' ``label`` / ``label_ids``."""

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = {}
        for key in features[0]:
            if features[0][key] is None:
                continue
            values = [to_tensor(f[key]) for f in features]
            if not all(isinstance(v, torch.Tensor) for v in values):
                batch[key] = [f[key] for f in features]
            elif all(v.shape == values[0].shape for v in values):
                batch[key] = torch.stack(values)
            elif all(v.ndim >= 1 and v.shape[1:] == values[0].shape[1:] for v in values):
                batch[key] = pad_sequences(values, PAD_BY_KEY.get(key, self.pad_token_id))
            else:
                raise ValueError(f"Cannot collate key {key!r}: shapes {[tuple(v.shape) for v in values]} "
                                 f"differ beyond the first dimension; pass a data_collator.")
        return batch
