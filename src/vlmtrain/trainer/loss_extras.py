"""transformers' TrainingArguments options around the loss and the batch: label smoothing
(label_smoothing_factor), the input-token count (include_num_input_tokens_seen) and emptying the CUDA cache
(torch_empty_cache_steps). Each behaves as in transformers' Trainer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from . import distributed as dist


class LabelSmoothing:
    """The loss of a model called without its labels: transformers' LabelSmoother over the model's `logits`,
    shifted by one position for a causal LM (as transformers decides: the model class is one of its causal-LM
    classes), averaged over this micro-batch's labelled positions."""

    def __init__(self, epsilon: float, model: nn.Module) -> None:
        from transformers.trainer_pt_utils import LabelSmoother

        self.smoother = LabelSmoother(epsilon=epsilon)
        self.shift_labels = _is_causal_lm(model)

    def __call__(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, Mapping) and "logits" not in outputs:
            raise ValueError(f"label_smoothing_factor needs the model's logits, but its output has only "
                             f"{list(outputs.keys())}; set label_smoothing_factor=0 or return 'logits'.")
        return self.smoother(outputs, labels, shift_labels=self.shift_labels)


def _is_causal_lm(model: nn.Module) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    inner = model.base_model.model if hasattr(model, "peft_config") else model  # (a peft model: its base)
    return inner._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def input_tokens(batch: Mapping[str, Any], mode: str, main_input_name: str, pad_token_id: int | None) -> int:
    """Tokens of a micro-batch as transformers' include_num_input_tokens_seen counts them (this rank's): every
    element of the main input ('all'), or its non-padding ones ('non_padding': the attention mask's ones, else
    those that are not the pad token). 0 when the batch has no main input."""
    ids = batch.get(main_input_name)
    if not isinstance(ids, torch.Tensor):
        return 0
    if mode == "non_padding":
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        if pad_token_id is not None:
            return int((ids != pad_token_id).sum())
    return ids.numel()


def tokens_over_ranks(count: int) -> int:
    """A count summed over every rank (one small CPU all-reduce; the count itself without torch.distributed)."""
    return int(dist.reduce_cpu([float(count)])[0]) if dist.is_distributed() else count


def empty_device_cache() -> None:
    """Free CUDA's cached memory (accelerate's clear_device_cache, which transformers calls)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def batch_metrics(compute_metrics: Any, predictions: Any, label_ids: Any, rows_per_batch: int,
                  prediction_type: type) -> Any:
    """batch_eval_metrics: compute_metrics called once per evaluation batch (`rows_per_batch` rows of every rank,
    as transformers gathers them), on tensors, with compute_result=True on the last batch only; its last return
    is the result. (The batches are cut from the collected set, so evaluation memory is not lowered.)"""

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


def check_batch_metrics(compute_metrics: Any) -> None:
    """transformers' check: with batch_eval_metrics, compute_metrics must take compute_result."""
    import inspect

    if compute_metrics is not None and "compute_result" not in inspect.signature(compute_metrics).parameters:
        raise ValueError("When using `batch_eval_metrics`, your `compute_metrics` function must take a "
                         "`compute_result` boolean argument which will be triggered after the last batch of the eval "
                         "set to signal that the summary statistics should be returned by the function.")
