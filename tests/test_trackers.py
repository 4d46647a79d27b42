"""Trackers (report_to: tensorboard, wandb, mlflow, trackio), each read back from what it wrote, offline: every
row at its own step (a late evaluation row included), one tracker run across a resume with each step once,
a tracker that is missing or fails is a warning, and `vlmtrain sync` replays metrics.jsonl into each."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import time
import warnings

import pytest
from optional_extras import requires
from tiny import tiny_llama, token_samples

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.cli import main
from vlmtrain.logging.tracker import TrackerCallback
from vlmtrain.logging.trackers import TRACKERS
from vlmtrain.logging.writers import default_writers
from vlmtrain.trainer import TrainerCallback

pytestmark = pytest.mark.usefixtures("one_thread", "offline_trackers")

INSTALLED = [pytest.param(name, marks=requires(cls.requires, name)) for name, cls in TRACKERS.items()]


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR once, when it is imported: point it at a temporary directory first."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACKIO_DIR", str(tmp_path_factory.mktemp("trackio")))
        yield


@pytest.fixture
def offline_trackers(monkeypatch, trackio_dir):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    """An empty MLflow sqlite store, made once: creating one runs MLflow's migrations (~9 s on a loaded box);
    each test copies it to `<output_dir>/mlflow.db`, where the tracker finds it by default."""
    if not TRACKERS["mlflow"].available():
        return None
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def _args(out, tracker: str, **kw) -> TrainingArguments:
    kw = {"max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-2, "logging_steps": 1,
          "save_steps": 2, "disable_tqdm": True, "report_to": [tracker], "run_name": "r",
          "project": f"p-{os.path.basename(os.path.dirname(out))}", **kw}  # (tmp_path's name)
    return TrainingArguments(output_dir=str(out), **kw)


def _prepare(out, tracker: str, mlflow_db) -> None:
    os.makedirs(out, exist_ok=True)
    if tracker == "mlflow":
        shutil.copy(mlflow_db, os.path.join(out, "mlflow.db"))


# -- reading each tracker back: (number of runs, {metric: [steps in the order logged]}) ----------------------
def _wandb_records(path: str):
    """The protobuf records of an offline run's .wandb file (LevelDB log format: 32 KiB blocks of chunks with
    a 7-byte header, after a 7-byte W&B file header)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = open(path, "rb").read(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        if pos + 7 + length > len(data):
            return  # a chunk still being written
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _finished_wandb_records(path: str, timeout_s: float = 30.0) -> list:
    """The records of a finished run: wandb's service process may still be writing the file when run.finish()
    returns, so wait for the run's `exit` record."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def _read_wandb(out, project):
    runs, steps = set(), {}
    for path in sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "*.wandb"))):  # (sorted: by start time)
        for record in _finished_wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                runs.add(record.run.run_id)
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for key in row:
                    if not key.startswith("_") and key != "train/global_step":
                        steps.setdefault(key, []).append(row["train/global_step"])
    return len(runs), steps


def _read_mlflow(out, project):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    steps = {}
    for run in runs:
        for key in run.data.metrics:
            history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
            steps.setdefault(key, []).extend(m.step for m in history)
    return len(runs), steps


def _read_trackio(out, project):
    from trackio.sqlite_storage import SQLiteStorage

    runs, steps = SQLiteStorage.get_runs(project), {}
    for row in SQLiteStorage.get_logs(project, "r"):
        for key in row:
            if key not in ("step", "timestamp"):
                steps.setdefault(key, []).append(row["step"])
    return len(runs), steps


def _read_tensorboard(out, project):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "runs" / "r"))
    events.Reload()
    return 1, {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


READERS = {"wandb": _read_wandb, "mlflow": _read_mlflow, "trackio": _read_trackio, "tensorboard": _read_tensorboard}


def _read(tracker, out, args):
    return READERS[tracker](out, args.project)


class LateEval(TrainerCallback):
    """Logs an evaluation of checkpoint-2 once training is at step `at`, as async evaluation does."""

    def __init__(self, at: int) -> None:
        self.at, self.trainer = at, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.global_step == self.at and "loss" in logs:  # after step `at`'s own row
            self.trainer.log({"step": 2, "eval_loss": 0.5, "eval_async": True, "eval_checkpoint": "checkpoint-2",
                              "eval_arrived_step": self.at})


# -- tests -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tracker", INSTALLED)
def test_every_row_reaches_the_tracker_at_its_own_step(tmp_path, tracker, mlflow_db):
    out = tmp_path / "run"
    _prepare(out, tracker, mlflow_db)
    args, late = _args(out, tracker, max_steps=5), LateEval(at=5)
    trainer = Trainer(tiny_llama(0), args, train_dataset=token_samples(32), callbacks=[late])
    late.trainer = trainer
    trainer.train()
    runs, steps = _read(tracker, out, args)
    assert runs == 1
    assert steps["train/loss"] == [1, 2, 3, 4, 5]
    assert steps["eval/loss"] == [2]  # logged after step 5, kept at its own step
    assert steps["eval/arrived_step"] == [2]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2]


@pytest.mark.parametrize("tracker", INSTALLED)
def test_a_resumed_run_continues_the_tracker_run_with_each_step_once(tmp_path, tracker, mlflow_db):
    out = tmp_path / "run"
    _prepare(out, tracker, mlflow_db)
    data = token_samples(32)
    first = Trainer(tiny_llama(0), _args(out, tracker), train_dataset=data)
    first.train()  # logs steps 1..4: for the resumed run, what a crash after checkpoint-2 left behind
    resumed = Trainer(tiny_llama(0), _args(out, tracker), train_dataset=data)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    runs, steps = _read(tracker, out, resumed.args)
    assert runs == 1
    assert steps["train/loss"] == [1, 2, 3, 4]
    saved = json.load(open(out / "checkpoint-2" / "trainer_state.json"))["stateful_callbacks"]
    name = type(next(cb for cb in first.callback_handler.callbacks if isinstance(cb, TRACKERS[tracker]))).__name__
    assert saved[name]["run_id"]


class Broken(TrackerCallback):
    name, requires, hint = "broken", "json", "Fix the broken tracker."

    def __init__(self, *args, fail_in: str = "start", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_in, self.rows = fail_in, 0

    def start(self, run_id):
        if self.fail_in == "start":
            raise ConnectionError("no network")
        return "id"

    def write(self, step, metrics):
        self.rows += 1
        if self.fail_in == "write" and self.rows == 2:
            raise ConnectionError("connection lost")


class Recording(TrackerCallback):
    name, requires = "recording", "json"

    def start(self, run_id):
        self.written = []
        return run_id or "id"

    def write(self, step, metrics):
        self.written.append((step, sorted(metrics)))


def test_after_a_resume_an_async_evaluation_the_crashed_run_had_not_sent_is_sent_once(tmp_path):
    """The crashed run logged steps 1-6 and checkpoint-2's async evaluation (after checkpoint-4 was taken);
    checkpoint-4's evaluation was still running when it died. Resumed from checkpoint-4, the run logs both
    again: the tracker gets checkpoint-4's (never sent), not checkpoint-2's, nor the re-trained step 5."""
    from vlmtrain.trainer.state import TrainerControl, TrainerState

    rows = [{"step": s, "loss": 1.0} for s in range(1, 7)]
    rows.insert(5, {"step": 2, "eval_loss": 0.5, "eval_async": True})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tracker = Recording(str(tmp_path))
    tracker.load_state_dict({"run_id": "id", "output_dir": os.path.abspath(tmp_path)})
    state, control = TrainerState(global_step=4), TrainerControl()
    tracker.on_train_begin(None, state, control)
    state.global_step = 5
    for logs in ({"step": 2, "eval_loss": 0.5, "eval_async": True}, {"step": 4, "eval_loss": 0.4, "eval_async": True},
                 {"loss": 1.0}):
        tracker.on_log(None, state, control, logs=logs)
    state.global_step = 7
    tracker.on_log(None, state, control, logs={"loss": 0.9})
    assert tracker.written == [(4, ["eval/loss"]), (7, ["train/loss"])]


@pytest.mark.parametrize("fail_in", ["start", "write"])
def test_a_tracker_that_fails_is_a_warning_and_training_goes_on(tmp_path, monkeypatch, fail_in, mlflow_db):
    monkeypatch.setitem(TRACKERS, "broken", Broken)
    monkeypatch.setattr(Broken, "from_args", classmethod(lambda cls, args: cls(args.output_dir, fail_in=fail_in)))
    trainer = Trainer(tiny_llama(0), _args(tmp_path / "run", "broken"), train_dataset=token_samples(32))
    with pytest.warns(UserWarning, match=rf"report_to 'broken': could not {fail_in if fail_in == 'start' else 'log to'}"
                                         r" the tracker \(ConnectionError: .*\)\. Fix the broken tracker\. Training "
                                         r"goes on without broken\.") as caught:
        trainer.train()
    assert sum("report_to 'broken'" in str(w.message) for w in caught) == 1  # once, then the tracker is off
    assert trainer.state.global_step == 4
    assert len(open(tmp_path / "run" / "metrics.jsonl").readlines()) == 5  # steps 1..4 and the end-of-training row
    broken = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, Broken))
    assert broken.rows == (0 if fail_in == "start" else 2)


@requires("mlflow", "mlflow")
def test_a_bad_mlflow_uri_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    trainer = Trainer(tiny_llama(0), _args(tmp_path / "run", "mlflow", max_steps=2), train_dataset=token_samples(16))
    with pytest.warns(UserWarning, match=r"report_to 'mlflow': could not start .* Check MLFLOW_TRACKING_URI"):
        trainer.train()
    assert trainer.state.global_step == 2


def test_a_tracker_that_is_not_installed_is_a_warning_and_all_takes_the_installed_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(TRACKERS["wandb"], "available", classmethod(lambda cls: False))
    with pytest.warns(UserWarning, match=r"report_to includes 'wandb' but wandb is not installed: "
                                         r"pip install 'vlmtrain\[wandb\]'\. Training goes on without wandb"):
        writers = default_writers(_args(tmp_path / "run", "wandb"))
    assert [type(w).__name__ for w in writers] == ["JsonlLoggerCallback"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        writers = default_writers(_args(tmp_path / "run", "all"))
    installed = {cls for name, cls in TRACKERS.items() if name != "wandb" and cls.available()}
    assert {type(w) for w in writers[1:]} == installed and len(writers) == len(installed) + 1


def _write_run(run_dir) -> None:
    os.makedirs(run_dir)
    rows = [{"step": 1, "loss": 2.0, "epoch": 0.1}, {"step": 2, "loss": "nan", "epoch": 0.2},
            {"step": 3, "loss": 1.5, "epoch": 0.3}, {"step": 2, "eval_loss": 0.5, "eval_checkpoint": "checkpoint-2"}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    (run_dir / "config.yaml").write_text(f"train:\n  run_name: r\n  project: p-{run_dir.parent.name}\n")


@pytest.mark.parametrize("tracker", INSTALLED)
def test_sync_replays_metrics_jsonl_into_the_tracker(tmp_path, tracker, mlflow_db, capsys):
    run_dir = tmp_path / "done"
    _write_run(run_dir)
    if tracker == "mlflow":
        shutil.copy(mlflow_db, run_dir / "mlflow.db")
    assert main(["sync", str(run_dir), "--to", tracker]) == 0
    assert f"synced 4 rows of {run_dir}/metrics.jsonl to {tracker} run" in capsys.readouterr().out
    runs, steps = READERS[tracker](run_dir, f"p-{tmp_path.name}")
    assert runs == 1
    assert steps["train/loss"] == [1, 2, 3] and steps["eval/loss"] == [2] and steps["train/epoch"] == [1, 2, 3]


def test_sync_names_what_is_wrong(tmp_path, capsys):
    assert main(["sync", str(tmp_path), "--to", "wandbb"]) == 2
    assert "--to 'wandbb' is not a tracker; choose one of tensorboard, wandb, mlflow, trackio" in capsys.readouterr().err
    assert main(["sync", str(tmp_path), "--to", "wandb"]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
