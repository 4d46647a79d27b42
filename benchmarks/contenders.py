"""What the TRL-vs-vlmtrain benchmarks (preference.py, grpo.py) share: each contender's trainer classes, a step
clock, and running each contender in a fresh process (so each peak resident memory is its own)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

CONTENDERS = ("trl", "vlmtrain")


def trainer_classes(contender: str, name: str) -> tuple[Any, Any]:
    """(``<name>Config``, ``<name>Trainer``) of TRL or of vlmtrain, e.g. ``name="GRPO"``."""
    if contender == "trl":
        import trl as module
    else:
        import vlmtrain as module
    return getattr(module, f"{name}Config"), getattr(module, f"{name}Trainer")


def step_clock(stamps: list[float]) -> Any:
    """A TrainerCallback appending ``time.perf_counter()`` to ``stamps`` at each step's end (after a CUDA sync on a
    GPU, so that a stamp is taken when the step's kernels are done, not when they were queued)."""
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, D102
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

    return Clock()


def run_contenders(script: str, path: str, opts: argparse.Namespace) -> dict[str, dict]:
    """Each contender's result: ``script --one CONTENDER --path PATH`` with ``opts`` in a fresh process, the JSON of
    its last line, printed as it comes (a run cut short by a time limit still shows the contenders done). A
    contender that fails ends the run with its exit status and the end of its stderr."""
    results = {}
    for contender in CONTENDERS:
        out = subprocess.run([sys.executable, script, "--one", contender, "--path", path, *contender_flags(opts)],
                             capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{contender} failed (exit {out.returncode}):\n{out.stderr[-6000:]}")
        results[contender] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{contender}: {json.dumps(results[contender])}", flush=True)
    return results


def contender_flags(opts: argparse.Namespace) -> list[str]:
    """``opts`` as the command-line flags that parse back to them in a contender's process (``--image-size=448``,
    ``--lora``; an unset or false option left out: its default), the parent's ``--one`` / ``--path`` aside."""
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(opts).items()
            if k not in ("one", "path") and v is not None and v is not False]


def add_contender_options(parser: argparse.ArgumentParser) -> None:
    """``--threads`` (torch threads per contender) and the child process's hidden ``--one`` / ``--path``."""
    parser.add_argument("--threads", type=int, default=2, help="torch threads per contender")
    parser.add_argument("--one", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
