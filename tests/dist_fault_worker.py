"""Run under torchrun by tests/test_distributed.py: `vlmtrain train ...` with a fault injected on one rank.

FAULT=diskfull:<rank>:<step> makes every torch.save on that rank raise ENOSPC once the run reaches that step.
FAULT=slow:<save_s>:<step_s> sleeps that long in every torch.save and every training step.
FAULT=stop:step:<s> or stop:write:<s>:<k> (one process, no torchrun) stops the run at a chosen moment for the
test to kill it there: at the start of step s, or inside the k-th torch.save into checkpoint-s's temporary
directory. The process creates the file FAULT_READY once it is there and then blocks. So that the state at the
kill does not depend on timing, every step also starts only once the background checkpoint writer
(train.async_checkpoint) is done; a write stopped in the writer thread is signalled by the main thread at the
start of step s + 1.
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


def _stop_at(where: str, step: int, nth_save: int = 0) -> None:
    import threading

    from vlmtrain import Trainer
    from vlmtrain.trainer.checkpoint import TMP_PREFIX

    real_save, real_step = torch.save, Trainer.training_step
    write_held, saves = threading.Event(), [0]

    def stop_here() -> None:
        open(os.environ["FAULT_READY"], "w").close()
        threading.Event().wait()  # until killed

    def save(obj, f, *args, **kwargs):
        if where == "write" and f"{TMP_PREFIX}{step}" in str(f):
            saves[0] += 1
            if saves[0] == nth_save:
                write_held.set()
                if threading.current_thread() is threading.main_thread():
                    stop_here()
                threading.Event().wait()  # (the writer thread) the main thread signals at step + 1
        return real_save(obj, f, *args, **kwargs)

    def training_step(self, *args, **kwargs):
        starting = self.state.global_step + 1
        if where == "write" and starting == step + 1 and self._async_saver is not None:
            write_held.wait()
            stop_here()
        for thread in threading.enumerate():
            if thread.name.startswith("vlmtrain-checkpoint"):
                thread.join()
        if where == "step" and starting == step:
            stop_here()
        return real_step(self, *args, **kwargs)

    torch.save, Trainer.training_step = save, training_step


def main(argv: list[str]) -> int:
    """`vlmtrain <argv>` with the fault that the environment's FAULT names (also called in a process forked from a
    preloaded one, tests/preloaded.py)."""
    kind, *params = os.environ["FAULT"].split(":")
    if kind == "diskfull":
        _inject_disk_full(int(params[0]), int(params[1]))
    elif kind == "slow":
        _slow_down(float(params[0]), float(params[1]))
    elif kind == "stop":
        _stop_at(params[0], *map(int, params[1:]))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
