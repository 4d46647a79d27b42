"""Log writers as callbacks: metrics.jsonl always, TensorBoard when asked for."""

from __future__ import annotations

import json
import math
import os
import warnings

from ..trainer.callbacks import TrainerCallback


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them visible as strings
    return value


class JsonlLoggerCallback(TrainerCallback):
    """Appends one JSON object per log event to `<output_dir>/metrics.jsonl` (world process zero only):
    `step`, `epoch`, and every logged key (`loss`, `loss_*`, `learning_rate`, `grad_norm`, throughput,
    `eval_*`)."""

    def __init__(self, output_dir: str) -> None:
        self.path = os.path.join(output_dir, "metrics.jsonl")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        record = {"step": state.global_step, **{k: _clean(v) for k, v in logs.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


class TensorBoardCallback(TrainerCallback):
    """Writes every numeric log value as a scalar to `<output_dir>/runs/<run_name>`."""

    def __init__(self, output_dir: str, run_name: str | None = None) -> None:
        self.log_dir = os.path.join(output_dir, "runs", run_name or "run")
        self.writer = None

    @staticmethod
    def available() -> bool:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            return False
        return True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.log_dir)
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                tag = key.replace("eval_", "eval/", 1) if key.startswith("eval_") else f"train/{key}"
                self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def default_writers(args) -> list[TrainerCallback]:
    writers: list[TrainerCallback] = [JsonlLoggerCallback(args.output_dir)]
    if any(r in ("tensorboard", "all") for r in args.report_to):
        if TensorBoardCallback.available():
            writers.append(TensorBoardCallback(args.output_dir, args.run_name))
        elif "tensorboard" in args.report_to:
            warnings.warn("report_to includes 'tensorboard' but tensorboard is not installed: "
                          "pip install 'vlmtrain[tensorboard]'. Logging to metrics.jsonl only.", stacklevel=2)
    return writers
