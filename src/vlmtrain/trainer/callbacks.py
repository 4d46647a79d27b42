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


class ExportableState:
    """transformers' protocol for a callback whose state is saved in checkpoints (``trainer_state.json``'s
    ``stateful_callbacks``): ``state()`` returns ``{"args": constructor kwargs, "attributes": {name: value}}``;
    on resume the callback is rebuilt with those args and attributes. transformers' own ExportableState
    subclasses work the same (any callback with a ``state()`` method is saved)."""

    def state(self) -> dict:
        raise NotImplementedError("An ExportableState callback implements state() -> {'args': ..., 'attributes': ...}.")

    @classmethod
    def from_state(cls, state: dict) -> Any:
        instance = cls(**state["args"])
        for key, value in state["attributes"].items():
            setattr(instance, key, value)
        return instance


def _exports(obj: Any) -> bool:
    return callable(getattr(obj, "state", None))


def callback_states(callbacks: list, control: TrainerControl) -> dict[str, Any]:
    """``stateful_callbacks`` of trainer_state.json: transformers' ``{class name: state()}`` (a list for several
    instances of a class) for every ExportableState callback and the TrainerControl, and vlmtrain's
    ``state_dict()`` for callbacks that have that instead."""
    states: dict[str, Any] = {}
    for cb in [*callbacks, control]:
        name = type(cb).__name__
        if _exports(cb):
            value = cb.state()
            if name in states:
                states[name] = [*(states[name] if isinstance(states[name], list) else [states[name]]), value]
            else:
                states[name] = value
        elif hasattr(cb, "state_dict"):
            states[name] = cb.state_dict()
    return states


def restore_callback_states(callbacks: list, control: TrainerControl, states: dict[str, Any]) -> None:
    """Put the saved ``states`` (see :func:`callback_states`) back into the running callbacks and ``control``, in
    place: an ExportableState one becomes what ``type(cb)(**args)`` with the saved attributes is (as transformers
    rebuilds it; the object the script holds is the one updated), a state_dict one gets ``load_state_dict``."""
    by_name: dict[str, list] = {}
    for cb in [*callbacks, control]:
        by_name.setdefault(type(cb).__name__, []).append(cb)
    for name, saved in states.items():
        saved_list = saved if isinstance(saved, list) else [saved]
        for cb, data in zip(by_name.get(name, []), saved_list):
            if isinstance(data, dict) and set(data) == {"args", "attributes"} and _exports(cb):
                rebuilt = type(cb)(**data["args"])
                for key, value in data["attributes"].items():
                    setattr(rebuilt, key, value)
                cb.__dict__.update(rebuilt.__dict__)
            elif hasattr(cb, "load_state_dict"):  # (also an ExportableState one given an older form of its state)
                cb.load_state_dict(data)


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
