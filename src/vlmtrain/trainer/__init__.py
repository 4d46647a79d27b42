"""The training engine: transformers' Trainer API in a small core."""

from ..errors import ConfigError
from .args import TrainingArguments
from .callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    EarlyStoppingCallback,
    ExportableState,
    TrainerCallback,
)
from .checkpoint import CheckpointError
from .state import EvalPrediction, PredictionOutput, TrainerControl, TrainerState, TrainOutput
from .trainer import Trainer, set_seed

__all__ = [
    "CallbackHandler", "CheckpointError", "ConfigError", "DefaultFlowCallback", "EarlyStoppingCallback",
    "EvalPrediction", "ExportableState", "PredictionOutput", "Trainer",
    "TrainerCallback", "TrainerControl", "TrainerState", "TrainOutput", "TrainingArguments", "set_seed",
]
