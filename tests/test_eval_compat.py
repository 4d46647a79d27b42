"""transformers' conventions in evaluation and predict live in vlmtrain.Trainer (vlmtrain/compat/evaluation.py),
not in the trainer core: a bare TrainerCore reports an evaluation's losses and sample count, a tuple model's loss
alone, and the batch's `labels` whatever `label_names` says; vlmtrain.Trainer adds transformers' speed metrics
(in transformers' key order), a tuple model's predictions and `label_names`' labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vlmtrain
from vlmtrain.trainer import TrainerCore

pytestmark = pytest.mark.usefixtures("one_thread")


class Tuple(nn.Module):
    """transformers' tuple convention: (loss, logits) with labels, (logits,) without."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return (logits,) if labels is None else (F.cross_entropy(logits, labels), logits)


class Named(nn.Module):
    """A mapping with `loss`, `logits` and a second output `scores`; its labels are the batch's `y`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 3)

    def forward(self, x, y=None):
        logits = self.net(x)
        loss = F.cross_entropy(logits, y) if y is not None else logits.sum() * 0
        return {"loss": loss, "logits": logits, "scores": logits.sum(-1)}


def _samples(label: str, n: int = 6) -> list[dict]:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(1))
    return [{"x": x[i], label: torch.tensor(i % 3)} for i in range(n)]


def _trainer(cls, model, tmp_path, **kw):
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none",
                                      disable_tqdm=True, **kw)
    return cls(model=model, args=args)


def test_speed_metrics_are_vlmtrain_Trainers_the_core_reports_losses_and_samples(tmp_path):
    data = _samples("labels")
    core = _trainer(TrainerCore, Tuple(), tmp_path).evaluate(data)
    ours = _trainer(vlmtrain.Trainer, Tuple(), tmp_path).evaluate(data)
    assert list(core) == ["eval_loss", "eval_samples", "epoch"] and core["eval_samples"] == 6
    # transformers' keys in its order (the loop's, then evaluate's speed metrics), with vlmtrain's eval_samples
    assert list(ours) == ["eval_loss", "eval_model_preparation_time", "eval_runtime", "eval_samples_per_second",
                          "eval_steps_per_second", "eval_samples", "epoch"]
    assert ours["eval_loss"] == core["eval_loss"] and ours["eval_samples"] == 6
    assert ours["eval_model_preparation_time"] == 0.0  # (an evaluation before training, as transformers)


def test_a_tuple_models_predictions_are_vlmtrain_Trainers(tmp_path):
    data = _samples("labels")
    core = _trainer(TrainerCore, Tuple(), tmp_path).predict(data)
    ours = _trainer(vlmtrain.Trainer, Tuple(), tmp_path).predict(data)
    assert core.predictions is None and core.label_ids is None and "test_loss" in core.metrics
    assert ours.predictions.shape == (6, 3) and ours.label_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert ours.metrics["test_loss"] == core.metrics["test_loss"]


def test_label_names_are_vlmtrain_Trainers(tmp_path):
    data = _samples("y")
    core = _trainer(TrainerCore, Named(), tmp_path, label_names=["y"]).predict(data)
    ours = _trainer(vlmtrain.Trainer, Named(), tmp_path, label_names=["y"]).predict(data)
    # the core: the logits and the batch's `labels` (none here)
    assert core.predictions.shape == (6, 3) and core.label_ids is None
    # transformers' convention: every output but the loss, in order; the labels of label_names
    logits, scores = ours.predictions
    np.testing.assert_allclose(logits, core.predictions)
    np.testing.assert_allclose(scores, logits.sum(-1), rtol=1e-6)
    assert ours.label_ids.tolist() == [0, 1, 2, 0, 1, 2]
