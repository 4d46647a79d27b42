"""Preemption: SIGTERM/SIGUSR1 finish the step, save a checkpoint, end cleanly; resuming continues exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.tiny import tiny_llama, token_samples
from vlmtrain import Trainer, TrainerCallback, TrainingArguments

ROOT = Path(__file__).resolve().parents[1]


class SignalAt(TrainerCallback):
    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig = step, sig

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def _args(out, **kw):
    return TrainingArguments(**{"output_dir": str(out), "max_steps": 12, "per_device_train_batch_size": 4,
                                "learning_rate": 1e-3, "logging_steps": 1, "save_strategy": "steps",
                                "save_steps": 100, "disable_tqdm": True, "report_to": "none", "seed": 0, **kw})


def test_sigterm_saves_the_current_step_and_resume_matches_a_straight_run(tmp_path):
    data = token_samples(64, seed=1)
    straight = Trainer(tiny_llama(), _args(tmp_path / "straight"), train_dataset=data)
    straight.train()
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        out = tmp_path / f"preempted-{sig}"
        # transformers' enable_jit_checkpoint (its checkpoint on SIGTERM) is this checkpoint, always on
        jit = {"enable_jit_checkpoint": True} if sig == signal.SIGTERM else {}
        trainer = Trainer(tiny_llama(), _args(out, **jit), train_dataset=data, callbacks=[SignalAt(5, sig)])
        result = trainer.train()
        assert trainer.preempted and result.global_step == 5
        assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-5"]
        assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)  # handlers restored
        resumed = Trainer(tiny_llama(seed=9), _args(out, **jit), train_dataset=data)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 12 and not resumed.preempted
        a, b = straight.model.state_dict(), resumed.model.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_cli_exits_0_with_a_checkpoint_on_sigterm(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((ROOT / "configs" / "addition-tiny.yaml").read_text())
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "vlmtrain", "train", "--config", str(cfg),
                             "--train.output_dir", str(out), "--train.max_steps", "100000",
                             "--train.logging_steps", "1", "--train.eval_strategy", "no",
                             "--train.disable_tqdm", "true"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # (a bound on a hang)
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # step 1 is logged: the preemption handler is in place
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    checkpoints = [p for p in out.iterdir() if p.name.startswith("checkpoint-")]
    assert len(checkpoints) == 1 and '"preempted": true' in stdout
    step = int(checkpoints[0].name.split("-")[1])
    logged = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert max(logged) == step and 0 < step < 100000
    assert (checkpoints[0] / "model.safetensors").is_file() and (checkpoints[0] / "trainer_state.json").is_file()


def test_a_full_disk_during_a_save_is_a_clear_error_and_older_checkpoints_resume(tmp_path, monkeypatch):
    import errno

    import pytest

    data = token_samples(64, seed=1)
    args = _args(tmp_path / "run", save_steps=4)
    straight = Trainer(tiny_llama(), _args(tmp_path / "straight"), train_dataset=data)
    straight.train()
    real_save = torch.save

    def full_disk(obj, path, *a, **kw):
        if "checkpoint-8" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"could not write checkpoint-8 .*No space left on device.*untouched "
                                      r"\(checkpoint-4\)"):
        Trainer(tiny_llama(), args, train_dataset=data).train()
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if "checkpoint" in p.name) == ["checkpoint-4"]
    monkeypatch.setattr(torch, "save", real_save)
    resumed = Trainer(tiny_llama(seed=5), args, train_dataset=data)
    resumed.train(resume_from_checkpoint=True)  # picks checkpoint-4 and finishes like a straight run
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert resumed.state.global_step == 12 and all(torch.equal(a[k], b[k]) for k in a)
