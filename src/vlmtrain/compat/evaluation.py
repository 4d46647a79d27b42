"""What evaluation and predict report as transformers' Trainer reports them, for scripts written for it: the
speed metrics of an evaluation (`<prefix>_runtime`, `_samples_per_second`, `_steps_per_second`,
`_model_preparation_time`), the predictions and labels of a model that returns a tuple `(loss, logits, ...)`,
and those of a batch when `args.label_names` is set. A mixin of :class:`vlmtrain.Trainer`
(vlmtrain/compat/trainer.py) that fills the evaluation hooks of the trainer core (vlmtrain/trainer/evaluation.py),
whose plain defaults report none of this."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def _is_count(key: str) -> bool:
    """vlmtrain's item counts among a model's outputs: never predictions."""
    return key in ("num_items", "num_tokens") or key.startswith("num_items_")


def outputs_by_label_names(model: Any, outputs: Mapping[str, Any], inputs: Mapping[str, Any],
                           label_names: list[str], ignore_keys: list[str] | None) -> tuple[Any, Any]:
    """(predictions, labels) of one batch as transformers' Trainer takes them with `args.label_names`: labels are
    those batch keys (a tuple in that order once collected; the model still gets them in forward); predictions
    are every tensor output but `loss` and `ignore_keys` (default: the model config's
    `keys_to_ignore_at_inference`), in output order, scalars (e.g. `loss_1`) as one value per batch. vlmtrain's
    `num_items*` counts are left out, and so are a score-head model's full LM `logits`."""
    heads = any(k.startswith("logits_") and isinstance(v, torch.Tensor) and k not in (ignore_keys or [])
                for k, v in outputs.items())
    if ignore_keys is None:
        config = getattr(model, "config", None)
        ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", None) or ["past_key_values"])
    drop_lm_logits = heads and getattr(model, "head_configs", None) is not None
    preds = {k: v for k, v in outputs.items()
             if k != "loss" and k not in ignore_keys and isinstance(v, torch.Tensor) and not _is_count(k)
             and not (k == "logits" and drop_lm_logits)}
    has_labels = all(inputs.get(name) is not None for name in label_names)
    return preds or None, {name: inputs[name] for name in label_names} if has_labels else None


class TransformersEvaluation:
    """TrainerCore's evaluation hooks with transformers' conventions, over its attributes (args, model,
    world_size)."""

    def _has_labels(self, inputs: Mapping[str, Any]) -> bool:
        """Whether the batch holds every label (``args.label_names``, default ``labels``): then evaluation takes the
        loss from compute_loss, as transformers' prediction_step does."""
        names = getattr(self.args, "label_names", None) or ["labels"]
        return all(inputs.get(name) is not None for name in names)

    def _predictions_and_labels(self, outputs: Any, inputs: dict[str, Any],
                                ignore_keys: list[str] | None) -> tuple[Any, Any]:
        """With `args.label_names` set, transformers' convention (:func:`outputs_by_label_names`); else the
        core's (score heads' outputs, or the logits)."""
        label_names = getattr(self.args, "label_names", None)
        if label_names and isinstance(outputs, Mapping):
            return outputs_by_label_names(self.model, outputs, inputs, label_names, ignore_keys)
        return super()._predictions_and_labels(outputs, inputs, ignore_keys)

    def _tuple_predictions(self, loss: Any, outputs: tuple | list, inputs: dict[str, Any],
                           prediction_loss_only: bool) -> tuple:
        """prediction_step's result for a model returning a tuple `(loss, logits, ...)` (or its outputs without
        the loss): predictions are what follows the loss, labels those of `args.label_names`."""
        predictions = tuple(outputs[1:] if loss is not None else outputs)
        if prediction_loss_only:
            return loss, None, None, {}
        names = getattr(self.args, "label_names", None) or ["labels"]
        label_values = tuple(inputs.get(n) for n in names) if self._has_labels(inputs) else None
        return (loss, predictions[0] if len(predictions) == 1 else predictions,
                label_values[0] if label_values is not None and len(label_values) == 1 else label_values, {})

    def _eval_counts(self, tally: Any, runtime: float) -> dict[str, Any]:
        """transformers' speed metrics (steps: batches of per_device_eval_batch_size x ranks), the core's sample
        count and skipped samples, and model_preparation_time where transformers reports it."""
        steps = math.ceil(tally.samples / (self.args.per_device_eval_batch_size * self.world_size))
        metrics = {"runtime": round(runtime, 4), "samples_per_second": round(tally.samples / max(runtime, 1e-9), 3),
                   "steps_per_second": round(steps / max(runtime, 1e-9), 3), **super()._eval_counts(tally, runtime)}
        if getattr(self, "_train_start", None) is None and not hasattr(self, "model_preparation_time"):
            self.model_preparation_time = 0.0  # (transformers reports it from an evaluation before training on)
        if hasattr(self, "model_preparation_time"):
            metrics["model_preparation_time"] = self.model_preparation_time
        return metrics
