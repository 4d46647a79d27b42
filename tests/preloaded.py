"""Test processes that start with torch, transformers and vlmtrain already imported: each is forked from one
multiprocessing forkserver per test process, which imports them once (~6 CPU-seconds that every `python -m
vlmtrain` pays again). For tests that start many single-process runs (kill one, start the next): the child is a
process of its own, in a session of its own (os.killpg reaches it and nothing else), with the environment and the
output file it is given, exactly as a fresh interpreter would run the same command."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from pathlib import Path

PRELOAD = ["torch", "transformers.modeling_utils", "vlmtrain.cli", "vlmtrain.trainer", "tests.dist_fault_worker"]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def _child(target: str, argv: list[str], env: dict[str, str], log: str) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # (the forkserver imported torch before)
    module, name = target.split(":")
    sys.exit(getattr(importlib.import_module(module), name)(argv))


def start(target: str, argv: list[str], env: dict[str, str], log: Path) -> multiprocessing.process.BaseProcess:
    """Run ``module:function(argv)`` (its return value the exit code) in a preloaded child; its stdout and stderr
    go to ``log`` (the process's ``log``). The returned process has ``pid``, ``join()`` and ``exitcode``."""
    proc = _CTX.Process(target=_child, args=(target, list(argv), dict(env), str(log)), daemon=False)
    proc.start()
    proc.log = Path(log)
    return proc


def output(proc: multiprocessing.process.BaseProcess) -> str:
    """The exit code and the end of the process's output, for a failure message."""
    return f"exit code {proc.exitcode}: {proc.log.read_text()[-3000:]}"
