"""`vlmtrain train|predict --nproc N`: the ranks run under torchrun (through vlmtrain.torchrun_errors, so that an
error the user can act on prints as one line), and a preemption signal sent to this process reaches each of them
(see vlmtrain.trainer.preemption: they finish the step, save a checkpoint and exit 0)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import FrameType

from . import torchrun_errors
from .trainer.preemption import SIGNALS

# Runs torchrun_errors.py as a file (runpy.run_path leaves sys.path alone, so its directory, the package's,
# cannot shadow the standard library): the launcher needs torch, not the package.
_RUN_FILE = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"


def torchrun_command(nproc: int, args: list[str], *options: str) -> list[str]:
    """The command line that runs ``vlmtrain ARGS`` in ``nproc`` processes on this node (torchrun --standalone,
    with torchrun's ``options``)."""
    return [sys.executable, "-c", _RUN_FILE, torchrun_errors.__file__, "--standalone", f"--nproc_per_node={nproc}",
            *options, "-m", "vlmtrain", *args]


def cpu_note(nproc: int) -> str | None:
    """What to tell the user before starting ``nproc`` processes on a machine without a GPU (None with GPUs)."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"note: no GPU found: --nproc {nproc} starts {nproc} processes on the CPU (torch.distributed's gloo "
            f"backend), sharing its {os.cpu_count()} cores.")


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
