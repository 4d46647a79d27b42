"""A run_*.py-style script, as transformers' examples are written: HfArgumentParser for the arguments, then
Trainer.train / evaluate / predict with log_metrics, save_metrics and save_state. Written for transformers'
Trainer; the one vlmtrain line is the import below (swap it back and the script runs with transformers).

    python examples/run_classification.py --output_dir out --do_train --do_eval --do_predict \
        --eval_strategy epoch --num_train_epochs 3 --learning_rate 0.1 --report_to none

The data is synthetic (points labelled by a fixed linear rule) and the model a plain torch module returning
transformers' tuple convention, so it runs in seconds on a CPU with nothing to download.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import HfArgumentParser

from vlmtrain import Trainer, TrainingArguments  # from transformers import Trainer, TrainingArguments


@dataclass
class DataArguments:
    """What to train on (transformers' examples call these DataTrainingArguments)."""

    num_train_samples: int = field(default=64, metadata={"help": "Synthetic training samples."})
    num_eval_samples: int = field(default=16, metadata={"help": "Synthetic evaluation (and test) samples."})
    num_features: int = field(default=4, metadata={"help": "Features per sample."})
    num_labels: int = field(default=3, metadata={"help": "Classes."})


class Classifier(nn.Module):
    """A linear classifier returning (loss, logits) with labels and (logits,) without, as a transformers model
    with return_dict=False does."""

    def __init__(self, num_features: int, num_labels: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_features, num_labels)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> tuple:
        logits = self.linear(features)
        return (logits,) if labels is None else (F.cross_entropy(logits, labels), logits)


def make_dataset(n: int, data_args: DataArguments, seed: int) -> list[dict]:
    """Samples as `datasets` rows look: numpy features and a numpy integer `label` (the collator makes it `labels`)."""
    rule = np.random.default_rng(1234).standard_normal((data_args.num_features, data_args.num_labels))
    features = np.random.default_rng(seed).standard_normal((n, data_args.num_features)).astype(np.float32)
    return [{"features": x, "label": np.int64(np.argmax(x @ rule))} for x in features]


def compute_metrics(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def parse_args(argv: list[str] | None = None) -> tuple[DataArguments, TrainingArguments]:
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    return parser.parse_args_into_dataclasses(args=argv)


def main(data_args: DataArguments, training_args: TrainingArguments) -> None:
    torch.manual_seed(training_args.seed)
    train_dataset = make_dataset(data_args.num_train_samples, data_args, seed=0)
    eval_dataset = make_dataset(data_args.num_eval_samples, data_args, seed=1)
    trainer = Trainer(model=Classifier(data_args.num_features, data_args.num_labels), args=training_args,
                      train_dataset=train_dataset if training_args.do_train else None,
                      eval_dataset=eval_dataset if training_args.do_eval else None, compute_metrics=compute_metrics)

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        output = trainer.predict(eval_dataset, metric_key_prefix="predict")
        trainer.log_metrics("predict", output.metrics)
        trainer.save_metrics("predict", output.metrics)
        if trainer.is_world_process_zero():
            np.save(f"{training_args.output_dir}/predictions.npy", output.predictions.argmax(-1))


if __name__ == "__main__":
    main(*parse_args(sys.argv[1:]))
