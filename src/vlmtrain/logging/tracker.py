"""The base of every experiment tracker writer (TensorBoard, wandb, MLflow, trackio): one TrainerCallback that
starts the tracker's run on world process zero, sends each log row at its own step, keeps the run id in the
checkpoint so a resumed run continues the same tracker run, and turns a tracker that fails into a warning."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import warnings
from typing import Any

from ..trainer.callbacks import TrainerCallback


def row_step(logs: dict[str, Any], global_step: int) -> int:
    """A log row's step: its own "step" when it carries one (e.g. an evaluation of checkpoint-N that arrives
    while training is past N), else the training step it was logged at."""
    return int(logs["step"]) if "step" in logs else global_step


def metric_name(key: str) -> str:
    """Tracker name of a logged key: `eval_loss` -> `eval/loss`, `loss` -> `train/loss`."""
    return key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"


def numeric_metrics(logs: dict[str, Any]) -> dict[str, float]:
    """The row's numbers under their tracker names (strings and flags such as eval_checkpoint are left out)."""
    return {metric_name(k): v for k, v in logs.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def logged_steps(output_dir: str) -> tuple[float, set[int]]:
    """What a crashed run had logged in `<output_dir>/metrics.jsonl`: its highest step (0 without one), and the
    checkpoint steps whose asynchronous evaluations it had logged."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0, set()
    steps, evaluated = [0], set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                steps.append(row["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
            if row.get("eval_async"):
                evaluated.add(row["step"])
    return max(s for s in steps if isinstance(s, (int, float)) and math.isfinite(s)), evaluated


class TrackerCallback(TrainerCallback):
    """Writes every log row to one tracker, from world process zero only. A subclass names the tracker
    (`name`, the report_to value and pip extra; `requires`, the module to import; `hint`, how to fix a
    tracker that does not start) and implements start/write/finish.

    Resume: the run id goes into each checkpoint (state_dict); a run resumed from checkpoint-C in the same
    output_dir continues that tracker run. When `skips_logged_steps`, rows logged while training re-runs the
    steps the crashed run had already logged (after C, up to the last step in metrics.jsonl, which is written
    at the same event) are not sent again: the tracker keeps the crashed run's values for them."""

    name = ""
    requires = ""
    hint = ""
    skips_logged_steps = True

    def __init__(self, output_dir: str, run_name: str | None = None, project: str = "huggingface",
                 config: dict[str, Any] | None = None) -> None:
        self.output_dir = output_dir
        self.run_name = run_name or os.path.basename(os.path.normpath(output_dir))
        self.project = project
        self.config = config or {}
        self.run_id: str | None = None  # the tracker's run, once started (kept in checkpoints)
        self.active = False  # a run is open
        self.failed = False  # the tracker could not start or write: it is off for the rest of this process
        self._resume_id: str | None = None  # the run a resumed checkpoint belongs to
        self._skip: tuple[int, float] | None = None  # (C, H): rows logged at steps in (C, H] are skipped
        self._sent_async: set[int] = set()  # checkpoints whose async evaluation the crashed run had sent

    @classmethod
    def from_args(cls, args: Any) -> TrackerCallback:
        """The tracker for a TrainingArguments (output_dir, run_name, project; the arguments as the config)."""
        return cls(args.output_dir, args.run_name, args.project, config=_plain(args.to_dict()))

    @classmethod
    def available(cls) -> bool:
        return importlib.util.find_spec(cls.requires) is not None

    @classmethod
    def install_hint(cls) -> str:
        return f"pip install 'vlmtrain[{cls.name}]'"

    # -- what a tracker implements -------------------------------------------------------------------
    def start(self, run_id: str | None) -> str:
        """Open the tracker run `run_id` (None: a new run); return its id."""
        raise NotImplementedError

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Send one row of metrics at `step` (steps may arrive out of order)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Close the run (flush what is buffered)."""

    # -- checkpointed state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"run_id": self.run_id or self._resume_id, "output_dir": os.path.abspath(self.output_dir)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("run_id") and state.get("output_dir") == os.path.abspath(self.output_dir):
            self._resume_id = state["run_id"]
            # (called before on_train_begin, so metrics.jsonl still holds the crashed run's later rows)
            if self.skips_logged_steps:
                highest, self._sent_async = logged_steps(self.output_dir)
                self._skip = (-1, highest)

    # -- events ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._skip is not None:
            self._skip = (state.global_step, self._skip[1])
        self._ensure_started()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or not self._ensure_started():
            return
        if logs.get("eval_async"):  # logged again after a resume if the crashed run's checkpoint had not
            if logs.get("step") in self._sent_async:  # ... but the crashed run sent it
                return
        elif self._skip is not None and self._skip[0] < state.global_step <= self._skip[1]:
            return  # the crashed run logged this step already
        metrics = numeric_metrics(logs)
        if metrics:
            self._guarded("log to", self.write, row_step(logs, state.global_step), metrics)

    def on_train_end(self, args, state, control, **kwargs):
        if self.active:
            self._guarded("close", self.finish)
            self.active = False

    def _ensure_started(self) -> bool:
        """Open the run if none is (a later evaluate() after train() reopens the same run); False if off."""
        if not self.active and not self.failed:
            run_id = self._guarded("start", self.start, self.run_id or self._resume_id)
            if run_id is not None:
                self.run_id, self.active = run_id, True
        return self.active

    def _guarded(self, what: str, fn, *fn_args):  # noqa: ANN001, ANN202 - any tracker call
        """Call fn; an error turns this tracker off with a warning that names it and the fix."""
        try:
            return fn(*fn_args)
        except Exception as e:  # a tracker must never stop training
            self.failed, self.active = True, False
            warnings.warn(f"report_to '{self.name}': could not {what} the tracker ({type(e).__name__}: {e}). "
                          f"{self.hint} Training goes on without {self.name}.", stacklevel=3)
            return None


def _plain(value: Any) -> Any:
    """The arguments as JSON-like values (trackers' configs take str, numbers, lists and dicts)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
