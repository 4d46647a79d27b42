"""Preemption: SIGTERM / SIGUSR1 finish the current step, save a checkpoint and end training cleanly.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM or SIGUSR1 some time before they kill a job.
The handler only sets a flag; the Trainer checks it after each optimizer step (through an all-reduce under
torch.distributed, so every rank stops at the same step), saves ``checkpoint-<step>`` and returns. The CLI
then exits 0, and the resubmitted job resumes with ``resume_from_checkpoint: true``. Under ``vlmtrain train
--nproc N``, vlmtrain.launch hands the signals the launcher receives to every rank.
"""

from __future__ import annotations

import signal
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
