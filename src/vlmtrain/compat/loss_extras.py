"""transformers' TrainingArguments options around the loss and evaluation's metrics: label smoothing
(label_smoothing_factor) and compute_metrics batch by batch (batch_eval_metrics), each as in transformers'
Trainer. They reach the trainer as vlmtrain.Trainer's ``label_smoothing`` and ``batch_eval_metrics`` parts
(trainer/parts.py)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..models.families import REGISTRY as FAMILIES
from ..models.objectives.heads import WithHeads
from ..models.own_vlm.vlm import VLMConfig


class LabelSmoothing:
    """The loss of a model called without its labels: transformers' LabelSmoother over the model's `logits`,
    shifted by one position for a causal model (as transformers decides, and for every causal model vlmtrain
    trains: :func:`_is_causal_lm`), averaged over this micro-batch's labelled positions."""

    def __init__(self, epsilon: float, model: nn.Module) -> None:
        from transformers.trainer_pt_utils import LabelSmoother

        if any(isinstance(m, WithHeads) for m in model.modules()):
            raise ConfigError(f"label_smoothing_factor={epsilon} with score heads: the smoothed loss of the LM "
                              f"logits would replace the model's loss and drop its heads' losses. Set "
                              f"label_smoothing_factor=0 for a model with heads.")
        self.smoother = LabelSmoother(epsilon=epsilon)
        self.shift_labels = _is_causal_lm(model)

    def __call__(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, Mapping) and "logits" not in outputs:
            raise ValueError(f"label_smoothing_factor needs the model's logits, but its output has only "
                             f"{list(outputs.keys())}; set label_smoothing_factor=0 or return 'logits'.")
        return self.smoother(outputs, labels, shift_labels=self.shift_labels)


def label_smoothing(epsilon: float, model: nn.Module) -> LabelSmoothing | None:
    """label_smoothing_factor's loss for ``model``; None (off, with transformers' warning) for a model configured
    for multi-label classification, which transformers does not smooth."""
    if getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification":
        warnings.warn("Label smoothing is not compatible with multi-label classification. Disabling label smoothing "
                      "for this training run.", UserWarning, stacklevel=3)
        return None
    return LabelSmoothing(epsilon, model)


def _is_causal_lm(model: nn.Module) -> bool:
    """Whether the logits at position t predict the label at t + 1: transformers' rule (the model class is one of
    its causal-LM classes), and every causal model vlmtrain trains that transformers' mapping leaves out: the own
    VLM and each Hub VLM family (Qwen-VL, Idefics3 / SmolVLM, LLaVA-OneVision: image-text-to-text classes,
    whose unshifted smoothing would train each position on its own token)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = model.base_model.model if hasattr(model, "peft_config") else model  # (a peft model: its base)
    if inner._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return True
    return getattr(getattr(inner, "config", None), "model_type", None) in (VLMConfig.model_type, *FAMILIES)


class BatchEvalMetrics:
    """batch_eval_metrics: transformers' check of compute_metrics when the Trainer is built, and compute_metrics
    called batch by batch when evaluation ends."""

    @staticmethod
    def check(compute_metrics: Any) -> None:
        """transformers' check: with batch_eval_metrics, compute_metrics must take compute_result."""
        if compute_metrics is not None and "compute_result" not in inspect.signature(compute_metrics).parameters:
            raise ValueError("When using `batch_eval_metrics`, your `compute_metrics` function must take a "
                             "`compute_result` boolean argument which will be triggered after the last batch of the "
                             "eval set to signal that the summary statistics should be returned by the function.")

    @staticmethod
    def compute(compute_metrics: Any, predictions: Any, label_ids: Any, rows_per_batch: int,
                prediction_type: type) -> Any:
        """compute_metrics called once per evaluation batch (`rows_per_batch` rows of every rank, as transformers
        gathers them), on tensors, with compute_result=True on the last batch only; its last return is the
        result. (The batches are cut from the collected set, so evaluation memory is not lowered.)"""

        def rows(value: Any, start: int) -> Any:
            if value is None:
                return None
            if isinstance(value, tuple):
                return tuple(rows(v, start) for v in value)
            return torch.as_tensor(value[start:start + rows_per_batch])

        first = predictions[0] if isinstance(predictions, tuple) else predictions
        total, result = len(first), None
        for start in range(0, total, rows_per_batch):
            result = compute_metrics(prediction_type(rows(predictions, start), rows(label_ids, start)),
                                     compute_result=start + rows_per_batch >= total)
        return result
