"""train.async_eval: saved checkpoints are evaluated by other processes while training goes on; results are
logged once at their checkpoint's step, whatever happens to the evaluation or to the training process."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
from optional_extras import requires

from vlmtrain import cli, run
from vlmtrain.config import load_run_config
from vlmtrain.evaluation import async_eval
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


HANG_S = 60  # an evaluator held at a gate gives up after this long (exit 7): a bound on a hang, never reached


def fake_evaluator(gates: Path | None = None, code: int = 0, result: str = "ok") -> list[str]:
    """An evaluation command that checks its checkpoint is there, then writes a result naming its step (result
    'ok'), a corrupt one ('corrupt') or none ('none'), and exits with ``code``.

    With ``gates``, it first waits until the test creates ``gates/all`` or ``gates/step-<its step>``: the
    test, not the machine's speed, decides when an evaluation can finish; it exits (7) without a result if
    none opens within HANG_S."""
    script = ("import json, os, sys, time\n"
              "checkpoint, out, step = sys.argv[1:4]\n"
              f"gates = {str(gates) if gates else ''!r}\n"
              f"deadline = time.monotonic() + {HANG_S}\n"
              "while gates and not any(os.path.exists(os.path.join(gates, n)) for n in ('all', 'step-' + step)):\n"
              "    if time.monotonic() > deadline: print('no gate opened'); sys.exit(7)\n"
              "    time.sleep(0.01)\n"
              "assert os.path.isfile(os.path.join(checkpoint, 'trainer_state.json')), checkpoint\n"
              f"text = json.dumps({{'metrics': {{'eval_fake_step': int(step)}}}}) if {result!r} == 'ok' else '{{not'\n"
              f"if {result!r} != 'none': open(out, 'w').write(text)\n"
              f"sys.exit({code})\n")
    return [sys.executable, "-c", script, "{checkpoint}", "{result_file}", "{step}"]


def _gates(tmp_path: Path) -> Path:
    gates = tmp_path / "gates"
    gates.mkdir(parents=True, exist_ok=True)
    return gates


def _evaluators_alive(marker: Path) -> list[int]:
    """Processes whose command line names ``marker`` (the fake evaluators of one run)."""
    alive = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
            state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(marker).encode() in cmdline and state != "Z":
            alive.append(int(entry))
    return alive


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


class OpenGates(TrainerCallback):
    """Opens ``gates/all`` (every held evaluation may finish) at a chosen point of training, and records what
    the run had done by then: which evaluations were launched (their log files) and the async rows logged."""

    def __init__(self, gates: Path, at: str) -> None:
        self.gates, self.at = gates, at
        self.launched: list[str] | None = None
        self.logged: list[dict] | None = None

    def _open(self, args, state) -> None:
        if self.launched is None:
            self.launched = sorted(p.name for p in (Path(args.output_dir) / "async_eval").glob("step-*.log"))
            self.logged = [r for r in state.log_history if r.get("eval_async")]
            (self.gates / "all").touch()

    def on_step_end(self, args, state, control, **kwargs):  # before that step's save
        if self.at == "last step end" and state.global_step == state.max_steps:
            self._open(args, state)

    def on_save(self, args, state, control, **kwargs):  # after the save and its rotation
        if self.at == "last save" and state.global_step == state.max_steps:
            self._open(args, state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.at == "last step skipped" and logs.get("step") == state.max_steps and "eval_async_status" in logs:
            self._open(args, state)


def _train(cfg, *callbacks: TrainerCallback):
    trainer = run.build(cfg)
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer, trainer.train()


def _fake_steps(rows: dict[int, list[dict]]) -> dict[int, list]:
    return {s: [r.get("eval_fake_step") for r in rs] for s, rs in rows.items()}


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
    """The evaluations cannot finish before the last step has ended (they are held until then): training gets
    there with the earlier ones launched and running, then train() waits for all of them. (How much time this
    hides: benchmarks/async_eval.py.)"""
    gates = _gates(tmp_path)
    _, cfg = _config(tmp_path, max_steps=8, async_eval_command=fake_evaluator(gates), async_eval_max_pending=4)
    opener = OpenGates(gates, at="last step end")
    _train(cfg, opener)
    assert opener.launched == ["step-2.log", "step-4.log", "step-6.log"]  # running beside steps 3..8
    assert opener.logged == []  # none had finished: the steps did not wait for them
    assert _fake_steps(_async_rows(tmp_path / "run")) == {2: [2], 4: [4], 6: [6], 8: [8]}  # train() did


class SeenRunningJob(async_eval._SubprocessJob):
    """The subprocess launcher, whose evaluation of checkpoint-N is held until the trainer has polled it and
    found it still running (then ``gates/step-N`` opens)."""

    gates: Path

    def done(self) -> bool:
        finished = super().done()
        if not finished:
            (self.gates / Path(self.log_path).stem).touch()
        return finished


def test_when_full_skip_logs_the_skipped_checkpoint_and_wait_evaluates_every_one(tmp_path, monkeypatch):
    # skip: checkpoint-1's evaluation is held until step 4 has been logged as skipped, so the one slot is busy
    # at the saves of steps 2, 3 and 4.
    gates = _gates(tmp_path / "skip")
    _, skip = _config(tmp_path / "skip", save_steps=1, async_eval_command=fake_evaluator(gates),
                      async_eval_when_full="skip")
    _train(skip, OpenGates(gates, at="last step skipped"))
    rows = _async_rows(tmp_path / "skip" / "run")
    assert sorted(rows) == [1, 2, 3, 4] and all(len(r) == 1 for r in rows.values())
    assert rows[1][0]["eval_fake_step"] == 1 and "eval_async_status" not in rows[1][0]
    for step in (2, 3, 4):
        assert "skipped" in rows[step][0]["eval_async_status"] and "eval_fake_step" not in rows[step][0]
    # wait: checkpoint-N's evaluation is still running when checkpoint-N+1 is saved (it finishes only once the
    # trainer has seen it running): the trainer waits for it there, then evaluates N+1.
    gates = _gates(tmp_path / "wait")
    monkeypatch.setattr(SeenRunningJob, "gates", gates, raising=False)
    monkeypatch.setitem(async_eval.LAUNCHERS, "subprocess", SeenRunningJob)
    _, wait = _config(tmp_path / "wait", save_steps=1, async_eval_command=fake_evaluator(gates))
    _train(wait)
    rows = _async_rows(tmp_path / "wait" / "run")
    assert _fake_steps(rows) == {1: [1], 2: [2], 3: [3], 4: [4]}
    assert {s: r["eval_arrived_step"] for s, (r,) in rows.items()} == {1: 2, 2: 3, 3: 4, 4: 4}
    assert sorted(p.name for p in gates.iterdir()) == ["step-1", "step-2", "step-3", "step-4"]


def test_failed_timed_out_and_corrupt_evaluations_are_logged_rows_not_training_failures(tmp_path):
    _, failing = _config(tmp_path / "fail", async_eval_command=fake_evaluator(code=3))
    _, out = _train(failing)
    assert out.global_step == 4
    rows = _async_rows(tmp_path / "fail" / "run")
    for step in (2, 4):
        (row,) = rows[step]
        log = tmp_path / "fail" / "run" / "async_eval" / f"step-{step}.log"
        assert "exit code 3" in row["eval_async_error"] and str(log) in row["eval_async_error"] and log.is_file()

    # An evaluation that never finishes (its gate never opens; on its own it would end after HANG_S with exit
    # code 7): timed out after 1 s, and its process is gone when train() returns.
    gates = _gates(tmp_path / "timeout")
    _, slow = _config(tmp_path / "timeout", max_steps=2, async_eval_command=fake_evaluator(gates),
                      async_eval_timeout_s=1)
    try:
        _train(slow)
        ((row,),) = _async_rows(tmp_path / "timeout" / "run").values()
        assert "timed out after 1 s" in row["eval_async_error"], row
        assert _evaluators_alive(tmp_path / "timeout") == []
    finally:
        (gates / "all").touch()  # (a process left by a failure ends)

    _, corrupt = _config(tmp_path / "corrupt", max_steps=2, async_eval_command=fake_evaluator(result="corrupt"))
    with pytest.warns(UserWarning, match="missing or corrupt"):
        _train(corrupt)
    ((row,),) = _async_rows(tmp_path / "corrupt" / "run").values()
    assert "corrupt or missing result file" in row["eval_async_error"]  # re-run once, then reported
    assert not any(k.startswith("eval_fake") for k in row)


def test_rotation_keeps_checkpoints_until_their_evaluation_is_logged(tmp_path):
    # The evaluations are held until checkpoint-6 is saved (and rotation, limit 1, has run at steps 4 and 6);
    # then each checks that its checkpoint still exists.
    gates = _gates(tmp_path)
    _, cfg = _config(tmp_path, max_steps=6, save_total_limit=1, async_eval_command=fake_evaluator(gates),
                     async_eval_max_pending=3)
    opener = OpenGates(gates, at="last save")
    _train(cfg, opener)
    assert opener.launched == ["step-2.log", "step-4.log"] and opener.logged == []  # (6: launched after it)
    assert _fake_steps(_async_rows(tmp_path / "run")) == {2: [2], 4: [4], 6: [6]}
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-6"]


def test_kill_9_with_an_evaluation_pending_then_resume_logs_each_step_once(tmp_path):
    # The first run's evaluations are held (no gate opens) and only one runs at a time: training waits at the
    # save of step 4 for checkpoint-2's evaluation, and is killed there with both 2 and 4 pending.
    gates = _gates(tmp_path)
    path, _ = _config(tmp_path, max_steps=12, async_eval_command=fake_evaluator(gates))
    # `vlmtrain train`: processes forked with their imports done (tests/preloaded.py), killed as a fresh one
    from tests import preloaded

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    argv = ["train", "--config", str(path)]
    proc = preloaded.start("vlmtrain.cli:main", argv, env, tmp_path / "killed.log")
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 300  # (a bound on a hang)
    while not (run_dir / "checkpoint-4" / "trainer_state.json").is_file():
        assert proc.is_alive() and time.monotonic() < deadline, preloaded.output(proc)
        time.sleep(0.05)
    proc.kill()  # SIGKILL
    proc.join()
    for pid in _evaluators_alive(tmp_path):  # checkpoint-2's held evaluation, orphaned: it never reports
        os.kill(pid, signal.SIGKILL)
    while _evaluators_alive(tmp_path):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not (run_dir / "checkpoint-6").exists() and not (run_dir / "async_eval" / "step-2.json").exists()
    assert not [r for r in _rows(run_dir) if r.get("eval_async")]
    (gates / "all").touch()
    resumed = preloaded.start("vlmtrain.cli:main", [*argv, "--train.resume_from_checkpoint", "true"], env,
                              tmp_path / "resumed.log")
    resumed.join(300)
    if resumed.exitcode is None:  # (a bound on a hang)
        resumed.kill()
        resumed.join()
    assert resumed.exitcode == 0, preloaded.output(resumed)
    assert _fake_steps(_async_rows(run_dir)) == {2: [2], 4: [4], 6: [6], 8: [8], 10: [10], 12: [12]}


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
    from vlmtrain import TrainingArguments
    from vlmtrain.errors import ConfigError

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
                     async_eval_command=fake_evaluator())
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
    from vlmtrain import TrainingArguments
    from vlmtrain.errors import ConfigError
    from vlmtrain.evaluation import async_eval

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
