"""vlmtrain.Trainer's callback handler: the core's (vlmtrain/trainer/callbacks.py) with transformers' names
(``on_<event>(args, state, control[, metrics / logs])``, ``call_event``) and the warnings its handler gives (a
callback class added twice; no DefaultFlowCallback)."""

from __future__ import annotations

import warnings
from typing import Any

from ..trainer.callbacks import EVENTS, CallbackHandler, DefaultFlowCallback, TrainerCallback
from ..trainer.state import TrainerControl


class TransformersCallbackHandler(CallbackHandler):
    """CallbackHandler as transformers' (its positional ``(callbacks, model, processing_class, optimizer,
    lr_scheduler)`` too); its warnings are UserWarnings (transformers logs them as logger warnings)."""

    def __init__(self, callbacks: list, model: Any = None, processing_class: Any = None, optimizer: Any = None,
                 lr_scheduler: Any = None, **refs: Any) -> None:
        super().__init__(callbacks, model=model, processing_class=processing_class, optimizer=optimizer,
                         lr_scheduler=lr_scheduler, **refs)
        # (the warnings' texts are transformers', as they are: scripts may look for them)
        if not any(isinstance(cb, DefaultFlowCallback) for cb in self.callbacks):
            warnings.warn("The Trainer will not work properly if you don't have a `DefaultFlowCallback` in its "
                          "callbacks. You\nshould add one before training with `trainer.add_callback("
                          "DefaultFlowCallback). The current list ofcallbacks is\n:" + self.callback_list, stacklevel=2)

    def add_callback(self, callback: type | TrainerCallback) -> None:
        cls = callback if isinstance(callback, type) else type(callback)
        if cls in [type(cb) for cb in self.callbacks]:
            warnings.warn(f"You are adding a {cls} to the callbacks of this Trainer, but there is already one. The "
                          f"currentlist of callbacks is\n:{self.callback_list}", stacklevel=3)
        super().add_callback(callback)

    def call_event(self, event: str, args: Any, state: Any, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        """transformers' name for :meth:`call` (Trainer subclasses, e.g. TRL's, call it)."""
        return self.call(event, args, state, control, **kwargs)


def _ref(name: str) -> property:
    """transformers' handler attribute ``name`` (model, optimizer, train_dataloader, ...): the refs every event gets."""
    return property(lambda self: self.refs.get(name), lambda self, value: self.refs.__setitem__(name, value))


for _name in ("model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"):
    setattr(TransformersCallbackHandler, _name, _ref(_name))


def _handler_event(event: str, *payload: str) -> Any:
    """``CallbackHandler.on_<event>(args, state, control[, payload])`` as transformers' handler has them: the
    payload (metrics / logs) is passed by position there."""

    def method(self, args, state, control, *values, **kwargs):  # noqa: ANN001, ANN202 - transformers' signature
        kwargs.update(zip(payload, values))
        return self.call(event, args, state, control, **kwargs)

    method.__name__ = event
    return method


for _event in EVENTS:
    _payload = {"on_evaluate": ("metrics",), "on_predict": ("metrics",), "on_log": ("logs",)}.get(_event, ())
    setattr(TransformersCallbackHandler, _event, _handler_event(_event, *_payload))
