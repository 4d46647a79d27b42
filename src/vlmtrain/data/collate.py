"""The default collator (the Trainer's when no data_collator is given, through its ``default_collator`` part): stack
equal-shaped values, right-pad 1-D sequences of different lengths, with transformers' ``default_data_collator``
conventions; and the padding helper the other collators of data/ use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

# Padding values by key; anything else pads with pad_token_id.
PAD_BY_KEY = {"labels": -100, "attention_mask": 0}


def _to_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, (int, float, bool, np.generic)):  # (numpy scalars too, as transformers' collator)
        return torch.tensor(value)
    if isinstance(value, Sequence) and value and all(isinstance(v, (int, float, bool, np.generic)) for v in value):
        return torch.tensor(np.asarray(value) if isinstance(value[0], np.generic) else value)
    if isinstance(value, Sequence) and not value:
        return torch.tensor([], dtype=torch.long)
    return value


def pad_sequences(seqs: list[torch.Tensor], value: int | float, side: str = "right",
                  multiple: int | None = None) -> torch.Tensor:
    """Pad 1-D (or [L, ...]) tensors along dim 0 to the longest one (rounded up to ``multiple``)."""
    longest = max(s.shape[0] for s in seqs)
    if multiple:
        longest = -(-longest // multiple) * multiple
    out = seqs[0].new_full((len(seqs), longest, *seqs[0].shape[1:]), value)
    for i, s in enumerate(seqs):
        if side == "right":
            out[i, : s.shape[0]] = s
        else:
            out[i, longest - s.shape[0]:] = s
    return out


def _labels_as_transformers(features: list[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], Any]:
    """transformers' ``default_data_collator`` renames a sample's ``label`` (a scalar) or ``label_ids`` to the batch's
    ``labels``, typed long for integers and float otherwise. Returns the features without those keys and that
    tensor (None when the samples have neither)."""
    first = features[0]
    key = "label" if first.get("label") is not None else "label_ids" if first.get("label_ids") is not None else None
    if key is None:
        return features, None
    values = [f[key] for f in features]
    if isinstance(values[0], torch.Tensor) and key == "label_ids":
        labels = torch.stack(values)
    else:
        probe = values[0].item() if isinstance(values[0], torch.Tensor) else values[0]
        probe = probe[0] if key == "label_ids" else probe
        labels = torch.tensor(values, dtype=torch.long if isinstance(probe, (int, np.integer)) else torch.float)
    return [{k: v for k, v in f.items() if k not in ("label", "label_ids")} for f in features], labels


class DefaultCollator:
    """Collate dict samples: tensors/number lists are stacked, or right-padded when lengths differ
    (labels with -100, attention_mask with 0, the rest with pad_token_id). Other values become lists. As
    transformers' ``default_data_collator``: numpy scalars become tensors, a ``label`` / ``label_ids`` becomes
    ``labels``, and keys whose value is None (in the first sample) are left out."""

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("Cannot collate an empty list of samples.")
        if not all(isinstance(f, Mapping) for f in features):
            bad = next(type(f).__name__ for f in features if not isinstance(f, Mapping))
            raise TypeError(f"The default collator expects dict samples, got {bad}: pass a data_collator.")
        batch: dict[str, Any] = {}
        if "labels" not in features[0]:
            features, labels = _labels_as_transformers(features)
            if labels is not None:
                batch["labels"] = labels
        for key in features[0]:
            if features[0][key] is None:
                continue
            values = [_to_tensor(f[key]) for f in features]
            if all(isinstance(v, torch.Tensor) for v in values):
                if all(v.shape == values[0].shape for v in values):
                    batch[key] = torch.stack(values)
                elif all(v.ndim >= 1 and v.shape[1:] == values[0].shape[1:] for v in values):
                    batch[key] = pad_sequences(values, PAD_BY_KEY.get(key, self.pad_token_id))
                else:
                    raise ValueError(f"Cannot collate key {key!r}: shapes {[tuple(v.shape) for v in values]} "
                                     f"differ beyond the first dimension; pass a data_collator.")
            else:
                batch[key] = [f[key] for f in features]
        return batch
