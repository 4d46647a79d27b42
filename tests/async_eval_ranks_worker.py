"""Run under torchrun by tests/test_async_eval_ranks.py: a tiny DDP run with train.async_eval whose evaluation of
some checkpoints outlasts ddp_timeout. Rank 0 waits for them mid-run (async_eval_when_full: wait, one slot) and at
the end of training; every rank must wait with it. Writes each rank's final step and weights to OUT/rank<r>.pt.

With ``--config CONFIG OUT``: ``run.train`` of a config (the final evaluation of its eval set included), each
rank's returned metrics written to OUT/metrics<r>.pt."""

from __future__ import annotations

import os
import sys

import torch
from rank_sync_worker import Regression  # (beside this file: torchrun puts its folder on the path)

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.trainer import distributed as dist


def slow_evaluator(slow_steps: str, seconds: float) -> list[str]:
    """An evaluation command that takes ``seconds`` for the checkpoints of ``slow_steps`` (comma-separated), no
    time for the others, and writes a result naming its step."""
    script = ("import json, sys, time\n"
              "out, step = sys.argv[1:3]\n"
              f"if step in {slow_steps.split(',')!r}: time.sleep({seconds})\n"
              "open(out, 'w').write(json.dumps({'metrics': {'eval_fake_step': int(step)}}))\n")
    return [sys.executable, "-c", script, "{result_file}", "{step}"]


def main(out: str, max_steps: int, slow_steps: str, seconds: float, ddp_timeout: int) -> None:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(64, 4, generator=g)
    data = [{"x": x, "y": x.sum() * 0.5} for x in xs]
    torch.manual_seed(0)
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=0.05,
                             logging_steps=1, save_strategy="steps", save_steps=1, disable_tqdm=True,
                             report_to="none", ddp_timeout=ddp_timeout, seed=0, async_eval=True,
                             async_eval_command=slow_evaluator(slow_steps, seconds), async_eval_max_pending=1,
                             async_eval_when_full="wait")
    trainer = Trainer(Regression(), args, train_dataset=data)
    result = trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    # What a script does next under torchrun (gather, save, evaluate) is a collective: every rank is there.
    everyone = dist.all_gather_objects(result.global_step)
    torch.save({"weights": weights, "global_step": result.global_step, "everyone": everyone},
               os.path.join(out, f"rank{trainer.rank}.pt"))
    dist.shutdown()


def run_config(config: str, out: str) -> None:
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    metrics = run.train(load_run_config(config))
    torch.save(metrics, os.path.join(out, f"metrics{dist.rank()}.pt"))
    dist.shutdown()


if __name__ == "__main__" and sys.argv[1] == "--config":
    run_config(sys.argv[2], sys.argv[3])
elif __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5]))
