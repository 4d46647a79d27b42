"""Run under torchrun by tests/test_distributed.py: `vlmtrain train ...` with a fault injected on one rank.

FAULT=diskfull:<rank>:<step> makes every torch.save on that rank raise ENOSPC once the run reaches that step.
FAULT=slow:<save_s>:<step_s> sleeps that long in every torch.save and every training step: a run lasts long
enough to be killed at chosen moments, checkpoint writes included (works without torchrun too).
"""

from __future__ import annotations

import errno
import os
import sys

import torch

from vlmtrain import cli


def _inject_disk_full(rank: int, step: int) -> None:
    if int(os.environ.get("RANK", "0")) != rank:
        return
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if f"checkpoint-{step}" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def _slow_down(save_s: float, step_s: float) -> None:
    import time

    from vlmtrain import Trainer

    real_save, real_step = torch.save, Trainer.training_step

    def save(*args, **kwargs):
        time.sleep(save_s)
        return real_save(*args, **kwargs)

    def training_step(self, *args, **kwargs):
        time.sleep(step_s)
        return real_step(self, *args, **kwargs)

    torch.save, Trainer.training_step = save, training_step


if __name__ == "__main__":
    kind, *params = os.environ["FAULT"].split(":")
    if kind == "diskfull":
        _inject_disk_full(int(params[0]), int(params[1]))
    elif kind == "slow":
        _slow_down(float(params[0]), float(params[1]))
    sys.exit(cli.main(sys.argv[1:]))
