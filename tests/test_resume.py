"""Exact resume: 20 steps straight == 10 steps, interrupted, then resumed to 20 in a new Trainer with a freshly
(differently) initialised model: same logged losses, same eval losses, same data order and bitwise-equal final
weights on CPU, with shuffling, dropout, gradient accumulation, dataloader workers and a mid-epoch checkpoint
that falls inside a logging window."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tiny import tiny_llama, token_samples
from torch import nn

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.errors import CheckpointError
from vlmtrain.trainer import TrainerCallback

# 28 samples / batch 4 = 7 micro-batches per epoch; accumulation 2 -> 4 optimizer steps per epoch (2+2+2+1).
# Step 10 is the 2nd step of the 3rd epoch (mid-epoch); 20 steps = 5 epochs. Loss is logged every 3 steps, so
# the window 10..12 spans the checkpoint at step 10.
NUM_SAMPLES, BATCH, ACCUM, MAX_STEPS, STOP_AT, LOG_EVERY = 28, 4, 2, 20, 10, 3
MICRO_PER_EPOCH = NUM_SAMPLES // BATCH
MICRO_BEFORE_STOP = 2 * MICRO_PER_EPOCH + 2 * ACCUM  # two whole epochs + two steps of the third


pytestmark = pytest.mark.usefixtures("one_thread")


class Interrupted(Exception):
    """Stands for a crash / preemption right after the checkpoint at STOP_AT was written."""


class StopAt(TrainerCallback):
    """Stops training cleanly at `step` (the checkpoint at that step is written before the loop exits)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class CrashAfterSave(TrainerCallback):
    """Raises out of train() right after the checkpoint at `step` is on disk, like a killed job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Interrupted(f"killed after saving step {self.step}")


class IndexedSamples(torch.utils.data.Dataset):
    """token_samples plus an `idx` field so the order the model sees can be recorded."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return {**self.samples[i], "idx": i}


class RecordingLM(nn.Module):
    """Wraps a tiny llama: records each batch's `idx` (in the main process, so workers do not hide it) and
    forwards the rest."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lm = tiny_llama(seed, attention_dropout=0.1)
        self.seen: list[list[int]] = []

    def forward(self, idx: torch.Tensor, **inputs):
        self.seen.append(idx.tolist())
        return self.lm(**inputs)


def make_args(out, workers: int = 2, **overrides) -> TrainingArguments:
    kwargs = dict(output_dir=str(out), max_steps=MAX_STEPS, per_device_train_batch_size=BATCH,
                  per_device_eval_batch_size=8, gradient_accumulation_steps=ACCUM, learning_rate=1e-2,
                  warmup_steps=3, logging_steps=LOG_EVERY, save_steps=STOP_AT, dataloader_num_workers=workers,
                  disable_tqdm=True, seed=7)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def logged(trainer_or_dir, key: str) -> dict[int, float]:
    """{step: value} of `key` from a trainer's log_history, or from an output dir's metrics.jsonl."""
    if isinstance(trainer_or_dir, Trainer):
        records = trainer_or_dir.state.log_history
    else:
        with open(os.path.join(trainer_or_dir, "metrics.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
    out: dict[int, float] = {}
    for rec in records:
        if key in rec:
            assert rec["step"] not in out, f"{key} logged twice at step {rec['step']}"
            out[rec["step"]] = rec[key]
    return out


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if not torch.equal(sa[k], sb[k])]
    assert not differ, f"parameters differ after resume: {differ[:5]}"


def assert_checkpoint_mid_epoch(path) -> None:
    loop = torch.load(os.path.join(path, "loop_state_0.pt"), weights_only=True)
    assert loop["loader"] is not None and 0 < loop["micro_step"] < MICRO_PER_EPOCH, loop
    assert loop["epoch_index"] == 2


def run_straight(out, data, workers: int = 2, model_seed: int = 0, **overrides) -> Trainer:
    trainer = Trainer(tiny_llama(model_seed, attention_dropout=0.1), make_args(out, workers, **overrides),
                      train_dataset=data)
    trainer.train()
    return trainer


def run_interrupted_then_resumed(out, data, workers: int = 2, eval_dataset=None, resume=True,
                                 **overrides) -> tuple[Trainer, Trainer]:
    first = Trainer(tiny_llama(0, attention_dropout=0.1), make_args(out, workers, **overrides),
                    train_dataset=data, eval_dataset=eval_dataset, callbacks=[StopAt(STOP_AT)])
    first.train()
    assert first.state.global_step == STOP_AT
    second = Trainer(tiny_llama(123, attention_dropout=0.1), make_args(out, workers, **overrides),
                     train_dataset=data, eval_dataset=eval_dataset)
    second.train(resume_from_checkpoint=resume)
    assert second.state.global_step == MAX_STEPS
    return first, second


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_mid_epoch_matches_straight_run(tmp_path, workers):
    data = token_samples(NUM_SAMPLES, seed=1)
    straight = run_straight(tmp_path / "a", data, workers)
    first, resumed = run_interrupted_then_resumed(tmp_path / "b", data, workers)
    assert_checkpoint_mid_epoch(tmp_path / "b" / f"checkpoint-{STOP_AT}")
    # A freshly built model with another init differs before resume: equality below proves weights were loaded.
    assert not torch.equal(tiny_llama(123).lm_head.weight, tiny_llama(0).lm_head.weight)

    expected = logged(straight, "loss")
    assert sorted(expected) == [3, 6, 9, 12, 15, 18]
    assert logged(resumed, "loss") == expected  # exact float equality, incl. the 10..12 window across resume
    assert logged(str(tmp_path / "b"), "loss") == logged(str(tmp_path / "a"), "loss") == expected
    for key in ("grad_norm", "learning_rate"):
        assert logged(resumed, key) == logged(straight, key), key
    assert resumed.state.epoch == straight.state.epoch
    assert_same_weights(resumed.model, straight.model)


@pytest.mark.slow
def test_resume_from_explicit_path_not_the_latest(tmp_path):
    """Checkpoints at 5 and 10; resuming explicitly from checkpoint-5 (into another output dir) still matches."""
    data = token_samples(NUM_SAMPLES, seed=1)
    straight = run_straight(tmp_path / "a", data, workers=0, save_steps=5)
    first = Trainer(tiny_llama(0, attention_dropout=0.1), make_args(tmp_path / "b", 0, save_steps=5),
                    train_dataset=data, callbacks=[StopAt(STOP_AT)])
    first.train()
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint-10", "checkpoint-5", "metrics.jsonl"]

    resumed = Trainer(tiny_llama(123, attention_dropout=0.1), make_args(tmp_path / "c", 0, save_steps=5),
                      train_dataset=data)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-5"))
    assert resumed.state.global_step == MAX_STEPS
    assert logged(resumed, "loss") == logged(straight, "loss")
    assert min(logged(str(tmp_path / "c"), "loss")) == 6  # the new dir only logs what ran after step 5
    assert_same_weights(resumed.model, straight.model)


def test_resume_via_training_arguments(tmp_path):
    """TrainingArguments.resume_from_checkpoint='latest' (what the CLI sets) resumes like train(True)."""
    data = token_samples(NUM_SAMPLES, seed=1)
    straight = run_straight(tmp_path / "a", data, workers=0)
    Trainer(tiny_llama(0, attention_dropout=0.1), make_args(tmp_path / "b", 0), train_dataset=data,
            callbacks=[StopAt(STOP_AT)]).train()
    resumed = Trainer(tiny_llama(5, attention_dropout=0.1),
                      make_args(tmp_path / "b", 0, resume_from_checkpoint="latest"), train_dataset=data)
    resumed.train()
    assert logged(resumed, "loss") == logged(straight, "loss")
    assert_same_weights(resumed.model, straight.model)


@pytest.mark.slow
def test_resume_with_evaluation_in_the_window(tmp_path):
    """Evaluations before and after the checkpoint (steps 8, 12, ...; eval loaders draw from the global RNG)
    give the same eval losses, and training stays bitwise equal."""
    data, eval_data = token_samples(NUM_SAMPLES, seed=1), token_samples(12, seed=2)
    kw = dict(eval_strategy="steps", eval_steps=4)
    a = tmp_path / "a"
    straight = Trainer(tiny_llama(0, attention_dropout=0.1), make_args(a, 2, **kw), train_dataset=data,
                       eval_dataset=eval_data)
    straight.train()
    _, resumed = run_interrupted_then_resumed(tmp_path / "b", data, 2, eval_dataset=eval_data, **kw)

    expected_eval = logged(straight, "eval_loss")
    assert sorted(expected_eval) == [4, 8, 12, 16, 20]
    assert logged(resumed, "eval_loss") == expected_eval
    assert logged(str(tmp_path / "b"), "eval_loss") == expected_eval
    assert logged(resumed, "loss") == logged(straight, "loss")
    assert_same_weights(resumed.model, straight.model)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_data_order_after_resume_equals_straight_run(tmp_path, workers):
    """The batches seen after a crash + resume are exactly those the straight run saw from that point on."""
    data = IndexedSamples(token_samples(NUM_SAMPLES, seed=1))
    straight_model = RecordingLM(0)
    straight = Trainer(straight_model, make_args(tmp_path / "a", workers), train_dataset=data)
    straight.train()
    seen = straight_model.seen
    assert len(seen) == MAX_STEPS // 4 * MICRO_PER_EPOCH  # 5 whole epochs
    epochs = [sorted(i for batch in seen[e * MICRO_PER_EPOCH:(e + 1) * MICRO_PER_EPOCH] for i in batch)
              for e in range(5)]
    assert all(e == list(range(NUM_SAMPLES)) for e in epochs)  # each epoch is a permutation ...
    assert seen[:MICRO_PER_EPOCH] != seen[MICRO_PER_EPOCH:2 * MICRO_PER_EPOCH]  # ... reshuffled per epoch

    crashed_model = RecordingLM(0)
    crashed = Trainer(crashed_model, make_args(tmp_path / "b", workers), train_dataset=data,
                      callbacks=[CrashAfterSave(STOP_AT)])
    with pytest.raises(Interrupted):
        crashed.train()
    assert crashed_model.seen == seen[:MICRO_BEFORE_STOP]

    resumed_model = RecordingLM(99)
    resumed = Trainer(resumed_model, make_args(tmp_path / "b", workers), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed_model.seen == seen[MICRO_BEFORE_STOP:]
    assert logged(resumed, "loss") == logged(straight, "loss")
    assert_same_weights(resumed_model, straight_model)


@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "stream"])
def test_resume_from_a_checkpoint_saved_as_its_epoch_ended_goes_on_with_the_next_epoch(tmp_path, stream):
    """save_strategy epoch writes checkpoint-8 after epoch 2 ended (the loader at that epoch's end): resumed from it,
    a map-style dataset and a stream (StreamingDataset) train epochs 3 to 5 as the straight run did (AdamW, weight
    decay): the same losses, epoch and weights."""
    from vlmtrain.data.sources import IndexedSource, StreamingDataset

    def data():
        samples = token_samples(NUM_SAMPLES, seed=1)
        return StreamingDataset([IndexedSource(samples, block_size=8)], seed=1) if stream else samples

    kw = dict(save_strategy="epoch", weight_decay=0.1)
    straight = run_straight(tmp_path / "a", data(), workers=0, **kw)
    resumed = Trainer(tiny_llama(123, attention_dropout=0.1), make_args(tmp_path / "b", 0, **kw), train_dataset=data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-8"))
    assert resumed.state.global_step == MAX_STEPS and resumed.state.epoch == straight.state.epoch
    assert logged(str(tmp_path / "b"), "loss") == {s: v for s, v in logged(straight, "loss").items() if s > 8}
    assert_same_weights(resumed.model, straight.model)
    # as if 2 processes wrote it, resumed by 1: the next epoch too (no position to split: a stream is not refused)
    checkpoint = shutil.copytree(tmp_path / "a" / "checkpoint-8", tmp_path / "c" / "checkpoint-8")
    shutil.copy(checkpoint / "loop_state_0.pt", checkpoint / "loop_state_1.pt")
    again = Trainer(tiny_llama(5), make_args(tmp_path / "c", 0, **kw), train_dataset=data())
    with pytest.warns(UserWarning, match="written by 2 process"):
        again.train(resume_from_checkpoint=str(checkpoint))
    assert again.state.global_step == MAX_STEPS


@pytest.mark.parametrize(("before", "after"), [(0, 1), (1, 0)])
def test_resume_with_another_number_of_dataloader_workers(tmp_path, before, after):
    """dataloader_num_workers ('auto' resolves by machine) changes between the crash and the resume: a map-style
    dataset's position is its sample index, so the resumed run sees the straight run's batches and ends with its
    weights."""
    data = IndexedSamples(token_samples(NUM_SAMPLES, seed=1))
    straight_model = RecordingLM(0)
    straight = Trainer(straight_model, make_args(tmp_path / "a", before), train_dataset=data)
    straight.train()
    crashed = Trainer(RecordingLM(0), make_args(tmp_path / "b", before), train_dataset=data,
                      callbacks=[CrashAfterSave(STOP_AT)])
    with pytest.raises(Interrupted):
        crashed.train()
    resumed_model = RecordingLM(99)
    resumed = Trainer(resumed_model, make_args(tmp_path / "b", after), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed_model.seen == straight_model.seen[MICRO_BEFORE_STOP:]
    assert logged(resumed, "loss") == logged(straight, "loss")
    assert_same_weights(resumed_model, straight_model)


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __iter__(self):
        yield from self.samples


def test_a_stream_resumed_mid_epoch_by_another_number_of_processes_is_refused(tmp_path):
    """A streamed dataset keeps one position per process: a mid-epoch checkpoint of 2 processes resumed by 1 is
    a one-line error naming both numbers, before any weight is read (tests/test_ckpt_ranks.py resumes map-style
    data across world sizes)."""
    data = Stream(token_samples(NUM_SAMPLES, seed=1))
    Trainer(tiny_llama(0), make_args(tmp_path, 0, max_steps=2, save_steps=2), train_dataset=data).train()
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copy(checkpoint / "loop_state_0.pt", checkpoint / "loop_state_1.pt")  # as 2 processes write it
    model = tiny_llama(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(model, make_args(tmp_path, 0, max_steps=4), train_dataset=data)
    with pytest.raises(CheckpointError, match=r"written by 2 process\(es\) and is resumed by 1: a streamed "
                                              r"train_dataset .* resume with 2 process\(es\)") as error:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "\n" not in str(error.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
