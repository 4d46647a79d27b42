"""The training engine: transformers' Trainer API in a small core (:class:`TrainerCore`). ``Trainer`` here is
``vlmtrain.Trainer``, the core with transformers' counts, evaluation conventions and extra public methods,
which ``import vlmtrain`` registers in the ``trainer_class`` slot (the compat layer above defines it,
TrainingArguments, the core's TrainingArgumentsCore with transformers' other names, and EarlyStoppingCallback)."""

from typing import Any

from ..errors import ConfigError
from . import plugins
from .args import TrainingArgumentsCore
from .callbacks import CallbackHandler, DefaultFlowCallback, ExportableState, TrainerCallback
from .checkpoint import CheckpointError
from .setup import set_seed
from .state import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainerControl, TrainerState, TrainOutput
from .trainer import TrainerCore

__all__ = [
    "CallbackHandler", "CheckpointError", "ConfigError", "DefaultFlowCallback", "EarlyStoppingCallback",
    "EvalLoopOutput", "EvalPrediction", "ExportableState", "PredictionOutput", "Trainer", "TrainerCallback", "TrainerCore",
    "TrainerControl", "TrainerState", "TrainOutput", "TrainingArguments", "TrainingArgumentsCore", "set_seed",
]


# the public names the compat layer above defines: name -> the slot that holds it
_FROM_SLOTS = {"Trainer": "trainer_class", "TrainingArguments": "arguments_class",
               "EarlyStoppingCallback": "early_stopping_callback"}


def __getattr__(name: str) -> Any:
    """The public classes of _FROM_SLOTS, from their slots (PEP 562: looked up on each access)."""
    if name in _FROM_SLOTS:
        return plugins.require(_FROM_SLOTS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
