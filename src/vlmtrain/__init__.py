"""vlmtrain: train vision-language models (and plain LMs) with the Trainer API you know."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import tasks  # noqa: F401 - the synthetic tasks' data sources, by their config `kind:` names (light)

__version__ = "0.1.0"
# Public names -> the module that defines them, imported on first use: `vlmtrain --help` and a mistyped option
# answer without importing torch, transformers or peft.
_EXPORTS = {
    "TrainingArguments": "vlmtrain.compat.arguments", "EarlyStoppingCallback": "vlmtrain.compat.callbacks",
    "DPOConfig": "vlmtrain.compat.dpo", "DPOTrainer": "vlmtrain.compat.dpo",
    "GRPOConfig": "vlmtrain.compat.grpo_config", "GRPOTrainer": "vlmtrain.compat.grpo", "RewardConfig": "vlmtrain.compat.reward",
    "RewardTrainer": "vlmtrain.compat.reward", "Seq2SeqTrainer": "vlmtrain.compat.seq2seq", "Seq2SeqTrainingArguments": "vlmtrain.compat.seq2seq",
    "Trainer": "vlmtrain.compat.trainer", "InferenceModel": "vlmtrain.inference", "load_for_inference": "vlmtrain.inference",
    "attach_heads": "vlmtrain.models.files.head_files", "EvalPrediction": "vlmtrain.trainer", "PredictionOutput": "vlmtrain.trainer",
    "TrainerCallback": "vlmtrain.trainer", "TrainerControl": "vlmtrain.trainer", "TrainerParts": "vlmtrain.trainer", "TrainerState": "vlmtrain.trainer",
    "TrainOutput": "vlmtrain.trainer",
}
__all__ = [
    "DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "EarlyStoppingCallback", "EvalPrediction", "InferenceModel", "PredictionOutput", "Trainer",
    "TrainerCallback", "TrainerControl", "TrainerParts", "TrainerState", "TrainOutput", "TrainingArguments", "__version__",
    "attach_heads", "load_for_inference", "Seq2SeqTrainer", "Seq2SeqTrainingArguments", "RewardConfig", "RewardTrainer",
]
if TYPE_CHECKING:  # the same names, for type checkers and the API reference (mkdocstrings reads them statically)
    from .compat.arguments import TrainingArguments
    from .compat.callbacks import EarlyStoppingCallback
    from .compat.dpo import DPOConfig, DPOTrainer
    from .compat.grpo import GRPOTrainer
    from .compat.grpo_config import GRPOConfig
    from .compat.reward import RewardConfig, RewardTrainer
    from .compat.seq2seq import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from .compat.trainer import Trainer
    from .inference import InferenceModel, load_for_inference
    from .models.files.head_files import attach_heads
    from .trainer import (
        EvalPrediction,
        PredictionOutput,
        TrainerCallback,
        TrainerControl,
        TrainerParts,
        TrainerState,
        TrainOutput,
    )


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        try:  # a subpackage or module (vlmtrain.trainer, ...), as when this file imported them all
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # a module it imports is missing: that error, as it is
                raise
            raise AttributeError(f"module 'vlmtrain' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
