"""kill -9 of a whole training job at random moments (checkpoint writes included), then resume: the run always
restarts from the newest complete checkpoint and ends with the same weights, the same metrics.jsonl rows (each step
once) and the same train_loss as an uninterrupted run; with synchronous and with asynchronous checkpoints."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.test_distributed import LM

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
STEPS = 24


def _start(cfg_path: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
           "FAULT": "slow:0.03:0.02"}  # slow saves and steps: a wide window to kill in
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist_fault_worker.py"), "train", "--config",
                             str(cfg_path), "--train.output_dir", str(out), "--train.resume_from_checkpoint", "true", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _newest_checkpoint(out: Path) -> int:
    names = os.listdir(out) if out.is_dir() else []
    return max((int(n[11:]) for n in names if n.startswith("checkpoint-") and n[11:].isdigit()), default=0)


def _last_step(metrics: Path) -> float:
    lines = metrics.read_text().splitlines()
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except ValueError:  # a row cut short by the previous kill
        return 0


def _wait_for_training(out: Path, proc: subprocess.Popen, since: float, resumed_at: int) -> bool:
    """Until this attempt logs its first step (after checkpoint `resumed_at`; the rows a killed attempt logged
    after that checkpoint are dropped when the run starts); False if the run ended first."""
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.is_file() and metrics.stat().st_mtime > since and _last_step(metrics) > resumed_at:
            return True
        time.sleep(0.005)
    return False


def _wait_for_steps(out: Path, proc: subprocess.Popen, steps: int) -> bool:
    """Until `steps` more steps are logged (logging_steps 1); False if the run ended first. Counting steps, not
    seconds: a process's first checkpoint write is slow (~0.35 s vs ~0.15 s), and a wall-clock window sized for
    one machine kept killing every resumed run before its first save on another."""
    metrics = out / "metrics.jsonl"
    target = len(metrics.read_text().splitlines()) + steps
    while proc.poll() is None:
        if len(metrics.read_text().splitlines()) >= target:
            return True
        time.sleep(0.002)
    return False


def _wait_for_checkpoint_after(out: Path, proc: subprocess.Popen, step: int) -> bool:
    while proc.poll() is None:
        if _newest_checkpoint(out) > step:
            return True
        time.sleep(0.002)
    return False


def _wait_for_checkpoint_write(out: Path, proc: subprocess.Popen) -> bool:
    while proc.poll() is None:
        if any(n.startswith(".tmp-checkpoint-") for n in os.listdir(out)):
            return True
        time.sleep(0.002)
    return False


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
    assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
    return cfg_path, tmp / "straight"


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["sync", "async"])
def test_kill_9_at_ten_random_moments_then_resume_ends_like_an_uninterrupted_run(straight, tmp_path, async_checkpoint):
    cfg_path, straight_run = straight
    extra = ("--train.async_checkpoint", str(async_checkpoint).lower())
    rng, out, kills, in_write, attempts = random.Random(0), tmp_path / "killed", [], 0, 0
    while True:
        attempts += 1
        assert attempts < 40, f"the killed run never finished (kills: {kills})"
        since, resumed_at = time.time() - 0.001, _newest_checkpoint(out)
        proc = _start(cfg_path, out, *extra)
        if len(kills) >= 10 or not _wait_for_training(out, proc, since, resumed_at):
            assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
            break
        during_write = len(kills) % 2 == 1  # every other kill lands inside a checkpoint write
        if during_write:
            hit = _wait_for_checkpoint_write(out, proc)
        else:  # 0-4 more steps, then anywhere inside a step or a save
            # (async: after this attempt's first checkpoint is in place, which may take several steps: a new
            # process's first write is slow, ~1 s here, and other kills would leave every attempt without one)
            hit = not async_checkpoint or _wait_for_checkpoint_after(out, proc, resumed_at)
            hit = hit and _wait_for_steps(out, proc, rng.randint(0, 4))
            time.sleep(rng.uniform(0.0, 0.1))
            hit = hit and proc.poll() is None
        if not hit:  # the run finished before the chosen moment
            assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        kills.append(_newest_checkpoint(out))
        in_write += during_write
    print("newest complete checkpoint at each kill:", kills)
    assert len(kills) >= 10 and in_write >= 5, kills
    assert len(set(kills)) > 3, f"kills did not spread over the run: newest checkpoint at each kill {kills}"

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
