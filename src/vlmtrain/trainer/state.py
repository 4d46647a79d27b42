"""TrainerState, TrainerControl and the small result types, with transformers' names."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass
class TrainerState:
    """Counters and history of a run; saved as `trainer_state.json` in every checkpoint."""

    epoch: float = 0.0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)

    def save_to_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dataclasses.asdict(self), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load_from_json(cls, path: str) -> TrainerState:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the Trainer honours and resets them."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False

    def state(self) -> dict:
        """Saved in checkpoints (``stateful_callbacks``) as transformers' TrainerControl saves itself."""
        return {"args": dataclasses.asdict(self), "attributes": {}}


class TrainOutput(NamedTuple):
    global_step: int
    training_loss: float
    metrics: dict[str, float]


class EvalPrediction(NamedTuple):
    """What compute_metrics gets: one array each, or tuples when the model returned several outputs (score
    heads, or `args.label_names`: label_ids in that order)."""

    predictions: np.ndarray | tuple[np.ndarray, ...] | None
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    inputs: np.ndarray | None = None


class PredictionOutput(NamedTuple):
    predictions: np.ndarray | tuple[np.ndarray, ...] | None
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    metrics: dict[str, float]
    texts: list[str] | None = None
    """Decoded generations when predict_with_generate is on and a tokenizer is known."""
    heads: dict[str, np.ndarray] | None = None
    """Score-head outputs (`logits_<name>`) by head name, one row per sample, when the model has heads."""
