"""The training engine: transformers' Trainer API in a small core (:class:`TrainerCore`, with its
:class:`TrainingArgumentsCore`), which takes what the layers above it provide as its :class:`TrainerParts`.
``vlmtrain.Trainer`` is the core with transformers' counts, evaluation conventions, extra public methods and every
part set (vlmtrain/compat/trainer.py); ``vlmtrain.TrainingArguments`` and ``vlmtrain.EarlyStoppingCallback`` are
the compat layer's too. This package names none of them: it never imports the layers above it."""

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

_MODULES = {"args": "TrainingArgumentsCore", "checkpoint": "CheckpointError", "parts": "TrainerParts", "setup": "set_seed",
            "callbacks": "CallbackHandler DefaultFlowCallback TrainerCallback", "trainer": "TrainerCore",
            "state": "EvalLoopOutput EvalPrediction PredictionOutput TrainerControl TrainerState TrainOutput"}
_NAMES = {name: module for module, names in _MODULES.items() for name in names.split()}  # (imported on first use)
if TYPE_CHECKING:  # the same names, for type checkers and the API reference (mkdocstrings reads them statically)
    from .args import TrainingArgumentsCore
    from .callbacks import CallbackHandler, DefaultFlowCallback, TrainerCallback
    from .checkpoint import CheckpointError
    from .parts import TrainerParts
    from .setup import set_seed
    from .state import (
        EvalLoopOutput,
        EvalPrediction,
        PredictionOutput,
        TrainerControl,
        TrainerState,
        TrainOutput,
    )
    from .trainer import TrainerCore
__all__ = [
    "CallbackHandler", "CheckpointError", "ConfigError", "DefaultFlowCallback", "EvalLoopOutput", "EvalPrediction",
    "PredictionOutput", "TrainerCallback", "TrainerControl", "TrainerCore", "TrainerParts",
    "TrainerState", "TrainOutput", "TrainingArgumentsCore", "set_seed",
]


def __getattr__(name: str) -> Any:
    """The package's names, imported on first use (`vlmtrain train --help` reads the arguments without torch); an
    AttributeError that says where the public classes this package once named live."""
    if name in _NAMES:
        return globals().setdefault(name, getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name))
    if name in ("Trainer", "TrainingArguments", "EarlyStoppingCallback"):
        raise AttributeError(f"vlmtrain.trainer has no {name}: it is vlmtrain.{name} (`from vlmtrain import {name}`); "
                             f"vlmtrain.trainer holds the core (TrainerCore, TrainingArgumentsCore, TrainerParts).")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
