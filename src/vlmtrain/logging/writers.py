"""Log writers as callbacks: metrics.jsonl always, the trackers of report_to (trackers.py) when asked for. Every
Trainer gets them through vlmtrain.Trainer's ``logging_callbacks`` part (trainer/parts.py))."""

from __future__ import annotations

import json
import math
import os
import warnings

from ..trainer.callbacks import LoggingCallbacks, TrainerCallback
from .console import PrinterCallback, ProgressCallback
from .tensorboard import TensorBoardCallback  # noqa: F401 - its old home


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


class JsonlLoggerCallback(TrainerCallback):
    """Appends one JSON object per log event to `<output_dir>/metrics.jsonl` (world process zero only):
    `step`, `epoch`, and every logged key (`loss`, `loss_*`, `learning_rate`, `grad_norm`, throughput,
    `eval_*`). A run resumed from checkpoint-N first drops the rows logged after that checkpoint was taken; a run
    asked to resume that finds no checkpoint (its earlier attempt was killed before the first one) drops the
    earlier attempt's rows. The file is rewritten atomically, so a crash and resume leave no duplicate or stale
    rows. A fresh run (no resume asked for) appends to an existing file."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.rows = 0  # rows in the file (this run's and earlier runs')
        self._saved_rows: int | None = None  # rows when the checkpoint resumed from was taken
        self._earlier_rows = len(_read_lines(self.path))  # rows written before this process started
        self._restarted = False  # resume asked for, no checkpoint found

    def on_restart_without_checkpoint(self) -> None:
        """Called by the Trainer when a resume was asked for and no checkpoint exists (not a transformers event)."""
        self._restarted = True

    def state_dict(self) -> dict:
        return {"path": os.path.abspath(self.path), "rows": self.rows}

    def load_state_dict(self, state: dict) -> None:
        same_file = state.get("path") == os.path.abspath(self.path)
        self._saved_rows = state.get("rows") if same_file else None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        lines = _read_lines(self.path)
        if state.global_step > 0:  # resumed from checkpoint-<global_step>
            kept = [line for line in lines[:self._saved_rows] if _step_of(line) <= state.global_step]
            if kept != lines:
                _rewrite(self.path, kept)
            lines = kept
        elif self._restarted and self._earlier_rows:  # the same job from step 0: its rows would repeat
            warnings.warn(f"{self.path} held {self._earlier_rows} rows of an attempt that left no checkpoint: "
                          "they are dropped, the run starts again from step 0.", stacklevel=2)
            lines = lines[self._earlier_rows:]  # keeps what this process logged before train()
            _rewrite(self.path, lines)
        self.rows, self._saved_rows, self._earlier_rows, self._restarted = len(lines), None, 0, False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        record = {"step": state.global_step, **{k: _clean(v) for k, v in logs.items()}}  # logs' own "step" wins
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.rows += 1


def _read_lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _step_of(line: str) -> float:
    """A row's step; inf for a line that is no complete row (e.g. cut short by a kill): it is dropped."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _rewrite(path: str, lines: list[str]) -> None:
    """Replace path's content with lines, atomically (a temporary file renamed over it)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def default_writers(args) -> list[TrainerCallback]:
    """metrics.jsonl, then the trackers args.report_to names (see trackers.py)."""
    from .trackers import tracker_callbacks

    return [JsonlLoggerCallback(args.output_dir), *tracker_callbacks(args)]


def logging_callbacks(args) -> LoggingCallbacks:
    """What every Trainer logs through: the trackers of report_to and the progress bar (PrinterCallback with
    disable_tqdm), listed as transformers lists its own, and metrics.jsonl, which is not listed."""
    from .trackers import tracker_callbacks

    progress = PrinterCallback() if args.disable_tqdm else ProgressCallback()
    return LoggingCallbacks(integrations=tuple(tracker_callbacks(args)), progress=(progress,),
                            writers=(JsonlLoggerCallback(args.output_dir),))

