"""Run by tests/test_ckpt_ranks.py, as one process or as ranks (tests/preloaded.py): a tiny regression on 40 samples with ids
(in order, batch 2, accumulation 2, one epoch, a checkpoint every 2 steps) whose collator empties every batch
of the ``bad`` ids (an all-bad batch, on one rank). It stops after the checkpoint at ``stop_at`` (0: never) or
resumes the newest one (``resume``), and writes the ids each of its steps trained on each rank, and its final
state, to OUT/<phase>-rank<r>.json."""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

from vlmtrain import Trainer, TrainerCallback, TrainingArguments


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        self.seen += idx.tolist()
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


class EmptiesBad:
    """Stacks samples; a batch of only ``bad`` ids comes out empty (counted), as a collator with corrupt images."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def __call__(self, samples: list[dict]) -> dict:
        if all(int(s["idx"]) in self.bad for s in samples):
            return {"skipped": {"corrupt_image": len(samples)}}
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}


class StepIds(TrainerCallback):
    """The ids each optimizer step trained here; stops after the checkpoint at ``stop_at``."""

    def __init__(self, model: Regression, stop_at: int) -> None:
        self.model, self.stop_at, self.start, self.steps = model, stop_at, 0, {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = len(self.model.seen)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps[state.global_step] = self.model.seen[self.start:]
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def main(out: str, phase: str, stop_at: int, resume: bool, bad: set[int]) -> None:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(40, 4, generator=g)
    data = [{"x": x, "y": x.sum() * 0.5, "idx": i} for i, x in enumerate(xs)]
    torch.manual_seed(0)
    model = Regression()
    args = TrainingArguments(output_dir=out, num_train_epochs=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=0.05, weight_decay=0.1, logging_steps=1,
                             save_steps=2, disable_tqdm=True, report_to="none", ddp_timeout=60, seed=0,
                             train_sampling_strategy="sequential", max_bad_sample_fraction=1.0)
    ids = StepIds(model, stop_at)
    trainer = Trainer(model, args, data_collator=EmptiesBad(bad), train_dataset=data, callbacks=[ids])
    trainer.train(resume_from_checkpoint=True if resume else None)
    with open(os.path.join(out, f"{phase}-rank{trainer.rank}.json"), "w") as f:
        json.dump({"steps": ids.steps, "global_step": trainer.state.global_step,
                   "max_steps": trainer.state.max_steps, "epoch": trainer.state.epoch}, f)


def run(argv: list[str]) -> int:
    """main() from the command line's arguments (also called in a preloaded process, tests/preloaded.py)."""
    main(argv[0], argv[1], int(argv[2]), argv[3] == "resume", {int(i) for i in argv[4].split(",") if i})
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
