"""The trainer's checkpoint parts and their plain defaults: vlmtrain.Trainer's ``checkpoint_writer`` is
train.async_checkpoint's background writer and its ``step_position`` the resume of transformers' checkpoints;
without them (the core's defaults) the trainer writes synchronously, and refuses a checkpoint without its loop
state, naming it."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
from tiny import tiny_llama, token_samples

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.checkpointing.async_writer import AsyncCheckpointer
from vlmtrain.compat.checkpoints import position_from_step
from vlmtrain.errors import CheckpointError
from vlmtrain.trainer import TrainerCallback, TrainerParts

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(out, **kw) -> TrainingArguments:
    kw = {"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "save_steps": 2,
          "disable_tqdm": True, **kw}
    return TrainingArguments(output_dir=str(out), **kw)


class CheckpointsAtSave(TrainerCallback):
    """At each on_save: whether the saved checkpoint is complete on disk, and whether a writer thread runs."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, bool]] = []

    def on_save(self, args, state, control, **kwargs):
        done = os.path.isfile(os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "trainer_state.json"))
        writing = any(t.name.startswith("vlmtrain-checkpoint") for t in threading.enumerate())
        self.seen.append((done, writing))


def _without(part: str) -> TrainerParts:
    """vlmtrain.Trainer's parts with ``part`` at the core's default."""
    return dataclasses.replace(Trainer.parts, **{part: getattr(TrainerParts(), part)})


def test_vlmtrain_trainer_has_the_checkpoint_parts():
    assert Trainer.parts.checkpoint_writer is AsyncCheckpointer
    assert Trainer.parts.step_position is position_from_step


def test_without_a_checkpoint_writer_async_checkpoint_saves_synchronously(tmp_path):
    watch = CheckpointsAtSave()
    Trainer(tiny_llama(0), _args(tmp_path, async_checkpoint=True), train_dataset=token_samples(16),
            callbacks=[watch], parts=_without("checkpoint_writer")).train()
    assert watch.seen == [(True, False), (True, False)]  # each checkpoint complete at its save, no writer thread


def test_the_writer_part_is_the_context_training_runs_in(tmp_path):
    """train() makes the checkpoint_writer part's writer as it begins and runs in it as a context (a raise
    reaches its __exit__, which lets the writer finish); the core calls save per save and wait before returning."""
    calls = []

    class Recording(AsyncCheckpointer):
        def __enter__(self):
            calls.append("enter")
            return super().__enter__()

        def __exit__(self, *error):
            calls.append("exit")
            return super().__exit__(*error)

        def save(self, step, *args):
            calls.append(f"save {step}")
            return super().save(step, *args)

        def wait(self):
            calls.append("wait")
            return super().wait()

    Trainer(tiny_llama(0), _args(tmp_path, async_checkpoint=True), train_dataset=token_samples(16),
            parts=dataclasses.replace(Trainer.parts, checkpoint_writer=Recording)).train()
    assert [c for c in calls if c != "wait"] == ["enter", "save 2", "save 4", "exit"] and calls[-1] == "wait"
    assert sorted(n for n in os.listdir(tmp_path) if "checkpoint" in n) == ["checkpoint-2", "checkpoint-4"]


def test_without_step_position_a_checkpoint_without_loop_state_is_refused(tmp_path):
    Trainer(tiny_llama(0), _args(tmp_path, max_steps=2), train_dataset=token_samples(16)).train()
    os.remove(tmp_path / "checkpoint-2" / "loop_state_0.pt")  # as transformers' Trainer writes it
    resumed = Trainer(tiny_llama(0), _args(tmp_path), train_dataset=token_samples(16), parts=_without("step_position"))
    with pytest.raises(CheckpointError, match="has no loop_state_0.pt: resuming a checkpoint of transformers'"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
