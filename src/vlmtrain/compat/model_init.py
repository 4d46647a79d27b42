"""transformers' ``Trainer(model_init=...)``: the model comes from ``model_init()`` (called with the trial if it
takes one argument), and every train() starts from a new one, seeded by args.seed, with a new optimizer and
scheduler; with the checks transformers makes of the model and optimizer arguments in its constructor. A mixin of
:class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py): the trainer core takes a model only."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..trainer.setup import set_seed


class TransformersModelInit:
    """``model_init`` and ``call_model_init`` as in transformers' Trainer."""

    model_init: Callable[..., nn.Module] | None = None
    args: Any
    model: nn.Module
    optimizer: Any
    lr_scheduler: Any
    callback_handler: Any

    def _resolve_model(self, model: nn.Module | None, model_init: Callable[..., nn.Module] | None,
                       compute_loss_func: Callable[..., Any] | None, optimizers: tuple[Any, Any],
                       optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None) -> nn.Module:
        """The model to train: ``model``, or ``model_init()`` (transformers: exactly one of them), with
        ``optimizer_cls_and_kwargs`` checked against ``optimizers`` as transformers checks them."""
        self.model_init = model_init
        if model is None and model_init is None:
            raise RuntimeError("Trainer needs a model: Trainer(model=..., args=...) or Trainer(model_init=...).")
        if model is not None and model_init is not None:
            raise ValueError("Trainer takes either a `model` or a `model_init`, not both.")
        self._check_optimizer_arguments(optimizers, optimizer_cls_and_kwargs)
        model = model if model is not None else self.call_model_init()
        return super()._resolve_model(model, None, compute_loss_func,  # type: ignore[misc]
                                      optimizers, optimizer_cls_and_kwargs)

    def _check_optimizer_arguments(self, optimizers: tuple[Any, Any], optimizer_cls_and_kwargs: Any) -> None:
        if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
            raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` is incompatible: pass one.")
        if self.model_init is not None and (optimizers[0] is not None or optimizers[1] is not None):
            raise RuntimeError("Passing a `model_init` is incompatible with the `optimizers` argument (each train() "
                               "builds a new model): subclass Trainer and override create_optimizer_and_scheduler.")

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A fresh model from ``model_init`` (called with ``trial`` if it takes one argument)."""
        count = len(inspect.signature(self.model_init).parameters)
        if count > 1:
            raise RuntimeError("model_init should have 0 or 1 argument.")
        model = self.model_init(trial) if count == 1 else self.model_init()
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    def _reinit_model(self, trial: Any = None) -> None:
        """With ``model_init``, every train() starts from a new model (seeded by args.seed), optimizer and
        scheduler, as in transformers."""
        super()._reinit_model(trial)  # type: ignore[misc]
        if self.model_init is None:
            return
        set_seed(self.args.seed)
        self.model = self._prepare_model(self.call_model_init())  # type: ignore[attr-defined]
        self.optimizer = self.lr_scheduler = self._flos_params = None
        self.callback_handler.refs["model"] = self.model
        self._forward_takes_use_cache = "use_cache" in inspect.signature(self.model.forward).parameters
