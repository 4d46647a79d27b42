"""auto_find_batch_size without accelerate: an out-of-memory error (injected on the CPU) halves the batch, doubles
accumulation and training goes on from the same step, equal to a run that never ran out of memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_transformers_dropin import _samples
from torch import nn

import vlmtrain
from vlmtrain.data.collate import DefaultCollator
from vlmtrain.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


class RunsOutOfMemory(nn.Module):
    """A linear classifier whose forward raises CUDA's out-of-memory error from its ``fail_at``-th call on, for every
    micro-batch larger than ``limit`` samples."""

    def __init__(self, fail_at: int | None = None, limit: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.calls, self.fail_at, self.limit, self.sizes = nn.Linear(4, 3), 0, fail_at, limit, []
        self.seen: list[int] = []  # the ids of the samples trained (with ``idx``), in order

    def forward(self, x, labels=None, idx=None):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at and x.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        self.sizes.append(x.shape[0])
        self.seen += [] if idx is None else idx.tolist()
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


class StepIds(vlmtrain.TrainerCallback):
    """The sample ids each optimizer step trained (a step retried at a smaller batch counts once: its ids are
    those of its last try)."""

    def __init__(self, model: RunsOutOfMemory) -> None:
        self.model, self.start, self.steps = model, 0, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = len(self.model.seen)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(sorted(self.model.seen[self.start:]))


class SkipsBad(DefaultCollator):
    """The default collator, dropping (and counting) the samples whose ``idx`` is in ``bad``."""

    def __init__(self, bad: set[int]) -> None:
        super().__init__()
        self.bad = bad

    def __call__(self, features):
        good = [f for f in features if f["idx"] not in self.bad]
        skipped = {"skipped": {"bad": len(features) - len(good)}} if len(good) < len(features) else {}
        return {**super().__call__(good), **skipped} if good else skipped


class CrashAfterSave(vlmtrain.TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        raise KeyboardInterrupt  # (a killed job: past the trainer's handlers)


def _train_ids(out, model, bad=(), callbacks=(), resume=None, **kw):
    """Training on 40 samples with ids in order, batch 4 x accumulation 2 (5 steps), auto_find_batch_size: (the
    trainer, its StepIds, its TrainOutput)."""
    args = vlmtrain.TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, learning_rate=0.3,
                                      per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                      num_train_epochs=1, optim="adamw_torch", weight_decay=0.1, logging_steps=1,
                                      auto_find_batch_size=True, max_bad_sample_fraction=1.0, seed=3,
                                      train_sampling_strategy="sequential", **kw)
    data = [{**sample, "idx": i} for i, sample in enumerate(_samples(40))]
    ids = StepIds(model)
    trainer = vlmtrain.Trainer(model=model, args=args, train_dataset=data, data_collator=SkipsBad(set(bad)),
                               callbacks=[ids, *callbacks])
    return trainer, ids, trainer.train(resume_from_checkpoint=resume)


# bad: none; samples 4-7, an all-bad micro-batch of step 1 (the loader yields it, no micro-step counts it); 12-15,
# one of step 2, which runs out of memory after it and reads it again at the smaller batch
@pytest.mark.parametrize("bad", [(), (4, 5, 6, 7), (12, 13, 14, 15)],
                         ids=["clean", "all-bad-batch-before", "all-bad-batch-in-the-retried-step"])
def test_a_step_retried_at_half_the_batch_trains_each_sample_once(tmp_path, bad):
    """Out of memory in step 2: the retried step starts at its own first sample, as the step of a run that never
    ran out of memory, and its bad samples are counted once."""
    ref_model, model = RunsOutOfMemory(), RunsOutOfMemory(fail_at=4)  # call 4: step 2's second micro-batch
    _, ref_ids, _ = _train_ids(tmp_path / "ref", ref_model, bad, save_strategy="no")
    with pytest.warns(UserWarning, match="out of memory at step 2"):
        trainer, ids, out = _train_ids(tmp_path / "auto", model, bad, save_strategy="no")
    assert ids.steps == ref_ids.steps
    assert sorted(i for step in ids.steps for i in step) == [i for i in range(40) if i not in bad]
    assert out.metrics.get("train_skipped_bad", 0) == len(bad)  # the retry reads them again
    for mine, theirs in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [(), (4, 5, 6, 7)], ids=["clean", "all-bad-batch"])
def test_resume_after_the_batch_shrank_goes_on_at_the_smaller_batch(tmp_path, bad):
    """The checkpoint's train_batch_size (2, after an out-of-memory error at 4) is restored on resume, as
    transformers does, with the accumulation that keeps a step's samples: the resumed run trains the
    uninterrupted run's remaining steps on the same samples and ends with its weights."""
    straight_model = RunsOutOfMemory(fail_at=1)  # every micro-batch over 2 samples runs out of memory
    with pytest.warns(UserWarning, match="going on with 2"):
        _, straight, _ = _train_ids(tmp_path / "straight", straight_model, bad, save_steps=2)
    crashed = RunsOutOfMemory(fail_at=1)
    with pytest.warns(UserWarning, match="going on with 2"), pytest.raises(KeyboardInterrupt):
        _train_ids(tmp_path / "run", crashed, bad, [CrashAfterSave()], save_steps=2)
    resumed_model = RunsOutOfMemory(fail_at=1)
    trainer, resumed, _ = _train_ids(tmp_path / "run", resumed_model, bad, resume=True, save_steps=2)
    assert len(straight.steps) == 5 and sorted(crashed.seen) == straight.steps[0] + straight.steps[1]
    assert resumed.steps == straight.steps[2:]
    assert resumed_model.sizes and set(resumed_model.sizes) == {2}  # never out of memory again
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 4)
    for mine, theirs in zip(resumed_model.parameters(), straight_model.parameters()):
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
