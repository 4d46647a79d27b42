"""Checkpoints in transformers' layout, resumable across the two trainers (single process): transformers' Trainer
resumes a vlmtrain checkpoint, vlmtrain resumes a transformers one, and the losses after the resume are those of
the uninterrupted run (model, optimizer, scheduler, trainer state, data position); the RNG states are restored."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
import transformers
from tiny import tiny_llama, token_samples

from vlmtrain import Trainer, TrainerCallback, TrainingArguments

pytestmark = pytest.mark.usefixtures("one_thread")

# 20 samples of 8 tokens, batch 4: 5 micro-batches per epoch; sequential order, so both trainers see the same
# batches (their random samplers differ). No dropout: the losses depend on weights, optimizer and data only.
DATA = token_samples(20, min_len=8, max_len=8)
REL = 1e-6  # the two trainers' per-step arithmetic differs in float rounding (~2e-7), nothing more


class RngAtFirstStep(transformers.TrainerCallback, TrainerCallback):
    """Python's, numpy's and torch's RNG states when the first step (after a resume) begins, in either trainer."""

    def __init__(self) -> None:
        self.state = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.state is None:
            self.state = (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state())


def _kw(out, **kw) -> dict:
    base = dict(output_dir=str(out), report_to="none", disable_tqdm=True, per_device_train_batch_size=4,
                learning_rate=1e-3, logging_steps=1, max_steps=8, save_steps=3, train_sampling_strategy="sequential",
                seed=0)
    return {**base, **kw}


def _hf(out, resume=None, callbacks=(), **kw) -> transformers.Trainer:
    args = transformers.TrainingArguments(use_cpu=True, **_kw(out, **kw))
    trainer = transformers.Trainer(model=tiny_llama(0), args=args, train_dataset=DATA, callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _ours(out, resume=None, callbacks=(), **kw) -> Trainer:
    trainer = Trainer(tiny_llama(0), TrainingArguments(**_kw(out, **kw)), train_dataset=DATA, callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def _saved_rng(checkpoint) -> tuple:
    saved = torch.load(os.path.join(checkpoint, "rng_state.pth"), weights_only=False)
    return saved["python"], np.asarray(saved["numpy"][1]).tolist(), saved["cpu"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both trainers' uninterrupted runs (checkpoints at steps 3 and 6), with and without accumulation."""
    root = tmp_path_factory.mktemp("runs")
    return {(name, accum): run(root / f"{name}{accum}", gradient_accumulation_steps=accum,
                               **({} if accum == 1 else {"max_steps": 5, "save_steps": 2}))
            for name, run in (("hf", _hf), ("ours", _ours)) for accum in (1, 2)}


def test_checkpoint_files_are_transformers_plus_the_loop_state(runs):
    hf_dir, our_dir = (runs[name, 1].args.output_dir + "/checkpoint-3" for name in ("hf", "ours"))
    assert set(os.listdir(our_dir)) == set(os.listdir(hf_dir)) | {"loop_state_0.pt"}
    assert "rng_state.pth" in os.listdir(hf_dir) and "training_args.bin" in os.listdir(hf_dir)
    with open(os.path.join(hf_dir, "trainer_state.json")) as f, open(os.path.join(our_dir, "trainer_state.json")) as g:
        assert set(json.load(g)) == set(json.load(f))
    saved_args = torch.load(os.path.join(our_dir, "training_args.bin"), weights_only=False)
    assert isinstance(saved_args, TrainingArguments) and saved_args.output_dir == runs["ours", 1].args.output_dir
    assert saved_args.max_steps == 8 and saved_args.save_steps == 3


@pytest.mark.parametrize("accum", [1, 2])
def test_vlmtrain_resumes_a_transformers_checkpoint(runs, tmp_path, accum):
    straight = runs["hf", accum]
    step = 3 if accum == 1 else 2  # mid-epoch: 3 of 5 steps; with accumulation 2, 2 of 3 (4 of 5 micro-batches)
    checkpoint = f"{straight.args.output_dir}/checkpoint-{step}"
    rng = RngAtFirstStep()
    kw = {} if accum == 1 else {"max_steps": 5, "save_steps": 2}
    with pytest.warns(UserWarning, match="has no loop_state_0.pt"):
        resumed = _ours(tmp_path, checkpoint, [rng], gradient_accumulation_steps=accum, **kw)
    expected, got = _losses(straight), _losses(resumed)
    after = [s for s in expected if s > step]
    assert [s for s in got if s > step] == after
    assert [got[s] for s in after] == pytest.approx([expected[s] for s in after], rel=REL)
    python, numpy_state, cpu = _saved_rng(checkpoint)
    assert rng.state[0] == python and rng.state[1] == numpy_state and torch.equal(rng.state[2], cpu)


def test_transformers_resumes_a_vlmtrain_checkpoint(runs, tmp_path):
    straight = runs["ours", 1]
    checkpoint = f"{straight.args.output_dir}/checkpoint-3"
    rng = RngAtFirstStep()
    resumed = _hf(tmp_path, checkpoint, [rng])
    expected, got = _losses(straight), _losses(resumed)
    assert sorted(s for s in got if s > 3) == [4, 5, 6, 7, 8]
    assert [got[s] for s in range(4, 9)] == pytest.approx([expected[s] for s in range(4, 9)], rel=REL)
    python, numpy_state, _ = _saved_rng(checkpoint)
    assert rng.state[0] == python and rng.state[1] == numpy_state
    assert resumed.state.global_step == 8 and os.path.isdir(f"{tmp_path}/checkpoint-6")


def test_a_checkpoint_without_loop_state_resumes_at_the_same_data_position(runs, tmp_path):
    """transformers' rule (position from global_step) continues vlmtrain's own shuffled order exactly."""
    kw = dict(train_sampling_strategy="random", max_steps=9, save_steps=7)  # step 7: epoch 1, 2 of 5 batches
    straight = _ours(tmp_path / "straight", **kw)
    copy = tmp_path / "checkpoint-7"
    shutil.copytree(tmp_path / "straight" / "checkpoint-7", copy)
    os.remove(copy / "loop_state_0.pt")
    with pytest.warns(UserWarning, match="has no loop_state_0.pt"):
        resumed = _ours(tmp_path / "resumed", str(copy), **kw)
    assert [_losses(resumed)[s] for s in (8, 9)] == [_losses(straight)[s] for s in (8, 9)]  # bitwise
