"""vlmtrain: train vision-language models (and plain LMs) with the Trainer API you know."""

from . import tasks  # noqa: F401 - the synthetic tasks register their data sources with data/
from .inference import InferenceModel, load_for_inference
from .models.head_files import attach_heads
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
    "EarlyStoppingCallback", "EvalPrediction", "InferenceModel", "PredictionOutput", "Trainer", "TrainerCallback",
    "TrainerControl", "TrainerState", "TrainOutput", "TrainingArguments", "__version__", "attach_heads",
    "load_for_inference",
]
