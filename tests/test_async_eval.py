"""train.async_eval: saved checkpoints are evaluated by other processes while training goes on; results are
logged once at their checkpoint's step, whatever happens to the evaluation or to the training process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from optional_extras import requires

from vlmtrain import cli, run
from vlmtrain.config import load_run_config
from vlmtrain.trainer.callbacks import TrainerCallback

ROOT = Path(__file__).resolve().parents[1]
LM = {
    "model": {"kind": "causal_lm", "config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 2, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "max_position_embeddings": 32}},
    "data": {"source": "addition", "num_train": 256, "num_eval": 8, "packing": False},
    "train": {"max_steps": 4, "learning_rate": 3e-3, "logging_steps": 1, "eval_strategy": "no",
              "save_strategy": "steps", "save_steps": 2, "disable_tqdm": True, "seed": 3, "async_eval": True},
}


def fake_evaluator(seconds: float = 0.0, code: int = 0, result: str = "ok") -> list[str]:
    """An evaluation command that sleeps, checks its checkpoint is there, then writes a result naming its step
    (result 'ok'), a corrupt one ('corrupt') or none ('none'), and exits with ``code``."""
    script = ("import json, os, sys, time\n"
              f"time.sleep({seconds})\n"
              "checkpoint, out, step = sys.argv[1:4]\n"
              "assert os.path.isfile(os.path.join(checkpoint, 'trainer_state.json')), checkpoint\n"
              f"text = json.dumps({{'metrics': {{'eval_fake_step': int(step)}}}}) if {result!r} == 'ok' else '{{not'\n"
              f"if {result!r} != 'none': open(out, 'w').write(text)\n"
              f"sys.exit({code})\n")
    return [sys.executable, "-c", script, "{checkpoint}", "{result_file}", "{step}"]


def _config(tmp_path: Path, **train) -> tuple[Path, object]:
    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(output_dir=str(tmp_path / "run"), **train)
    path = tmp_path / "cfg.yaml"
    tmp_path.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path, load_run_config(path)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _async_rows(run_dir: Path) -> dict[int, list[dict]]:
    rows: dict[int, list[dict]] = {}
    for row in _rows(run_dir):
        if row.get("eval_async"):
            rows.setdefault(row["step"], []).append(row)
    return rows


class StepClock(TrainerCallback):
    """Wall time from the start of training to the end of its last step (evaluations waited for after it
    are not steps)."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == state.max_steps:
            self.steps_time = time.perf_counter() - self.start


def _train(cfg, clock: StepClock | None = None):
    trainer = run.build(cfg)
    if clock is not None:
        trainer.add_callback(clock)
    return trainer, trainer.train()


def test_async_results_for_each_checkpoint_equal_inline_evaluation_at_that_step(tmp_path):
    path, _ = _config(tmp_path, eval_strategy="steps", eval_steps=2)
    assert cli.main(["train", "--config", str(path)]) == 0  # the default command: vlmtrain eval in a subprocess
    run_dir = tmp_path / "run"
    inline = {r["step"]: r for r in _rows(run_dir) if "eval_loss" in r and not r.get("eval_async")}
    async_rows = _async_rows(run_dir)
    assert sorted(inline) == sorted(async_rows) == [2, 4]
    for step, (row,) in async_rows.items():
        assert row["eval_checkpoint"] == f"checkpoint-{step}" and row["eval_arrived_step"] >= step
        assert abs(row["eval_loss"] - inline[step]["eval_loss"]) < 1e-6, (row, inline[step])
        assert row["eval_samples"] == inline[step]["eval_samples"] == 8


def test_a_slow_evaluator_does_not_slow_training_steps(tmp_path):
    _, plain = _config(tmp_path / "plain", async_eval=False, max_steps=8)
    plain_clock = StepClock()
    _train(plain, plain_clock)
    _, slow = _config(tmp_path / "slow", max_steps=8, async_eval_command=fake_evaluator(seconds=2.0),
                      async_eval_max_pending=4)
    slow_clock = StepClock()
    start = time.perf_counter()
    _train(slow, slow_clock)
    total = time.perf_counter() - start
    # Evaluated inline, the 4 checkpoints would add 4 x 2 s to the steps; here the steps run beside them, and
    # train() waits for the evaluations at the end (measured: ~0.5 s of steps either way, 2.6 s in all).
    assert slow_clock.steps_time < 2 * plain_clock.steps_time + 1.5, (slow_clock.steps_time, plain_clock.steps_time)
    assert total >= 2.0  # it did wait for the last evaluations
    rows = _async_rows(tmp_path / "slow" / "run")
    assert {s: [r["eval_fake_step"] for r in rs] for s, rs in rows.items()} == {2: [2], 4: [4], 6: [6], 8: [8]}


def test_when_full_skip_logs_the_skipped_checkpoint_and_wait_evaluates_every_one(tmp_path):
    _, skip = _config(tmp_path / "skip", save_steps=1, async_eval_command=fake_evaluator(seconds=1.5),
                      async_eval_when_full="skip")
    _train(skip)
    rows = _async_rows(tmp_path / "skip" / "run")
    assert sorted(rows) == [1, 2, 3, 4] and all(len(r) == 1 for r in rows.values())
    skipped = [s for s, (r,) in rows.items() if "eval_async_status" in r]
    assert skipped and 1 not in skipped and all("skipped" in rows[s][0]["eval_async_status"] for s in skipped)
    assert rows[1][0]["eval_fake_step"] == 1
    _, wait = _config(tmp_path / "wait", save_steps=1, async_eval_command=fake_evaluator(seconds=0.3))
    _train(wait)
    rows = _async_rows(tmp_path / "wait" / "run")
    assert {s: [r.get("eval_fake_step") for r in rs] for s, rs in rows.items()} == {1: [1], 2: [2], 3: [3], 4: [4]}


def test_failed_timed_out_and_corrupt_evaluations_are_logged_rows_not_training_failures(tmp_path):
    _, failing = _config(tmp_path / "fail", async_eval_command=fake_evaluator(code=3))
    _, out = _train(failing)
    assert out.global_step == 4
    rows = _async_rows(tmp_path / "fail" / "run")
    for step in (2, 4):
        (row,) = rows[step]
        log = tmp_path / "fail" / "run" / "async_eval" / f"step-{step}.log"
        assert "exit code 3" in row["eval_async_error"] and str(log) in row["eval_async_error"] and log.is_file()

    _, slow = _config(tmp_path / "timeout", max_steps=2, async_eval_command=fake_evaluator(seconds=30),
                      async_eval_timeout_s=1)
    start = time.perf_counter()
    _train(slow)
    assert time.perf_counter() - start < 25
    ((row,),) = _async_rows(tmp_path / "timeout" / "run").values()
    assert "timed out after 1 s" in row["eval_async_error"]

    _, corrupt = _config(tmp_path / "corrupt", max_steps=2, async_eval_command=fake_evaluator(result="corrupt"))
    with pytest.warns(UserWarning, match="missing or corrupt"):
        _train(corrupt)
    ((row,),) = _async_rows(tmp_path / "corrupt" / "run").values()
    assert "corrupt or missing result file" in row["eval_async_error"]  # re-run once, then reported
    assert not any(k.startswith("eval_fake") for k in row)


def test_rotation_keeps_checkpoints_until_their_evaluation_is_logged(tmp_path):
    # The evaluator checks that its checkpoint still exists after 1 s, while later saves rotate (limit 1).
    _, cfg = _config(tmp_path, max_steps=6, save_total_limit=1, async_eval_command=fake_evaluator(seconds=1.0),
                     async_eval_max_pending=3)
    _train(cfg)
    rows = _async_rows(tmp_path / "run")
    assert {s: [r.get("eval_fake_step") for r in rs] for s, rs in rows.items()} == {2: [2], 4: [4], 6: [6]}
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-6"]


def test_kill_9_with_an_evaluation_pending_then_resume_logs_each_step_once(tmp_path):
    # Each evaluation takes 1.5 s and only one runs at a time: training waits at each save, so a kill lands
    # while checkpoint-4's evaluation (at least) is pending.
    path, _ = _config(tmp_path, max_steps=12, async_eval_command=fake_evaluator(seconds=1.5))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "vlmtrain", "train", "--config", str(path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoint-4" / "trainer_state.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "checkpoint-12").exists()
    done = subprocess.run(cmd + ["--train.resume_from_checkpoint", "true"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _async_rows(run_dir)
    assert {s: [r.get("eval_fake_step") for r in rs] for s, rs in rows.items()} == {
        2: [2], 4: [4], 6: [6], 8: [8], 10: [10], 12: [12]}


def test_eval_all_evaluates_the_checkpoints_that_have_no_evaluation(tmp_path, capsys):
    path, _ = _config(tmp_path, async_eval_command=fake_evaluator(code=1, result="none"))  # all fail
    assert cli.main(["train", "--config", str(path)]) == 0
    run_dir = tmp_path / "run"
    assert all("eval_async_error" in r for rs in _async_rows(run_dir).values() for r in rs)
    # (vlmtrain train's final evaluation covered step 4: only checkpoint-2 lacks one)
    assert cli.main(["eval", "--checkpoint", str(run_dir), "--all"]) == 0
    assert "steps [2]" in capsys.readouterr().out
    (row,) = [r for r in _async_rows(run_dir)[2] if "eval_loss" in r]
    assert row["eval_checkpoint"] == "checkpoint-2" and row["eval_samples"] == 8
    assert cli.main(["eval", "--config", str(run_dir / "config.yaml"), "--checkpoint",
                     str(run_dir / "checkpoint-2"), "--train.output_dir", str(tmp_path / "direct")]) == 0
    out = capsys.readouterr().out
    assert abs(json.loads(out[out.index("{\n"):])["eval_loss"] - row["eval_loss"]) < 1e-6
    assert cli.main(["eval", "--checkpoint", str(run_dir), "--all"]) == 0
    assert "already has an evaluation" in capsys.readouterr().out


def test_async_eval_settings_are_checked_up_front(tmp_path):
    from vlmtrain.errors import ConfigError
    from vlmtrain.trainer import TrainingArguments

    with pytest.raises(ConfigError, match="save_strategy"):
        TrainingArguments(output_dir=str(tmp_path), async_eval=True, save_strategy="no")
    with pytest.raises(ConfigError, match="result_file"):
        TrainingArguments(output_dir=str(tmp_path), async_eval=True, async_eval_command=["python", "eval.py"])
    with pytest.raises(ConfigError, match="async_eval_when_full"):
        TrainingArguments(output_dir=str(tmp_path), async_eval=True, async_eval_when_full="queue")
    _, cfg = _config(tmp_path)  # the default command needs the run's config.yaml (vlmtrain train writes it)
    with pytest.raises(ValueError, match="config.yaml"):
        _train(cfg)


@requires("submitit", "submitit")
def test_submitit_launcher_runs_the_evaluations_as_jobs(tmp_path):
    _, cfg = _config(tmp_path, async_eval_launcher="submitit", async_eval_max_pending=2,
                     async_eval_launcher_kwargs={"cluster": "local", "timeout_min": 5},
                     async_eval_command=fake_evaluator(seconds=0.2))
    _train(cfg)
    rows = _async_rows(tmp_path / "run")
    assert {s: [r.get("eval_fake_step") for r in rs] for s, rs in rows.items()} == {2: [2], 4: [4]}
    assert any((tmp_path / "run" / "async_eval" / "submitit").glob("*_log.out"))  # submitit's own job logs


def env_reporter() -> list[str]:
    """An evaluation command whose metrics are its own CUDA_VISIBLE_DEVICES ('unset' when there is none)."""
    script = ("import json, os, sys\n"
              "device = os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')\n"
              "open(sys.argv[1], 'w').write(json.dumps({'metrics': {'eval_visible_devices': device}}))\n")
    return [sys.executable, "-c", script, "{result_file}"]


def test_async_eval_device_sets_the_evaluation_processes_devices(tmp_path, monkeypatch):
    """train.async_eval_device reaches the launched process as its CUDA_VISIBLE_DEVICES: cpu hides every GPU;
    with this process seeing GPUs 3 5 6 7 (as if CUDA_VISIBLE_DEVICES=3,5,6,7), cuda:1 is GPU 5 and auto the
    last one, 7; a GPU index it does not have, or a bad value, is a ConfigError naming the key."""
    from vlmtrain.errors import ConfigError
    from vlmtrain.trainer import TrainingArguments, async_eval

    def devices(name: str, setting: str) -> str:
        _, cfg = _config(tmp_path / name, max_steps=2, async_eval_command=env_reporter(),
                         async_eval_device=setting)
        _train(cfg)
        return _async_rows(tmp_path / name / "run")[2][0]["eval_visible_devices"]

    monkeypatch.setattr(async_eval, "visible_gpus", lambda: ["3", "5", "6", "7"])
    assert devices("cpu", "cpu") == ""
    assert async_eval.device_env("cpu", "subprocess", ["0"]) == {"CUDA_VISIBLE_DEVICES": ""}  # (the suite
    # itself runs with CUDA_VISIBLE_DEVICES="", which the process above would inherit anyway)
    assert devices("cuda1", "cuda:1") == "5"
    assert devices("auto", "auto") == "7"
    with pytest.raises(ConfigError, match=r"async_eval_device='cuda:4'.*4 GPU\(s\)"):
        devices("missing", "cuda:4")
    monkeypatch.setattr(async_eval, "visible_gpus", lambda: [])
    assert async_eval.device_env("auto", "subprocess", []) == {}  # no GPU: the environment is left as it is
    assert async_eval.device_env("auto", "submitit", ["0", "1"]) == {}  # the scheduler assigns GPUs
    for bad in ("gpu", "cuda", "cuda:x", "1"):
        with pytest.raises(ConfigError, match="async_eval_device"):
            TrainingArguments(output_dir=str(tmp_path), async_eval=True, async_eval_device=bad)
    with pytest.raises(ConfigError, match="async_eval_device='cuda:0'.*submitit"):
        TrainingArguments(output_dir=str(tmp_path), async_eval=True, async_eval_device="cuda:0",
                          async_eval_launcher="submitit")
