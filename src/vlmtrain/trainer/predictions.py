"""What evaluation keeps of each batch for compute_metrics and predict, and how it is put together.

Two cases (vlmtrain.Trainer puts transformers' `args.label_names` convention before them:
vlmtrain/compat/evaluation.py):
- the model returns head outputs `logits_<name>`: predictions are those, labels the batch's `labels_<name>`
  (never the full LM logits, B x L x vocab, for the whole eval set).
- else: the `logits` output (or the first other tensor output) and the batch's `labels`.
A tuple/dict of one entry becomes that one array, as transformers does. Also: the sample-weighted means of
several eval sets' metrics (combine_eval_metrics).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def select_outputs(outputs: Any, inputs: Mapping[str, Any], ignore_keys: list[str] | None) -> tuple[Any, Any]:
    """(predictions, labels) of one batch: a tensor, or a dict of named tensors (see the module docstring)."""
    if not isinstance(outputs, Mapping):
        return None, inputs.get("labels")
    heads = {k: v for k, v in outputs.items()
             if k.startswith("logits_") and isinstance(v, torch.Tensor) and k not in (ignore_keys or [])}
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


def pad_cat(chunks: list[torch.Tensor], pad: int = -100) -> torch.Tensor:
    """Concatenate along dim 0, padding dim 1 (sequence) to the longest chunk with `pad`."""
    if chunks[0].ndim < 2:
        return torch.cat(chunks)
    longest = max(c.shape[1] for c in chunks)
    return torch.cat([c if c.shape[1] == longest else  # (no copy of what needs no padding)
                      torch.nn.functional.pad(c, (0, 0) * (c.ndim - 2) + (0, longest - c.shape[1]), value=pad)
                      for c in chunks])


class Collected:
    """Per-batch predictions or labels (a tensor, a tuple, or a dict of named tensors), kept on the CPU (put
    together over ranks by the ``eval_gather`` part: vlmtrain/evaluation/gather.py)."""

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

    def arrays(self) -> dict[Any, np.ndarray]:
        if self._arrays is None:
            self._arrays = {k: pad_cat(chunks).numpy() for k, chunks in self.chunks.items() if chunks}
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


_NOT_AVERAGED = ("runtime", "samples_per_second", "steps_per_second", "samples", "model_preparation_time")


def combine_eval_metrics(metrics: Mapping[str, float], prefixes: list[str], prefix: str) -> dict[str, float]:
    """Sample-weighted means over several evaluated sets (`<set prefix>_<metric>`, each with `_samples`) of the
    metrics every set reports, as `<prefix>_<metric>`; skipped counts and sample counts are summed."""
    counts = [metrics.get(f"{p}_samples") for p in prefixes]
    if not prefixes or any(not c for c in counts):
        return {}
    per_set = [{k[len(p) + 1:] for k in metrics if k.startswith(f"{p}_")} for p in prefixes]
    total, out = sum(counts), {}
    for name in sorted(set.intersection(*per_set) - set(_NOT_AVERAGED)):
        values = [metrics[f"{p}_{name}"] for p in prefixes]
        if all(isinstance(v, (int, float)) for v in values) and not name.startswith("skipped_"):
            out[f"{prefix}_{name}"] = sum(v * c for v, c in zip(values, counts)) / total
    for name in sorted(n for n in set.union(*per_set) if n.startswith("skipped_")):
        out[f"{prefix}_{name}"] = sum(metrics.get(f"{p}_{name}", 0) for p in prefixes)
    out[f"{prefix}_samples"] = total
    return out
