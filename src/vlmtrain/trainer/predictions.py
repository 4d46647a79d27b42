"""What evaluation keeps of each batch for compute_metrics and predict, and how it is put together.

Three cases, in this order:
- `args.label_names` set (transformers' convention, for scripts written for its Trainer): labels are those
  batch keys (a tuple in that order; the model still gets them in forward); predictions are every tensor
  output but `loss` and `ignore_keys` (default: the model config's `keys_to_ignore_at_inference`), in output
  order, scalars (e.g. `loss_1`) as one value per batch. vlmtrain's `num_items*` counts are left out, and so
  are a score-head model's full LM `logits`.
- the model returns head outputs `logits_<name>`: predictions are those, labels the batch's `labels_<name>`
  (never the full LM logits, B x L x vocab, for the whole eval set).
- else: the `logits` output (or the first other tensor output) and the batch's `labels`.
A tuple/dict of one entry becomes that one array, as transformers does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def _is_count(key: str) -> bool:
    return key in ("num_items", "num_tokens") or key.startswith("num_items_")


def select_outputs(model: Any, outputs: Any, inputs: Mapping[str, Any], label_names: list[str] | None,
                   ignore_keys: list[str] | None) -> tuple[Any, Any]:
    """(predictions, labels) of one batch: a tensor, or a dict of named tensors (see the module docstring)."""
    if not isinstance(outputs, Mapping):
        return None, inputs.get("labels")
    heads = {k: v for k, v in outputs.items()
             if k.startswith("logits_") and isinstance(v, torch.Tensor) and k not in (ignore_keys or [])}
    if label_names:
        if ignore_keys is None:
            config = getattr(model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", None) or ["past_key_values"])
        drop_lm_logits = bool(heads) and getattr(model, "head_configs", None) is not None
        preds = {k: v for k, v in outputs.items()
                 if k != "loss" and k not in ignore_keys and isinstance(v, torch.Tensor) and not _is_count(k)
                 and not (k == "logits" and drop_lm_logits)}
        has_labels = all(inputs.get(name) is not None for name in label_names)
        return preds or None, {name: inputs[name] for name in label_names} if has_labels else None
    if heads:
        labels = {f"labels_{k[len('logits_'):]}": inputs[f"labels_{k[len('logits_'):]}"] for k in heads
                  if isinstance(inputs.get(f"labels_{k[len('logits_'):]}"), torch.Tensor)}
        return heads, labels or None
    logits = outputs.get("logits")
    if logits is None:
        kept = [v for k, v in outputs.items() if k not in (ignore_keys or []) and not k.startswith("loss")
                and isinstance(v, torch.Tensor) and v.ndim > 0]
        logits = kept[0] if kept else None
    return logits, inputs.get("labels")


def plain_numbers(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """numpy scalars/arrays and tensors as Python numbers/lists (compute_metrics often returns np.float32)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if isinstance(value, (np.generic, np.ndarray)):
            value = value.item() if value.size == 1 else value.tolist()
        out[key] = value
    return out


def pad_concat(chunks: list[torch.Tensor], pad: int = -100) -> np.ndarray:
    """Concatenate along dim 0, padding dim 1 (sequence) to the longest chunk with `pad`."""
    if chunks[0].ndim < 2:
        return torch.cat(chunks).numpy()
    longest = max(c.shape[1] for c in chunks)
    padded = [torch.nn.functional.pad(c, (0, 0) * (c.ndim - 2) + (0, longest - c.shape[1]), value=pad)
              for c in chunks]
    return torch.cat(padded).numpy()


class Collected:
    """Per-batch predictions or labels (a tensor, a tuple, or a dict of named tensors), kept on the CPU."""

    def __init__(self) -> None:
        self.kind: str | None = None  # "single" | "tuple" | "dict"
        self.chunks: dict[Any, list[torch.Tensor]] = {}
        self._arrays: dict[Any, np.ndarray] | None = None

    def add(self, value: Any) -> None:
        if value is None:
            return
        self._arrays = None
        if isinstance(value, Mapping):
            self.kind, items = "dict", list(value.items())
        elif isinstance(value, (tuple, list)):
            self.kind, items = "tuple", list(enumerate(value))
        else:
            self.kind, items = "single", [(0, value)]
        for key, tensor in items:
            if isinstance(tensor, torch.Tensor):
                self.chunks.setdefault(key, []).append(torch.atleast_1d(tensor.detach().cpu()))

    def rows(self) -> dict[str, Any]:
        """This rank's rows, per key (to gather across ranks)."""
        return {"kind": self.kind, "rows": {k: [row for c in chunks for row in c] for k, chunks in self.chunks.items()}}

    def set_rows(self, parts: list[dict[str, Any]], interleave: bool) -> None:
        """Every rank's :meth:`rows` put together: round-robin over ranks (rank r evaluated samples r, r + W,
        ...: dataset order) if ``interleave``, else in rank order."""
        self.kind = next((p["kind"] for p in parts if p["kind"] is not None), None)
        keys = list(dict.fromkeys(k for p in parts for k in p["rows"]))
        self.chunks, self._arrays = {}, None
        for key in keys:
            per_rank = [p["rows"].get(key, []) for p in parts]
            if interleave:
                ordered = [rows[i] for i in range(max(map(len, per_rank))) for rows in per_rank if i < len(rows)]
            else:
                ordered = [row for rows in per_rank for row in rows]
            self.chunks[key] = [row[None] for row in ordered]

    def arrays(self) -> dict[Any, np.ndarray]:
        if self._arrays is None:
            self._arrays = {k: pad_concat(chunks) for k, chunks in self.chunks.items() if chunks}
        return self._arrays

    def result(self) -> Any:
        """One array, or a tuple of arrays (in key order) when there are several; None if nothing was kept."""
        arrays = self.arrays()
        if not arrays:
            return None
        return next(iter(arrays.values())) if len(arrays) == 1 else tuple(arrays.values())

    def named(self, prefix: str) -> dict[str, np.ndarray]:
        """Arrays of the keys `<prefix><name>`, by name (e.g. prefix `logits_`: each head's outputs)."""
        if self.kind != "dict":
            return {}
        return {k[len(prefix):]: v for k, v in self.arrays().items() if isinstance(k, str) and k.startswith(prefix)}
