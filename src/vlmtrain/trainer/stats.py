"""Running averages for logging: every loss a model returns, weighted by num_items; what a batch says of its samples
and skipped ones (a window's and the run's counts are the ``window_stats`` part's: logging/throughput.py)."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .distributed import NamedSums


def extra_losses(outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The scalar `loss_<name>` entries of a model output (besides `loss` itself), and the scalars of its
    `metrics` mapping under their own names (an objective's logged metrics, e.g. DPO's `rewards/chosen`), each
    averaged like `loss` over the output's items."""
    found = {}
    for key, value in outputs.items():
        if key.startswith("loss_") and isinstance(value, torch.Tensor) and value.numel() == 1:
            found[key] = value.detach().reshape(())
    metrics = outputs.get("metrics")
    if isinstance(metrics, Mapping):
        found.update({k: v.detach().reshape(()) for k, v in metrics.items()
                      if isinstance(v, torch.Tensor) and v.numel() == 1})
    return found


LOSS_ONLY_ATTR = "vlmtrain_accepts_loss_only"
"""A model (or, through peft's attribute lookup, the model it wraps) with this attribute true takes
``forward(..., loss_only=True)``: it then returns its losses and counts without logits, computing the LM head
only where a target is predicted (models/speed/lm_loss.py). The Trainer passes it in training, and in evaluation when
it keeps no logits (prediction_loss_only, or generated predictions)."""


def item_counts(outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Per-loss item counts: `loss_<name>` -> the output's `num_items_<name>` (how many items, e.g. samples of a
    score head, that loss averaged over), for the extra losses that report one."""
    found = {}
    for key, value in outputs.items():
        loss_key = "loss_" + key[len("num_items_"):]
        if key.startswith("num_items_") and loss_key in outputs and value is not None:
            n = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
            found[loss_key] = n.reshape(()).float()
    return found


def num_items_of(outputs: Mapping[str, Any], model: Any = None, inputs: Mapping[str, Any] | None = None,
                 count_targets: Callable[[Any, Mapping[str, Any]], torch.Tensor | None] | None = None
                 ) -> torch.Tensor | None:
    """The number of targets a loss averaged over: the model's `num_items` (or `num_tokens`), else what
    ``count_targets`` (the ``loss_targets`` part, models/speed/lm_loss.py: the shifted labels of a transformers model
    whose loss is the causal-LM one) counts in the inputs; else None."""
    n = outputs.get("num_items", outputs.get("num_tokens")) if isinstance(outputs, Mapping) else None
    if n is None:
        return None if count_targets is None else count_targets(model, inputs or {})
    return n.detach().reshape(()).float() if isinstance(n, torch.Tensor) else torch.tensor(float(n))


class LossAverager:
    """Sum of value*weight and of weight per key; tensors stay on device until `compute()` (one sync). Over ranks,
    the keys averaged are agreed once for the run (:class:`~vlmtrain.trainer.distributed.NamedSums`): a rank
    that saw none of a loss in a window (e.g. `loss_lm` of score-only samples) adds 0 to its sum and weight."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.weights: dict[str, Any] = {}
        self._names = NamedSums()  # (kept by reset(): the run's agreed keys)

    def add(self, values: Mapping[str, torch.Tensor], weight: torch.Tensor | float,
            own_weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Add each value times its weight: ``own_weights[key]`` (a per-loss item count) if given for that key,
        else ``weight``. A value with a weight of 0 adds nothing, even if it is NaN (the mean loss of a
        micro-batch without targets)."""
        for key, value in values.items():
            w = own_weights[key] if own_weights is not None and key in own_weights else weight
            if isinstance(w, torch.Tensor):
                w = w.to(value.device)
                v = torch.where(w > 0, value.detach().float() * w, torch.zeros((), device=value.device))
            else:
                v = value.detach().float() * w if w > 0 else torch.zeros((), device=value.device)
            self.sums[key] = self.sums[key] + v if key in self.sums else v
            self.weights[key] = self.weights[key] + w if key in self.weights else w

    def add_sum(self, values: Mapping[str, torch.Tensor], weight: float) -> None:
        """Add each value as it is (already a share of a total, e.g. a loss normalized by its window's count)
        and ``weight`` (e.g. 1 once per optimizer step): the mean is then the sum of the shares per weight."""
        for key, value in values.items():
            v = value.detach().float()
            self.sums[key] = self.sums[key] + v if key in self.sums else v
            self.weights[key] = self.weights[key] + weight if key in self.weights else weight

    def step_share(self, key: str, total: torch.Tensor, world_size: int) -> LossAverager:
        """A new averager holding only ``key``, as this rank's share of an optimizer step's mean (``total``: the
        step's weight summed over all ranks; this averager: the step's micro-batches), weighted 1 on each rank:
        averaged over steps, the mean of the steps' means, as transformers' Trainer makes ``train_loss``. A step
        without any weight (no target on any rank) adds nothing."""
        out = LossAverager()
        if key in self.sums:
            out.sums[key] = torch.where(total > 0, self.sums[key] * world_size / total.clamp(min=1e-30), 0.0)
            out.weights[key] = torch.where(total > 0, 1.0, 0.0)
        return out

    def compute(self, across_ranks: bool = True) -> dict[str, float]:
        """Weighted means; under torch.distributed (unless across_ranks=False), over every rank's sums and
        weights (through the gloo metrics group: every rank must call it, whatever keys it has). A key whose
        weight is 0 over all ranks (no items in the window) is left out, never NaN."""
        local = {k: [float(self.sums[k]), float(self.weights[k])] for k in self.sums}
        totals = self._names.reduce(local, 2) if across_ranks else local
        return {k: s / w for k, (s, w) in sorted(totals.items()) if w > 0}

    def reset(self) -> None:
        self.sums.clear()
        self.weights.clear()

    def merge(self, other: LossAverager, keys: tuple[str, ...] | None = None) -> None:
        """Add ``other``'s sums and weights (only ``keys`` if given) to this one."""
        for key in other.sums if keys is None else [k for k in keys if k in other.sums]:
            self.sums[key] = self.sums[key] + other.sums[key] if key in self.sums else other.sums[key]
            self.weights[key] = self.weights[key] + other.weights[key] if key in self.weights else other.weights[key]

    def state_dict(self) -> dict:
        return {"sums": {k: float(v) for k, v in self.sums.items()},
                "weights": {k: float(v) for k, v in self.weights.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {k: torch.tensor(v, dtype=torch.float32) for k, v in state["sums"].items()}
        self.weights = dict(state["weights"])


def skipped_counts(batch: Any) -> Mapping[str, int]:
    """Per-reason counts of samples the collator dropped from this batch (its ``skipped`` entry, if any)."""
    skipped = batch.get("skipped") if isinstance(batch, Mapping) else None
    return skipped if isinstance(skipped, Mapping) else {}


# Batch entries that describe the batch for logging and never reach the model's forward.
BOOKKEEPING_KEYS = ("skipped", "skipped_keys", "pack_stats")


def is_empty_batch(batch: Any) -> bool:
    """A batch with nothing for the model (a collator dropped every sample): only bookkeeping entries."""
    return isinstance(batch, Mapping) and all(k in BOOKKEEPING_KEYS for k in batch)


RANK_SYNC_REASON = "empty_batch_on_another_rank"
"""Skip reason of good samples dropped because another rank's batch of the same micro-step had no usable sample
(under DDP/FSDP every rank must run the same steps). Not bad data: max_bad_sample_fraction leaves them out."""


def batch_samples(batch: Mapping[str, Any], default: int = 0) -> int:
    """How many samples ``batch`` holds: its ``pack_stats``' count (packed rows hold several), else the rows of its
    ``input_ids`` or of its first tensor with a batch dimension; ``default`` when it has none."""
    layout, ids = batch.get("pack_stats"), batch.get("input_ids")
    if isinstance(layout, Mapping):
        return int(layout["samples"])
    first = ids if isinstance(ids, torch.Tensor) else next(
        (v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), None)
    return int(first.shape[0]) if first is not None else default


def dropped_for_rank_sync(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` turned into an empty one whose own samples are counted under :data:`RANK_SYNC_REASON`."""
    skipped = Counter(skipped_counts(batch))
    skipped[RANK_SYNC_REASON] += batch_samples(batch)
    return {"skipped": dict(skipped), "skipped_keys": list(batch.get("skipped_keys") or [])}


class NonfiniteSteps:
    """Counts steps skipped for a NaN/Inf loss or gradient: in a row (to stop), per logging window, in all."""

    def __init__(self, limit: int) -> None:
        self.limit, self.run, self.window, self.total = limit, 0, 0, 0

    def ok(self) -> None:
        self.run = 0

    def skipped(self, step: int, grad_norm: float) -> None:
        """Step `step` had no update; raises once `limit` steps in a row had none."""
        self.run, self.window, self.total = self.run + 1, self.window + 1, self.total + 1
        warnings.warn(f"step {step}: non-finite loss or gradients (grad norm {grad_norm}); the update is skipped",
                      stacklevel=4)
        if self.limit and self.run >= self.limit:
            raise RuntimeError(f"steps {step - self.limit + 1}..{step}: {self.limit} consecutive steps had a "
                               f"non-finite loss or gradients (max_consecutive_nonfinite_steps={self.limit}). Lower "
                               f"the learning rate, check the data of those steps, or resume from the last checkpoint.")

    def pop_window(self) -> int:
        window, self.window = self.window, 0
        return window

    def state_dict(self) -> dict[str, int]:
        """The counts a checkpoint keeps: a resumed run goes on counting steps in a row, in the window, in all."""
        return {"run": self.run, "window": self.window, "total": self.total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.run, self.window, self.total = state["run"], state["window"], state["total"]
