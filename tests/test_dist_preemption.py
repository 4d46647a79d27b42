"""Preemption of a multi-process run: a signal to `vlmtrain train --nproc 2` (or, as SLURM's --signal=B:USR1
delivers it, to the batch shell of docs/multi-gpu.md's recipe) reaches both ranks, which save one checkpoint at the
same step and exit 0; resuming it ends like an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.test_distributed import LM, vlmtrain

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def _config(tmp_path: Path) -> Path:
    cfg = json.loads(json.dumps(LM))
    # A constant learning rate: the interrupted run (max_steps 100000) and the straight one (max_steps N + 3)
    # take the same steps.
    cfg["train"].update(max_steps=100000, save_steps=100000, lr_scheduler_type="constant", eval_strategy="no",
                        predict_with_generate=False, per_device_train_batch_size=2)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _wait_for_training(out: Path, proc: subprocess.Popen) -> None:
    """Until rank 0 has logged a step: both ranks took part in it (DDP), so both have their preemption handlers
    in place, as has the launcher (it installs its forwarding handler as it starts torchrun)."""
    deadline = time.monotonic() + 300  # (a bound on a hang)
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.05)


def _one_checkpoint_from_both_ranks(out: Path) -> int:
    checkpoints = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    assert len(checkpoints) == 1, os.listdir(out)
    ckpt, step = checkpoints[0], int(checkpoints[0].name.split("-")[1])
    assert {"model.safetensors", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth", "loop_state_0.pt",
            "loop_state_1.pt"} <= set(os.listdir(ckpt)), os.listdir(ckpt)
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
    logged = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert max(logged) == step and 0 < step < 100000
    assert not any(p.name.startswith(".tmp") for p in out.iterdir())
    return step


def _train(cfg: Path, out: Path, *extra: str) -> None:
    """A 2-rank run to compare with (torchrun's rank environment, forked with their imports done: the launcher
    is what the first run of a test checks)."""
    vlmtrain(out.parent / f"{out.name}-logs", 2, "train", "--config", str(cfg), "--train.output_dir", str(out),
             *extra)


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "train_runtime" not in r}


def test_the_launcher_gives_torchrun_the_grace_period_and_sigusr1(tmp_path, monkeypatch):
    from vlmtrain import cli
    from vlmtrain import launch as preemption

    launched = []
    monkeypatch.setattr(preemption, "run_forwarding_signals", lambda cmd: launched.append(cmd) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(["train", "--config", str(_config(tmp_path)), "--nproc", "2",
                     "--train.preemption_grace_s", "300"]) == 0
    (cmd,) = launched
    assert "--shutdown-timeout=300" in cmd and "--nproc_per_node=2" in cmd
    assert "SIGUSR1" in next(a for a in cmd if a.startswith("--signals-to-handle="))
    assert cmd[cmd.index("vlmtrain") + 1:] == ["train", "--config", str(tmp_path / "cfg.yaml"),
                                               "--train.preemption_grace_s", "300"]
    assert cli.main(["train", "--config", str(tmp_path / "cfg.yaml"), "--nproc", "2",
                     "--train.preemption_grace_s", "0"]) == 2  # a config error, before any process starts


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_one_checkpoint_on_both_ranks_and_resumes_exactly(tmp_path):
    cfg, out = _config(tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "vlmtrain", "train", "--config", str(cfg), "--nproc", "2",
                             "--train.output_dir", str(out)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_training(out, proc)
    proc.send_signal(signal.SIGTERM)  # the launcher only: it hands the signal to the ranks
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert '"preempted": true' in log
    step = _one_checkpoint_from_both_ranks(out)

    end = str(step + 3)
    _train(cfg, out, "--train.max_steps", end, "--train.save_steps", end, "--train.resume_from_checkpoint", "true")
    straight = tmp_path / "straight"
    _train(cfg, straight, "--train.max_steps", end, "--train.save_steps", end)
    resumed_losses, straight_losses = _losses(out), _losses(straight)
    assert sorted(resumed_losses) == sorted(straight_losses) == list(range(1, step + 4))
    assert resumed_losses == straight_losses
    a = load_file(str(out / f"checkpoint-{end}" / "model.safetensors"))
    b = load_file(str(straight / f"checkpoint-{end}" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)


def _docs_sbatch_script() -> str:
    """docs/multi-gpu.md's single-node preemptible sbatch script (the bash block with --signal=B:USR1)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "multi-gpu.md").read_text(), flags=re.S)
    scripts = [b for b in blocks if "#SBATCH" in b and "--signal=B:USR1" in b]
    assert len(scripts) == 1, "docs/multi-gpu.md: expected one sbatch script with --signal=B:USR1"
    return scripts[0]


@pytest.mark.slow
def test_the_documented_slurm_recipe_forwards_usr1_from_the_batch_shell_to_the_ranks(tmp_path):
    """SLURM's --signal=B:USR1@120 signals only the batch shell; the recipe's trap hands it to the launcher."""
    script = tmp_path / "job.sbatch"
    script.write_text(_docs_sbatch_script())
    out = tmp_path / "run"
    bin_dir = tmp_path / "bin"  # `vlmtrain` on PATH runs this checkout
    bin_dir.mkdir()
    (bin_dir / "vlmtrain").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m vlmtrain "$@"\n')
    (bin_dir / "vlmtrain").chmod(0o755)
    env = {**ENV, "CONFIG": str(_config(tmp_path)), "OUTPUT_DIR": str(out), "SLURM_GPUS_ON_NODE": "2",
           "PATH": f"{bin_dir}:{ENV['PATH']}"}
    proc = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    _wait_for_training(out, proc)
    os.kill(proc.pid, signal.SIGUSR1)  # what slurmctld does at the --signal time: the batch shell only
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert '"preempted": true' in log
    _one_checkpoint_from_both_ranks(out)
