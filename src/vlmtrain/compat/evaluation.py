"""What evaluation and predict report as transformers' Trainer reports them, for scripts written for it: the
speed metrics of an evaluation (`<prefix>_runtime`, `_samples_per_second`, `_steps_per_second`,
`_model_preparation_time`), the predictions and labels of a model that returns a tuple `(loss, logits, ...)`,
and those of a batch when `args.label_names` is set. A mixin of :class:`vlmtrain.Trainer`
(vlmtrain/compat/trainer.py) that fills the evaluation hooks of the trainer core (vlmtrain/trainer/evaluation.py),
whose plain defaults report none of this."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import find_labels

from ..trainer.state import StepOutput


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


def default_label_names(model: Any) -> list[str] | None:
    """transformers' default `label_names` for a transformers model whose labels are not just `labels` (question
    answering: `start_positions`, `end_positions`), else None (the core's convention)."""
    if not isinstance(model, PreTrainedModel):
        return None
    names = find_labels(type(model))
    return names if names and names != ["labels"] else None


class TransformersEvaluation:
    """TrainerCore's evaluation hooks with transformers' conventions, over its attributes (args, model,
    world_size)."""

    def _label_names(self) -> list[str] | None:
        """`args.label_names`, else transformers' default for the model (:func:`default_label_names`)."""
        return getattr(self.args, "label_names", None) or default_label_names(self.model)

    def _has_labels(self, inputs: Mapping[str, Any]) -> bool:
        """Whether the batch holds every label (``args.label_names``, default ``labels``): then evaluation takes the
        loss from compute_loss, as transformers' prediction_step does."""
        names = self._label_names() or ["labels"]
        return all(inputs.get(name) is not None for name in names)

    def _predictions_and_labels(self, outputs: Any, inputs: dict[str, Any],
                                ignore_keys: list[str] | None) -> tuple[Any, Any]:
        """With label names (`args.label_names`, or a question-answering model's), transformers' convention
        (:func:`outputs_by_label_names`); else the core's (score heads' outputs, or the logits)."""
        label_names = self._label_names()
        if label_names and isinstance(outputs, Mapping):
            return outputs_by_label_names(self.model, outputs, inputs, label_names, ignore_keys)
        return super()._predictions_and_labels(outputs, inputs, ignore_keys)

    def _tuple_predictions(self, loss: Any, outputs: tuple | list, inputs: dict[str, Any],
                           prediction_loss_only: bool) -> tuple:
        """prediction_step's result for a model returning a tuple `(loss, logits, ...)` (or its outputs without
        the loss): predictions are what follows the loss, labels those of `args.label_names`."""
        predictions = tuple(outputs[1:] if loss is not None else outputs)
        if prediction_loss_only:
            return StepOutput(loss, None, None)
        names = self._label_names() or ["labels"]
        label_values = tuple(inputs.get(n) for n in names) if self._has_labels(inputs) else None
        return StepOutput(loss, predictions[0] if len(predictions) == 1 else predictions,
                          label_values[0] if label_values is not None and len(label_values) == 1 else label_values)

    def _evaluate_metrics(self, output: Any, metric_key_prefix: str, start: float) -> dict[str, float]:
        """transformers' speed metrics of evaluate() and predict(), from ``start`` to now over the loop's
        num_samples (steps: batches of per_device_eval_batch_size x ranks), then the core's sample count."""
        counts = super()._evaluate_metrics(output, metric_key_prefix, start)
        samples = counts.get(f"{metric_key_prefix}_samples")
        if samples is None:
            return counts
        runtime = time.time() - start
        steps = math.ceil(samples / (self.args.per_device_eval_batch_size * self.world_size))
        return {f"{metric_key_prefix}_runtime": round(runtime, 4),
                f"{metric_key_prefix}_samples_per_second": round(samples / max(runtime, 1e-9), 3),
                f"{metric_key_prefix}_steps_per_second": round(steps / max(runtime, 1e-9), 3), **counts}

    def _eval_counts(self, tally: Any) -> dict[str, Any]:
        """The core's sample count and skipped samples, and model_preparation_time where transformers reports it
        (evaluation_loop's metrics, as transformers'; the speed metrics come from evaluate() and predict())."""
        metrics = super()._eval_counts(tally)
        if getattr(self, "_train_start", None) is None and not hasattr(self, "model_preparation_time"):
            self.model_preparation_time = 0.0  # (transformers reports it from an evaluation before training on)
        if hasattr(self, "model_preparation_time"):
            metrics["model_preparation_time"] = self.model_preparation_time
        return metrics
