"""auto_find_batch_size without accelerate: an out-of-memory error (injected on the CPU) halves the batch, doubles
accumulation and training goes on from the same step, equal to a run that never ran out of memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_transformers_dropin import _samples
from torch import nn

import vlmtrain
from vlmtrain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


class RunsOutOfMemory(nn.Module):
    """A linear classifier whose forward raises CUDA's out-of-memory error from its ``fail_at``-th call on, for every
    micro-batch larger than ``limit`` samples."""

    def __init__(self, fail_at: int | None = None, limit: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.calls, self.fail_at, self.limit, self.sizes = nn.Linear(4, 3), 0, fail_at, limit, []

    def forward(self, x, labels=None):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at and x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        self.sizes.append(x.shape[0])
        logits = self.net(x)
        return (logits,) if labels is None else (F.cross_entropy(logits, labels), logits)


def _train(out, model, **kw):
    args = vlmtrain.TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, learning_rate=0.3,
                                      per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                      num_train_epochs=2, optim="adamw_torch", logging_steps=1, save_strategy="no",
                                      **kw)
    trainer = vlmtrain.Trainer(model=model, args=args, train_dataset=_samples(24))
    return trainer, trainer.train()


def test_out_of_memory_mid_step_goes_on_at_half_the_batch_as_an_uninterrupted_run(tmp_path):
    ref_trainer, ref = _train(tmp_path / "ref", RunsOutOfMemory())
    model = RunsOutOfMemory(fail_at=6)  # steps 1-2 take calls 1-4; step 3 fails in its second micro-batch
    with pytest.warns(UserWarning, match="out of memory at step 3 with per_device_train_batch_size=4: going on "
                                         "with 2 and gradient_accumulation_steps=4"):
        trainer, out = _train(tmp_path / "auto", model, auto_find_batch_size=True)
    assert out.global_step == ref.global_step == 6
    assert model.sizes == [4] * 5 + [2] * 16  # the failed step's first micro-batch again, as two of 2
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 4)
    assert trainer._train_batch_size == trainer.state.train_batch_size == 2
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (trainer, ref_trainer)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert out.training_loss == pytest.approx(ref.training_loss, rel=1e-5)
    for mine, theirs in zip(model.parameters(), ref_trainer.model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


def test_without_auto_find_batch_size_or_at_a_batch_of_one_the_error_stands(tmp_path):
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _train(tmp_path / "off", RunsOutOfMemory(fail_at=1))
    with pytest.raises(torch.cuda.OutOfMemoryError), pytest.warns(UserWarning, match="going on with 1"):
        _train(tmp_path / "one", RunsOutOfMemory(fail_at=1, limit=0), auto_find_batch_size=True)


def test_other_errors_are_not_retried(tmp_path):
    model = RunsOutOfMemory()
    model.forward = lambda x, labels=None: (_ for _ in ()).throw(RuntimeError("shapes do not match"))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        _train(tmp_path, model, auto_find_batch_size=True)


def test_several_processes_are_refused_before_training(tmp_path):
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none", auto_find_batch_size=True)
    trainer = vlmtrain.Trainer(model=RunsOutOfMemory(), args=args, train_dataset=_samples(8))
    trainer.world_size = 2
    with pytest.raises(ConfigError, match="auto_find_batch_size=True works in one process only"):
        trainer.train()


class _OutOfMemoryAfterStep(vlmtrain.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. (injected after the optimizer step)")


def test_only_a_training_micro_batch_is_retried(tmp_path):
    """Out of memory after the optimizer step (the step counts already) stands; in evaluation it is transformers'
    error pointing at per_device_eval_batch_size."""
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none", auto_find_batch_size=True,
                                      per_device_train_batch_size=4, max_steps=2, save_strategy="no")
    trainer = vlmtrain.Trainer(model=RunsOutOfMemory(), args=args, train_dataset=_samples(8),
                               callbacks=[_OutOfMemoryAfterStep()])
    with pytest.raises(torch.cuda.OutOfMemoryError, match="after the optimizer step"):
        trainer.train()
    assert trainer.args.per_device_train_batch_size == 4
    args = vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none", auto_find_batch_size=True,
                                      per_device_train_batch_size=2, per_device_eval_batch_size=4, max_steps=2,
                                      eval_strategy="steps", eval_steps=1, save_strategy="no")
    trainer = vlmtrain.Trainer(model=RunsOutOfMemory(fail_at=1, limit=2), args=args, train_dataset=_samples(8),
                               eval_dataset=_samples(4))
    with pytest.raises(RuntimeError, match="Evaluation hit an out-of-memory error.*per_device_eval_batch_size"):
        trainer.train()
