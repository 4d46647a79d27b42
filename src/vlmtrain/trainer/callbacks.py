"""Callbacks with transformers' events and arguments, the handler that calls them, and the stock ones."""

from __future__ import annotations

import math
from typing import Any

from tqdm.auto import tqdm

from .args import TrainingArguments
from .state import TrainerControl, TrainerState

EVENTS = (
    "on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
    "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_evaluate",
    "on_predict", "on_save", "on_log", "on_prediction_step",
)


class TrainerCallback:
    """Base class: override any event. Each gets `(args, state, control, **kwargs)` where kwargs hold
    model, processing_class, optimizer, lr_scheduler, train_dataloader, eval_dataloader (and metrics/logs
    for on_evaluate/on_predict/on_log). Set `control.should_*` to steer the loop. Callbacks that keep
    state implement state_dict()/load_state_dict(); it is saved with each checkpoint."""


def _noop(self, args, state, control, **kwargs):  # noqa: ANN001 - shared default for every event
    return None


for _event in EVENTS:
    setattr(TrainerCallback, _event, _noop)


class CallbackHandler:
    """Holds the callbacks and calls one event on all of them, in order."""

    def __init__(self, callbacks: list, **refs: Any) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks:
            self.add_callback(cb)
        # model, processing_class, optimizer, lr_scheduler, dataloaders; like transformers, every event gets the
        # dataloader keys (None until there is one).
        self.refs = {"train_dataloader": None, "eval_dataloader": None, **refs}

    def add_callback(self, callback: type | TrainerCallback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop_callback(self, callback: type | TrainerCallback) -> TrainerCallback | None:
        for cb in self.callbacks:
            if (isinstance(callback, type) and isinstance(cb, callback)) or cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback: type | TrainerCallback) -> None:
        self.pop_callback(callback)

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def call(self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl,
             **kwargs: Any) -> TrainerControl:
        # transformers resets these flags as the matching event starts.
        if event == "on_train_begin":
            control._new_training()
        elif event == "on_epoch_begin":
            control._new_epoch()
        elif event == "on_step_begin":
            control._new_step()
        elif event == "on_evaluate":
            control.should_evaluate = False
        elif event == "on_save":
            control.should_save = False
        elif event == "on_log":
            control.should_log = False
        for cb in self.callbacks:
            result = getattr(cb, event)(args, state, control, **self.refs, **kwargs)
            if result is not None:
                control = result
        return control


class DefaultFlowCallback(TrainerCallback):
    """Decides when to log, evaluate, save and stop, exactly as transformers' DefaultFlowCallback."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and state.global_step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and state.global_step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.global_step % state.save_steps == 0:
            control.should_save = True
        if state.global_step >= state.max_steps:
            control.should_training_stop = True
            if args.eval_strategy == "steps" and state.global_step % state.eval_steps != 0:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch":
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


def _fmt(v: Any) -> Any:
    return f"{v:.4g}" if isinstance(v, float) else v


class ProgressCallback(TrainerCallback):
    """tqdm bars for training (with loss and learning rate) and evaluation; log lines above the bar."""

    def __init__(self) -> None:
        self.train_bar = None
        self.eval_bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.train_bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.train_bar is not None:
            self.train_bar.update(state.global_step - self.train_bar.n)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.eval_bar is None:
            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            if args.max_eval_batches is not None and total is not None:
                total = min(total, args.max_eval_batches)
            self.eval_bar = tqdm(total=total, desc="eval", leave=self.train_bar is None, dynamic_ncols=True)
        self.eval_bar.update(1)

    def _close_eval(self) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_eval()

    def on_predict(self, args, state, control, **kwargs):
        self._close_eval()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.train_bar is not None and "loss" in logs:
            self.train_bar.set_postfix(loss=_fmt(logs["loss"]), lr=f"{logs.get('learning_rate', 0):.3g}")
        shown = {k: _fmt(v) for k, v in logs.items() if k not in ("step", "epoch")}
        tqdm.write(f"[step {state.global_step}] " + " ".join(f"{k}={v}" for k, v in shown.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.train_bar is not None:
            self.train_bar.close()
            self.train_bar = None


class PrinterCallback(TrainerCallback):
    """Prints every log (used instead of the progress bar when disable_tqdm=True)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print({k: _fmt(v) for k, v in logs.items()}, flush=True)


class EarlyStoppingCallback(TrainerCallback):
    """Stops training when metric_for_best_model has not improved (by more than threshold) for
    `early_stopping_patience` evaluations."""

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float = 0.0) -> None:
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold
        self.early_stopping_patience_counter = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if args.metric_for_best_model is None:
            raise ValueError("EarlyStoppingCallback needs TrainingArguments.metric_for_best_model to be set.")
        if args.eval_strategy == "no":
            raise ValueError("EarlyStoppingCallback needs eval_strategy 'steps' or 'epoch'.")

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        name = args.metric_for_best_model
        key = name if name.startswith("eval_") else f"eval_{name}"
        value = (metrics or {}).get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return
        better = (lambda a, b: a > b) if args.greater_is_better else (lambda a, b: a < b)
        best = state.best_metric
        if best is None or (better(value, best) and abs(value - best) > self.early_stopping_threshold):
            self.early_stopping_patience_counter = 0
        else:
            self.early_stopping_patience_counter += 1
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state_dict(self) -> dict:
        return {"early_stopping_patience_counter": self.early_stopping_patience_counter}

    def load_state_dict(self, state: dict) -> None:
        self.early_stopping_patience_counter = state["early_stopping_patience_counter"]

