"""The training engine: transformers' Trainer API in a small core (:class:`TrainerCore`). ``Trainer`` here is
``vlmtrain.Trainer``, the core with transformers' extra public methods, which ``import vlmtrain`` registers in
the ``trainer_class`` slot (the compat layer above defines it)."""

from typing import Any

from ..errors import ConfigError
from . import plugins
from .args import TrainingArguments
from .callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    TrainerCallback,
)
from .checkpoint import CheckpointError
from .setup import set_seed
from .state import EvalPrediction, PredictionOutput, TrainerControl, TrainerState, TrainOutput
from .trainer import TrainerCore

__all__ = [
    "CallbackHandler", "CheckpointError", "ConfigError", "DefaultFlowCallback", "EarlyStoppingCallback",
    "EvalPrediction", "ExportableState", "PredictionOutput", "Trainer", "TrainerCallback", "TrainerCore",
    "TrainerControl", "TrainerState", "TrainOutput", "TrainingArguments", "set_seed",
]


def __getattr__(name: str) -> Any:
    """``Trainer``: the public class from the ``trainer_class`` slot (PEP 562: looked up on each access)."""
    if name == "Trainer":
        return plugins.require("trainer_class")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
