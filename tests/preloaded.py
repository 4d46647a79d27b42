"""Test processes that start with torch, transformers and vlmtrain already imported: each is forked from one
multiprocessing forkserver per test process, which imports them once (~6 CPU-seconds that every `python -m
vlmtrain` and every torchrun rank pays again). The child is a process of its own, in a session of its own
(os.killpg reaches it and nothing else), with the environment and the output file it is given, running the
command as a fresh interpreter would. :func:`launch` starts several as torchrun starts its ranks, for tests that
are about the ranks, not about the launcher."""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "transformers.modeling_utils", "vlmtrain.cli", "vlmtrain.trainer"]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def _child(target: str, argv: list[str], env: dict[str, str], log: str, err: str | None) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if err else fd, 2)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # (the forkserver imported torch before)
    # the platform's default start method, as in a fresh interpreter (a forkserver's child inherits "forkserver":
    # a DataLoader's workers would then pickle the dataset)
    multiprocessing.set_start_method(None, force=True)
    for path in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):  # (what the command's PYTHONPATH adds)
        if path and path not in sys.path:
            sys.path.insert(0, path)
    module, name = target.split(":")
    try:
        code = getattr(importlib.import_module(module), name)(argv)
    finally:
        atexit._run_exitfuncs()  # (multiprocessing ends its children with os._exit: an interpreter runs these)
    sys.exit(code)


def run_script(argv: list[str]) -> int:
    """``python SCRIPT ARGS...`` (argv: the script's path, then its arguments), as a target for start/launch."""
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # (as python puts a script's folder first)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def start(target: str, argv: list[str], env: dict[str, str], log: Path, err: Path | None = None) -> BaseProcess:
    """Run ``module:function(argv)`` (its return value the exit code) in a preloaded child; its stdout and stderr
    go to ``log`` (the process's ``log``; stderr to ``err`` where given, the process's ``err``). The returned
    process has ``pid``, ``join()`` and ``exitcode``."""
    proc = _CTX.Process(target=_child, args=(target, list(argv), dict(env), str(log), err and str(err)),
                        daemon=False)
    proc.start()
    proc.log, proc.err = Path(log), err and Path(err)
    return proc


def output(proc: BaseProcess) -> str:
    """The exit code and the end of the process's output, for a failure message."""
    text = proc.log.read_text()[-3000:] + (proc.err.read_text()[-3000:] if proc.err else "")
    return f"exit code {proc.exitcode}: {text}"


def launch(target: str, argv: list[str], env: dict[str, str], nproc: int, log_dir: Path,
           timeout: float = 300, end_others: bool = True, stderr_apart: bool = False) -> tuple[list[int | None], str]:
    """``nproc`` ranks of ``module:function(argv)`` with torchrun's rank environment (RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT on a free port; for 1, a plain process without them); as
    torchrun, the first rank to fail ends the others (``end_others=False``: each rank must end by itself).
    Returns the ranks' exit codes (None: still running after ``timeout`` seconds, then killed) and the end of
    their output (rank by rank, for a failure message; each rank's whole output is log_dir/rank<r>.log, or with
    ``stderr_apart`` its stdout, its stderr in log_dir/rank<r>.err)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
              "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} for r in range(nproc)]
    if nproc == 1:
        ranks = [{}]  # one plain process, as `python SCRIPT` (no torchrun)
    procs = [start(target, argv, {**env, **rank}, Path(log_dir) / f"rank{r}.log",
                   Path(log_dir) / f"rank{r}.err" if stderr_apart else None) for r, rank in enumerate(ranks)]
    running, deadline = {p.sentinel: p for p in procs}, time.monotonic() + timeout
    while running:
        ended = multiprocessing.connection.wait(list(running), max(0.0, deadline - time.monotonic()))
        if not ended:  # (a bound on a hang)
            break
        for sentinel in ended:
            proc = running.pop(sentinel)
            proc.join()
            if proc.exitcode != 0 and end_others:
                running = {}
    codes = [p.exitcode for p in procs]
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    text = "".join(f"--- rank {r} ---\n{output(p)}\n" for r, p in enumerate(procs))
    return codes, text
