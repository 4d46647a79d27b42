"""Run under torchrun by tests/test_rank_sync.py: a tiny DDP run in which the collator on one rank drops every
sample of one micro-batch (all bad), as a real collator does with corrupt images. Writes each rank's final
weights and counts to OUT/rank<r>.pt."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from vlmtrain import Trainer, TrainingArguments


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}


class BadOnOneRank:
    """Stacks samples; on rank ``bad_rank`` the ``bad_call``-th batch has only bad samples (an empty batch)."""

    def __init__(self, bad_rank: int, bad_call: int) -> None:
        self.rank, self.bad_rank, self.bad_call, self.calls = int(os.environ.get("RANK", "0")), bad_rank, bad_call, 0

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict:
        self.calls += 1
        if self.rank == self.bad_rank and self.calls == self.bad_call:
            return {"skipped": {"corrupt_image": len(samples)}, "skipped_keys": ["bad-0"]}
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def main(out: str, bad_rank: int, bad_call: int, accum: int) -> None:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(64, 4, generator=g)
    data = [{"x": x, "y": x.sum() * 0.5} for x in xs]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=out, max_steps=6, per_device_train_batch_size=4, learning_rate=0.05,
                             gradient_accumulation_steps=accum, logging_steps=1, save_strategy="no",
                             disable_tqdm=True, report_to="none", ddp_timeout=60, seed=0,
                             max_bad_sample_fraction=1.0)  # one all-bad batch in a one-step log window
    trainer = Trainer(Regression(), args, data_collator=BadOnOneRank(bad_rank, bad_call), train_dataset=data)
    result = trainer.train()
    torch.save({"weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                "global_step": result.global_step, "metrics": result.metrics,
                "skipped": dict(trainer._throughput.skipped_total)},
               os.path.join(out, f"rank{trainer.rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
