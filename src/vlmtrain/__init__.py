"""vlmtrain: train vision-language models (and plain LMs) with the Trainer API you know."""

from .trainer import (
    EarlyStoppingCallback,
    EvalPrediction,
    PredictionOutput,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    TrainOutput,
)

__version__ = "0.1.0"
__all__ = [
    "EarlyStoppingCallback", "EvalPrediction", "PredictionOutput", "Trainer", "TrainerCallback", "TrainerControl",
    "TrainerState", "TrainOutput", "TrainingArguments", "__version__",
]
