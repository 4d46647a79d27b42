"""Datasets that follow the training step: each sample's step comes from its position in the data order, so
data-loader workers and resumes train on exactly the samples of an uninterrupted 0-worker run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import VOCAB, tiny_llama, token_samples

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.data.step_data import StepSampler
from vlmtrain.errors import ConfigError


class StepTagged(torch.utils.data.Dataset):
    """Item i at step s: a token sample whose first two tokens are s + 1 and i + 1 (read back from the batch)."""

    follows_step = True

    def __init__(self, n: int) -> None:
        self.samples = token_samples(n, min_len=8, max_len=8)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.get_item_at_step(index, 0)

    def get_item_at_step(self, index: int, step: int) -> dict:
        assert step + 1 < VOCAB and index + 1 < VOCAB  # the tags are token ids
        sample = dict(self.samples[index])
        sample["input_ids"] = [step + 1, index + 1] + sample["input_ids"][2:]
        return sample


class Recording(Trainer):
    """Records (step tag, index tag) of every micro-batch it trains on, in the main process."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.append([tuple(row[:2]) for row in inputs["input_ids"].tolist()])
        return super().training_step(model, inputs, num_items_in_batch)


def _train(out, data, workers: int, resume: str | None = None, **kw) -> list:
    args = TrainingArguments(output_dir=str(out), report_to="none", disable_tqdm=True, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=100, save_strategy="steps", save_steps=1,
                             dataloader_num_workers=workers, **kw)
    trainer = Recording(model=tiny_llama(), args=args, train_dataset=data)
    trainer.seen = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer.seen


def test_samples_follow_their_position_with_workers_and_resume(tmp_path):
    """24 samples, batch 4, accumulation 2: 3 steps an epoch. Every micro-batch of step k is made at step k - 1
    done, in the second epoch too; 2 workers and a resume mid-epoch train on the very same samples."""
    kw = dict(max_steps=5, gradient_accumulation_steps=2)
    data = StepTagged(24)
    plain = _train(tmp_path / "w0", data, 0, **kw)
    steps = [[s - 1 for s, _ in batch] for batch in plain]
    assert steps == [[k] * 4 for k in (0, 0, 1, 1, 2, 2, 3, 3, 4, 4)]
    assert sorted(i for batch in plain[:6] for _, i in batch) == list(range(1, 25))  # one epoch: every sample
    assert _train(tmp_path / "w2", data, 2, **kw) == plain
    for at, micro in ((1, 2), (4, 8)):  # mid first epoch, mid second epoch
        resumed = _train(tmp_path / "w2", data, 2, resume=str(tmp_path / "w2" / f"checkpoint-{at}"), **kw)
        assert resumed == plain[micro:], at


def test_sampler_pairs_every_rank_s_kth_batch_with_the_same_step():
    data = StepTagged(40)
    per_rank = [list(StepSampler(data, 2, rank, seed=3, batch_size=4, gradient_accumulation_steps=1))
                for rank in (0, 1)]
    assert [s for _, s in per_rank[0]] == [s for _, s in per_rank[1]] == [k // 4 for k in range(20)]
    assert sorted(i for pairs in per_rank for i, _ in pairs) == list(range(40))  # the ranks share the epoch
    sampler = StepSampler(data, 1, 0, seed=3, batch_size=4, gradient_accumulation_steps=2)
    sampler.first_step = 7
    sampler.load_state_dict({"yielded": 9})  # a restored position goes on numbering from where it was
    assert [s for _, s in sampler] == [7 + k // 8 for k in range(9, 40)]


class Stream(torch.utils.data.IterableDataset):
    follows_step = True

    def __iter__(self):
        yield from token_samples(8, min_len=8, max_len=8)


class Told(StepTagged):
    follows_step = False

    def set_step(self, step: int) -> None:
        self.step = step


@pytest.mark.parametrize("data, match", [(Stream(), "Stream follows the training step but is an iterable"),
                                         (Told(8), "Told has set_step")])
def test_step_following_that_workers_cannot_reproduce_fails_at_start(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        _train(tmp_path, data, 0, max_steps=1)


def test_vlmtrain_trainer_has_the_step_sampling_part():
    from vlmtrain.data.step_data import step_sampling

    assert Trainer.parts.step_sampling is step_sampling


def test_without_the_step_sampling_part_a_step_following_dataset_is_refused(tmp_path, monkeypatch):
    """The trainer alone cannot give samples their step: it names the missing part; plain datasets train."""
    from vlmtrain.trainer import TrainerParts

    monkeypatch.setattr(Recording, "parts", dataclasses.replace(Trainer.parts, step_sampling=TrainerParts().step_sampling))
    with pytest.raises(ConfigError, match="StepTagged .follows_step = True. needs the trainer part 'step_sampling'"):
        _train(tmp_path / "steps", StepTagged(8), 0, max_steps=1)
    assert len(_train(tmp_path / "plain", token_samples(8, min_len=8, max_len=8), 0, max_steps=1)) == 1


@pytest.mark.slow
def test_shapes_side_warmup_with_two_workers_and_a_resume_mid_warmup(tmp_path):
    """The demo's curriculum through `vlmtrain train`'s build: 2 workers train on the 0-worker run's texts and
    images step for step across the warm-up's end (step 2), and so does a resume from step 1, mid warm-up."""
    from test_vlm_run import _config

    from vlmtrain import run

    def train(out: str, workers: int, resume: str | None = None) -> list:
        (tmp_path / out).mkdir(exist_ok=True)
        cfg = _config(tmp_path / out, data={"multi_image_fraction": 0.0, "side_fraction": 0.25,
                                            "side_warmup_steps": 2, "num_train": 48},
                      train={"max_steps": 4, "save_steps": 1, "eval_strategy": "no", "dataloader_num_workers": workers})
        trainer, seen = run.build(cfg), []
        step = trainer.training_step

        def recording(model, inputs, num_items_in_batch=None):
            texts = trainer.processing_class.batch_decode(inputs["input_ids"], skip_special_tokens=True)
            seen.append((texts, inputs["pixel_values"].clone()))
            return step(model, inputs, num_items_in_batch)

        trainer.training_step = recording
        trainer.train(resume_from_checkpoint=resume)
        return seen

    plain, workers = train("w0", 0), train("w2", 2)
    assert len(plain) == 4 and all(len(texts) == 8 for texts, _ in plain)
    assert [t for t, _ in workers] == [t for t, _ in plain]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(workers, plain))
    relative = [sum("Relative to" in t for t in texts) for texts, _ in plain]  # one question per sample
    assert relative[:2] == [0, 0] and sum(relative[2:]) > 0  # the warm-up asks side questions in their place
    resumed = train("w2", 2, resume=str(tmp_path / "w2" / "run" / "checkpoint-1"))
    assert [t for t, _ in resumed] == [t for t, _ in plain[1:]]


def test_packing_windows_refuse_a_step_following_dataset():
    """data.pack_window streams the samples: no sampler could give them their step."""
    from types import SimpleNamespace

    from vlmtrain import compose

    cfg = SimpleNamespace(data=SimpleNamespace(pack_window=4, source="tagged", seed=0))
    with pytest.raises(ConfigError, match="StepTagged follows the training step.*data.pack_window: null"):
        compose._window_packing(cfg, {"train_dataset": StepTagged(8)})
