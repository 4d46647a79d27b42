"""transformers' stock EarlyStoppingCallback, which the loop never uses: ``vlmtrain.EarlyStoppingCallback``."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from ..trainer.callbacks import TrainerCallback
from .callback_states import ExportableState


class EarlyStoppingCallback(TrainerCallback, ExportableState):
    """Stops training when metric_for_best_model has not improved (by more than threshold) for
    `early_stopping_patience` evaluations, as transformers' EarlyStoppingCallback (its state is saved in
    checkpoints the same way)."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0) -> None:
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def check_metric_value(self, args, state, control, metric_value):  # noqa: ANN001, ANN201 - transformers' API
        better = np.greater if args.greater_is_better else np.less
        if state.best_metric is None or (better(metric_value, state.best_metric)
                                         and abs(metric_value - state.best_metric) > self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs TrainingArguments.metric_for_best_model to be set.")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs eval_strategy 'steps' or 'epoch'.")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None:
            warnings.warn(f"EarlyStoppingCallback: evaluation returned no {key!r}; early stopping skips this "
                          "evaluation.", stacklevel=2)
            return
        self.check_metric_value(args, state, control, value)
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict:
        return {"args": {"early_stopping_patience": self.early_stopping_patience,
                         "early_stopping_threshold": self.early_stopping_threshold},
                "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint of an earlier vlmtrain, which saved the counter alone."""
        self.early_stopping_patience_counter = state["early_stopping_patience_counter"]
