"""Preemption: SIGTERM / SIGUSR1 finish the current step, save a checkpoint and end training cleanly.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM or SIGUSR1 some time before they kill a job.
The handler only sets a flag; the Trainer checks it after each optimizer step (through an all-reduce under
torch.distributed, so every rank stops at the same step), saves ``checkpoint-<step>`` and returns. The CLI
then exits 0, and the resubmitted job resumes with ``resume_from_checkpoint: true``. Under ``vlmtrain train
--nproc N``, :func:`run_forwarding_signals` hands the signals the launcher receives to every rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from types import FrameType
from typing import Any

from .distributed import reduce_cpu

SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if s is not None)


class PreemptionGuard:
    """Context manager: while active, SIGTERM/SIGUSR1 set ``signal_received`` instead of killing the process.

    Handlers can only be installed from the main thread; elsewhere (e.g. a notebook's worker thread) the
    guard is inert and signals keep their usual effect.
    """

    def __init__(self) -> None:
        self.signal_received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signal_received = signum

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self) -> bool:
        """Whether any rank received a preemption signal (a collective under torch.distributed)."""
        return bool(reduce_cpu([float(self.signal_received is not None)], "max")[0])


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
