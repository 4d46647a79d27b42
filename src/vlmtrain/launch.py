"""`vlmtrain train --nproc N`: the ranks run under torchrun, and a preemption signal sent to this process reaches
each of them (see vlmtrain.trainer.preemption: they finish the step, save a checkpoint and exit 0)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from types import FrameType

from .trainer.preemption import SIGNALS


def _ranks_of(launcher: int) -> list[int]:
    """The worker processes (the ranks: LOCAL_RANK in their environment) that torchrun ``launcher`` started."""
    ranks = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == launcher:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if b"LOCAL_RANK=" in f.read():
                        ranks.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return ranks


def run_forwarding_signals(cmd: list[str]) -> int:
    """Run a torchrun command line and return its exit code. SIGTERM/SIGUSR1 sent to this process meanwhile go
    straight to the ranks, which finish the step, agree on it, save and exit 0, so that torchrun then ends
    normally (torchrun itself, signalled, would stop the ranks and fail the job). A signal that comes before
    the ranks exist goes to torchrun."""
    proc = subprocess.Popen(cmd)

    def forward(signum: int, frame: FrameType | None) -> None:
        for pid in _ranks_of(proc.pid) or [proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in SIGNALS}
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Ctrl-C reached torchrun too: let it stop its ranks before we return
        proc.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
