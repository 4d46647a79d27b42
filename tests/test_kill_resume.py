"""kill -9 of a whole training job at ten moments (five inside checkpoint writes), then resume: the run always
restarts from the newest complete checkpoint and ends with the same weights, the same metrics.jsonl rows (each step
once) and the same train_loss as an uninterrupted run; with synchronous and with asynchronous checkpoints. The run
stops itself at each chosen moment (tests/dist_fault_worker.py, FAULT=stop) and is killed there: where a kill
lands does not depend on the machine's speed. Each attempt is a process of its own, forked with its imports done
(tests/preloaded.py)."""

from __future__ import annotations

import json
import os
import signal
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests import preloaded
from tests.test_distributed import LM

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STEPS = 24


# Where each attempt is killed, and the newest complete checkpoint then (synchronous, asynchronous checkpoints:
# an asynchronous one is moved into place at the end of the step after its save). Every kill leaves a complete
# checkpoint: a run killed before its first one starts over, and metrics.jsonl then keeps the killed attempt's
# rows (a known gap, not what this test is about).
KILLS = [("step:4", 2, 2), ("write:4:1", 2, 2), ("step:6", 4, 4), ("write:8:2", 6, 6), ("step:9", 8, 6),
         ("write:10:1", 8, 8), ("step:14", 12, 12), ("write:16:3", 14, 14), ("step:19", 18, 16),
         ("write:22:2", 20, 20)]


def _start(cfg_path: Path, out: Path, *extra: str, stop: str | None = None, ready: Path | None = None
           ) -> BaseProcess:
    """One attempt, a process forked with its imports done (tests/preloaded.py): 21 attempts would otherwise
    import torch, transformers and vlmtrain 21 times. Its output goes to out's sibling ``<out>-<n>.log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "FAULT": "none"}
    if stop is not None:
        env.update(FAULT=f"stop:{stop}", FAULT_READY=str(ready))
    log = out.parent / f"{out.name}-{len(list(out.parent.glob(f'{out.name}-*.log')))}.log"
    return preloaded.start("tests.dist_fault_worker:main", ["train", "--config", str(cfg_path), "--train.output_dir",
                           str(out), "--train.resume_from_checkpoint", "true", *extra], env, log)


def _newest_checkpoint(out: Path) -> int:
    names = os.listdir(out) if out.is_dir() else []
    return max((int(n[11:]) for n in names if n.startswith("checkpoint-") and n[11:].isdigit()), default=0)


def _wait_until_stopped(proc: BaseProcess, ready: Path) -> None:
    deadline = time.monotonic() + 300  # (a bound on a hang)
    while not ready.exists():
        assert proc.is_alive(), f"the run ended before its stop: {preloaded.output(proc)}"
        assert time.monotonic() < deadline, "the run never reached its stop"
        time.sleep(0.01)


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl without wall-clock values (rates, runtime)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(("_per_second", "_fraction", "runtime"))}
            for line in open(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    """The config, and an uninterrupted run of it (synchronous checkpoints)."""
    tmp = tmp_path_factory.mktemp("kill")
    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(max_steps=STEPS, save_steps=2, save_total_limit=2, gradient_accumulation_steps=1,
                        logging_steps=1)
    cfg_path = tmp / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    proc = _start(cfg_path, tmp / "straight")
    proc.join(timeout=300)
    assert proc.exitcode == 0, preloaded.output(proc)
    return cfg_path, tmp / "straight"


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
def test_kill_9_at_ten_moments_then_resume_ends_like_an_uninterrupted_run(straight, tmp_path, async_checkpoint):
    cfg_path, straight_run = straight
    extra = ("--train.async_checkpoint", str(async_checkpoint).lower())
    out, kills = tmp_path / "killed", []
    for i, (stop, *_) in enumerate(KILLS):
        ready = tmp_path / f"stopped-{i}"
        proc = _start(cfg_path, out, *extra, stop=stop, ready=ready)
        try:
            _wait_until_stopped(proc, ready)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join(timeout=60)
        kills.append(_newest_checkpoint(out))
        assert any(n.startswith(".tmp-checkpoint-") for n in os.listdir(out)) or not stop.startswith("write")
    assert kills == [k[2 if async_checkpoint else 1] for k in KILLS], kills
    proc = _start(cfg_path, out, *extra)
    proc.join(timeout=300)
    assert proc.exitcode == 0, preloaded.output(proc)

    final = [load_file(str(run / f"checkpoint-{STEPS}" / "model.safetensors")) for run in (straight_run, out)]
    assert set(final[0]) == set(final[1])
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert not any(n.startswith(".tmp-") or n.endswith(".old") for n in os.listdir(out))
    # The logs too: each step's row once, in order, as the uninterrupted run logged it; train_loss (in the
    # summary row) averages the whole run, not the part after the last resume.
    rows, expected = _rows(out), _rows(straight_run)
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, STEPS + 1)), steps
    assert rows == expected
    losses = [[r["train_loss"] for r in run if "train_loss" in r] for run in (rows, expected)]
    assert len(losses[0]) == 1 and losses[0] == losses[1], losses
