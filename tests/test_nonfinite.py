"""NaN/Inf steps: the update is skipped, counted and logged; too many in a row stop training with a message."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from tests.tiny import tiny_llama, token_samples
from vlmtrain import Trainer, TrainerCallback, TrainingArguments


class NaNAt(nn.Module):
    """A tiny Llama whose loss is NaN on the given (1-based) forward calls."""

    def __init__(self, bad_calls: set[int]) -> None:
        super().__init__()
        self.lm, self.bad, self.calls = tiny_llama(), bad_calls, 0

    def forward(self, **batch):
        self.calls += 1
        out = self.lm(**batch)
        loss = out.loss * float("nan") if self.calls in self.bad else out.loss
        return {"loss": loss, "num_items": (batch["labels"][..., 1:] != -100).sum()}


class Snapshots(TrainerCallback):
    def __init__(self) -> None:
        self.weights = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _args(tmp_path, **kw):
    return TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, report_to="none", learning_rate=1e-3, **kw)


def test_a_nan_step_is_skipped_counted_and_logged(tmp_path):
    snaps = Snapshots()
    model = NaNAt({3})
    with pytest.warns(UserWarning, match="step 3: non-finite loss"):
        out = Trainer(model, _args(tmp_path), train_dataset=token_samples(32), callbacks=[snaps]).train()
    assert all(torch.equal(snaps.weights[3][k], snaps.weights[2][k]) for k in snaps.weights[2])  # no update
    assert not all(torch.equal(snaps.weights[4][k], snaps.weights[3][k]) for k in snaps.weights[3])
    assert out.global_step == 6 and out.metrics["train_nonfinite_steps"] == 1 and math.isfinite(out.training_loss)
    rows = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "train_runtime" not in r}
    assert rows[3].get("nonfinite_steps") == 1 and "loss" not in rows[3]  # no finite step to average
    assert "nonfinite_steps" not in rows[4] and math.isfinite(rows[4]["loss"])


def test_too_many_consecutive_nonfinite_steps_stop_training(tmp_path):
    model = NaNAt({2, 3, 4})
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"steps 2\.\.4: 3 consecutive steps"):
        Trainer(model, _args(tmp_path, max_consecutive_nonfinite_steps=3), train_dataset=token_samples(32)).train()


def test_the_nonfinite_counts_survive_a_resume(tmp_path):
    """Steps 2 and 3 are NaN and checkpoint-3 is saved; resumed there, a NaN step 4 is the third in a row (as in
    the uninterrupted run, which stops at step 4), and the run's count of skipped steps goes on."""
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=2,
                             save_strategy="steps", save_steps=3, disable_tqdm=True, report_to="none",
                             learning_rate=1e-3, max_consecutive_nonfinite_steps=3)
    with pytest.warns(UserWarning, match="non-finite"):
        first = Trainer(NaNAt({2, 3}), args, train_dataset=token_samples(32)).train()
    assert first.metrics["train_nonfinite_steps"] == 2
    resumed = Trainer(NaNAt({1}), args, train_dataset=token_samples(32))  # (call 1 of the resumed run: step 4)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=r"steps 2\.\.4: 3 consecutive steps"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    again = Trainer(NaNAt(set()), args, train_dataset=token_samples(32)).train(  # (a clean step 4 instead)
        resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert again.metrics["train_nonfinite_steps"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("nonfinite_steps") for r in rows if r.get("step") == 4 and "train_runtime" not in r] == [1]
