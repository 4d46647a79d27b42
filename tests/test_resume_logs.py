"""After a crash and a resume, the logs read like one uninterrupted run: metrics.jsonl holds each step's row
once (the rows the crashed run logged after its checkpoint are dropped), TensorBoard purges those steps, and
TrainOutput.train_loss averages the whole run, not just the part after the resume."""

from __future__ import annotations

import json
import os

import pytest
from optional_extras import requires
from tiny import tiny_llama, token_samples

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.logging.writers import TensorBoardCallback
from vlmtrain.trainer import TrainerCallback

pytestmark = pytest.mark.usefixtures("one_thread")


class Crash(Exception):
    """Stands for kill -9 at some moment after the row of `step` was logged."""


class CrashAt(TrainerCallback):
    def __init__(self, step: int, event: str) -> None:
        self.step, self.event = step, event

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.event == "log" and state.global_step == self.step:
            raise Crash(f"after logging step {self.step}")

    def on_train_end(self, args, state, control, **kwargs):
        if self.event == "end":
            raise Crash("after the last row, before exit")


def _args(out, **kw) -> TrainingArguments:
    kw = {"max_steps": 7, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1,
          "save_steps": 2, "disable_tqdm": True, **kw}
    return TrainingArguments(output_dir=str(out), **kw)


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _comparable(rows: list[dict]) -> list[dict]:
    """The rows without wall-clock values (rates, runtime)."""
    return [{k: v for k, v in r.items() if not k.endswith(("_per_second", "_fraction", "runtime"))} for r in rows]


@pytest.mark.parametrize("event", ["log", "end"])
def test_metrics_after_crash_and_resume_equal_an_uninterrupted_run(tmp_path, event):
    data = token_samples(32)
    straight = Trainer(tiny_llama(0), _args(tmp_path / "straight"), train_dataset=data).train()
    out = tmp_path / "crashed"
    with pytest.raises(Crash):  # "log": after step 5's row, checkpoint-4 is the newest; "end": after everything
        Trainer(tiny_llama(0), _args(out), train_dataset=data, callbacks=[CrashAt(5, event)]).train()
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.2')  # and a row cut short by the kill
    resumed = Trainer(tiny_llama(1), _args(out), train_dataset=data).train(resume_from_checkpoint=True)

    rows, expected = _rows(out), _rows(tmp_path / "straight")
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6, 7, 7]
    assert _comparable(rows) == _comparable(expected)
    assert resumed.training_loss == straight.training_loss  # the running mean was checkpointed
    assert resumed.metrics["train_loss"] == straight.metrics["train_loss"]


def test_a_fresh_run_appends_to_an_existing_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 9, "loss": 1.0}\n')
    Trainer(tiny_llama(0), _args(tmp_path, max_steps=2), train_dataset=token_samples(8)).train()
    assert [r["step"] for r in _rows(tmp_path)] == [9, 1, 2, 2]


def test_a_resume_that_finds_no_checkpoint_drops_the_killed_attempts_rows(tmp_path):
    data = token_samples(32)
    with pytest.raises(Crash):  # killed after step 3's row, before the first checkpoint (save_steps 4)
        Trainer(tiny_llama(0), _args(tmp_path, save_steps=4), train_dataset=data, callbacks=[CrashAt(3, "log")]).train()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3]
    with pytest.warns(UserWarning, match="3 rows of an attempt that left no checkpoint"):
        Trainer(tiny_llama(0), _args(tmp_path, save_steps=4, max_steps=5),
                train_dataset=data).train(resume_from_checkpoint=True)
    straight = tmp_path / "straight"
    Trainer(tiny_llama(0), _args(straight, save_steps=4, max_steps=5), train_dataset=data).train()
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2, 3, 4, 5, 5]
    assert _comparable(_rows(tmp_path)) == _comparable(_rows(straight))


@requires("tensorboard", "tensorboard")
def test_tensorboard_purges_the_steps_after_the_checkpoint(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, kw = token_samples(32), {"report_to": "tensorboard", "run_name": "r"}
    with pytest.raises(Crash):
        Trainer(tiny_llama(0), _args(tmp_path, **kw), train_dataset=data, callbacks=[CrashAt(5, "log")]).train()
    resumed = Trainer(tiny_llama(0), _args(tmp_path, **kw), train_dataset=data)
    resumed.train(resume_from_checkpoint=True)
    writers = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, TensorBoardCallback)]
    assert writers[0].purge_step == 5  # resumed from checkpoint-4
    events = EventAccumulator(str(tmp_path / "runs" / "r"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == [1, 2, 3, 4, 5, 6, 7], steps
