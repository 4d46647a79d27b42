"""TrainerState, TrainerControl and the small result types, with transformers' names."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
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


class EvalPrediction:
    """What compute_metrics gets, as transformers' EvalPrediction: `predictions` and `label_ids` (one array
    each, or tuples when the model returned several outputs: score heads, or `args.label_names`), and `inputs` /
    `losses` when set. It unpacks and indexes as the tuple of those that are set (`preds, labels = eval_pred`)."""

    def __init__(self, predictions: Any, label_ids: Any, inputs: Any = None, losses: Any = None) -> None:
        self.predictions, self.label_ids, self.inputs, self.losses = predictions, label_ids, inputs, losses
        self.elements = (predictions, label_ids) + tuple(x for x in (inputs, losses) if x is not None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.elements)

    def __getitem__(self, idx: int) -> Any:
        if idx < 0 or idx >= len(self.elements):  # (as transformers': no negative indexes)
            raise IndexError("tuple index out of range")
        return self.elements[idx]


class _Extras:
    """vlmtrain's additions to a result tuple, as attributes beside transformers' fields (which alone are
    unpacked, counted, indexed and listed by `_fields` / `_asdict`), kept by copies, pickles and `_replace`:
    `texts`, decoded generations (predict_with_generate with a tokenizer), and `heads`, score-head outputs
    (`logits_<name>`) by head name, one row per sample."""

    texts: list[str] | None = None
    heads: dict[str, np.ndarray] | None = None

    def _with_extras(self, texts: list[str] | None, heads: dict[str, np.ndarray] | None) -> Any:
        self.texts, self.heads = texts, heads
        return self

    def _replace(self, **fields: Any) -> Any:
        return super()._replace(**fields)._with_extras(self.texts, self.heads)


class _PredictionFields(NamedTuple):
    predictions: np.ndarray | tuple[np.ndarray, ...] | None
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    metrics: dict[str, float] | None


class PredictionOutput(_Extras, _PredictionFields):
    """predict()'s result, as transformers': `predictions, label_ids, metrics = trainer.predict(ds)`; vlmtrain's
    `texts` (generations) and `heads` (score-head outputs) are attributes."""

    def __new__(cls, predictions: Any, label_ids: Any, metrics: dict[str, float] | None,
                texts: list[str] | None = None, heads: dict[str, np.ndarray] | None = None) -> PredictionOutput:
        return super().__new__(cls, predictions, label_ids, metrics)._with_extras(texts, heads)


class _EvalLoopFields(NamedTuple):
    predictions: np.ndarray | tuple[np.ndarray, ...] | None
    label_ids: np.ndarray | tuple[np.ndarray, ...] | None
    metrics: dict[str, float] | None
    num_samples: int | None


class EvalLoopOutput(_Extras, _EvalLoopFields):
    """evaluation_loop()'s result, as transformers': predictions, label_ids, metrics and num_samples (the samples
    evaluated); vlmtrain's `texts` and `heads` are attributes, as in PredictionOutput."""

    def __new__(cls, predictions: Any, label_ids: Any, metrics: dict[str, float] | None, num_samples: int | None,
                texts: list[str] | None = None, heads: dict[str, np.ndarray] | None = None) -> EvalLoopOutput:
        return super().__new__(cls, predictions, label_ids, metrics, num_samples)._with_extras(texts, heads)


class StepOutput(tuple):
    """prediction_step's result, transformers' `(loss, predictions, labels)`; `extras` holds vlmtrain's `loss_*`
    and item counts of the batch (`num_items`, `num_items_<name>`), by which evaluation weights the losses."""

    def __new__(cls, loss: Any, predictions: Any, labels: Any, extras: dict[str, Any] | None = None) -> StepOutput:
        self = super().__new__(cls, (loss, predictions, labels))
        self.extras = extras or {}
        return self
