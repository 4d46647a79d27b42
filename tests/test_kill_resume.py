"""kill -9 of a whole training job at random moments (checkpoint writes included), then resume: the run always
restarts from the newest complete checkpoint and ends with the same weights as an uninterrupted run."""

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


def _start(cfg_path: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
           "FAULT": "slow:0.03:0.02"}  # slow saves and steps: a wide window to kill in
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist_fault_worker.py"), "train", "--config",
                             str(cfg_path), "--train.output_dir", str(out), "--train.resume_from_checkpoint", "true"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_for_training(out: Path, proc: subprocess.Popen, since: float) -> bool:
    """Until this attempt writes its first log line (training is under way); False if the run ended first."""
    metrics = out / "metrics.jsonl"
    while proc.poll() is None:
        if metrics.is_file() and metrics.stat().st_mtime > since:
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


def _wait_for_checkpoint_write(out: Path, proc: subprocess.Popen) -> bool:
    while proc.poll() is None:
        if any(n.startswith(".tmp-checkpoint-") for n in os.listdir(out)):
            return True
        time.sleep(0.002)
    return False


def test_kill_9_at_ten_random_moments_then_resume_ends_like_an_uninterrupted_run(tmp_path):
    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(max_steps=STEPS, save_steps=2, save_total_limit=2, gradient_accumulation_steps=1,
                        logging_steps=1)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))

    straight = _start(cfg_path, tmp_path / "straight")
    assert straight.wait(timeout=300) == 0, straight.stdout.read()[-3000:]

    rng, out, kills, in_write, attempts = random.Random(0), tmp_path / "killed", [], 0, 0
    while True:
        attempts += 1
        assert attempts < 40, f"the killed run never finished (kills: {kills})"
        since = time.time() - 0.001
        proc = _start(cfg_path, out)
        if len(kills) >= 10 or not _wait_for_training(out, proc, since):
            assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
            break
        during_write = len(kills) % 2 == 1  # every other kill lands inside a checkpoint write
        if during_write:
            hit = _wait_for_checkpoint_write(out, proc)
        else:  # 0-4 more steps, then anywhere inside a step or a save
            hit = _wait_for_steps(out, proc, rng.randint(0, 4))
            time.sleep(rng.uniform(0.0, 0.1))
            hit = hit and proc.poll() is None
        if not hit:  # the run finished before the chosen moment
            assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        newest = max((int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("checkpoint-")), default=0)
        kills.append(newest)
        in_write += during_write
    print("newest complete checkpoint at each kill:", kills)
    assert len(kills) >= 10 and in_write >= 5, kills
    assert len(set(kills)) > 3, f"kills did not spread over the run: newest checkpoint at each kill {kills}"

    final = [load_file(str(run / f"checkpoint-{STEPS}" / "model.safetensors")) for run in (tmp_path / "straight", out)]
    assert set(final[0]) == set(final[1])
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert not any(n.startswith(".tmp-") or n.endswith(".old") for n in os.listdir(out))
