"""vlmtrain: train vision-language models (and plain LMs) with the Trainer API you know."""

from . import tasks  # noqa: F401 - the synthetic tasks' data sources, by their config `kind:` names
from .compat.arguments import TrainingArguments
from .compat.callbacks import EarlyStoppingCallback
from .compat.dpo import DPOConfig, DPOTrainer
from .compat.grpo import GRPOTrainer
from .compat.grpo_config import GRPOConfig
from .compat.reward import RewardConfig, RewardTrainer
from .compat.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
from .compat.trainer import Trainer
from .inference import InferenceModel, load_for_inference
from .models.head_files import attach_heads
from .trainer import (
    EvalPrediction,
    PredictionOutput,
    TrainerCallback,
    TrainerControl,
    TrainerParts,
    TrainerState,
    TrainOutput,
)

__version__ = "0.1.0"
__all__ = [
    "DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "EarlyStoppingCallback", "EvalPrediction", "InferenceModel", "PredictionOutput", "Trainer", "TrainerCallback",
    "TrainerControl", "TrainerParts", "TrainerState", "TrainOutput", "TrainingArguments", "__version__", "attach_heads",
    "load_for_inference", "Seq2SeqTrainer", "Seq2SeqTrainingArguments",
    "RewardConfig", "RewardTrainer",
]
