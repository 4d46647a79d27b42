"""transformers' stateful callbacks: a callback's state saved in each checkpoint's ``trainer_state.json``
(``stateful_callbacks``) and put back at resume. vlmtrain.Trainer's (a mixin, :class:`StatefulCallbacks`, behind
the trainer core's checkpoint hooks ``_checkpoint_files`` and ``_load_callback_state``); the core alone saves no
callback state."""

from __future__ import annotations

from typing import Any


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


def callback_states(callbacks: list, control: Any) -> dict[str, Any]:
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


def restore_callback_states(callbacks: list, control: Any, states: dict[str, Any]) -> None:
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


class StatefulCallbacks:
    """vlmtrain.Trainer's callback states in checkpoints: taken as a checkpoint's files are (every save path,
    FSDP and background writes too), put back as its state is resumed."""

    callback_handler: Any
    control: Any
    state: Any

    def _checkpoint_files(self, sharded: bool) -> dict[str, Any]:
        self.state.stateful_callbacks = callback_states(self.callback_handler.every_callback, self.control)
        return super()._checkpoint_files(sharded)  # type: ignore[misc]

    def _load_callback_state(self) -> None:
        """(transformers' name) The checkpoint's stateful_callbacks, now self.state's, into the running callbacks."""
        restore_callback_states(self.callback_handler.every_callback, self.control, self.state.stateful_callbacks)
