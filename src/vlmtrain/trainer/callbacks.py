"""Callbacks with transformers' events and arguments, the handler that calls them, and the stock one that steers
the loop (the progress bar and the log writers are vlmtrain.logging's, EarlyStoppingCallback vlmtrain.compat's)."""

from __future__ import annotations

from typing import Any, NamedTuple

from .args import TrainingArgumentsCore
from .state import TrainerControl, TrainerState

EVENTS = (
    "on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
    "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_evaluate",
    "on_predict", "on_save", "on_log", "on_prediction_step", "on_push_begin",
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


class LoggingCallbacks(NamedTuple):
    """What a Trainer logs through (its ``logging_callbacks`` part), placed as transformers places its own:
    ``integrations`` (report_to's trackers) listed after DefaultFlowCallback, ``progress`` (bar or printer) after
    the user's callbacks; ``writers`` (metrics.jsonl) are not listed, but called first on every event."""

    integrations: tuple = ()
    progress: tuple = ()
    writers: tuple = ()


class CallbackHandler:
    """Holds the callbacks and calls one event on all of them, in order (vlmtrain.Trainer's adds transformers'
    on_<event> / call_event methods and warnings: vlmtrain/compat/callback_handler.py). ``writers`` are called
    before them and not listed in ``callbacks``, which holds what transformers' handler holds."""

    def __init__(self, callbacks: list, **refs: Any) -> None:
        self.callbacks: list[TrainerCallback] = []
        self.writers: list[TrainerCallback] = []
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
    def every_callback(self) -> list[TrainerCallback]:
        """The writers, then the listed callbacks: all that get events and save their state in checkpoints."""
        return [*self.writers, *self.callbacks]

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def call(self, event: str, args: TrainingArgumentsCore, state: TrainerState, control: TrainerControl,
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
        for cb in self.every_callback:
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
