"""What a run prints while it trains: transformers' stock ProgressCallback (a tqdm bar, log lines above it) or
PrinterCallback (with disable_tqdm), one of which every Trainer gets (see writers.py); and what `vlmtrain demo`
prints instead: the progress bar and one line per evaluation with its headline numbers, instead of a line per
log (every number is still in metrics.jsonl and the trackers)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from vlmtrain.trainer.callbacks import TrainerCallback


def _fmt(v: Any) -> Any:
    return f"{v:.4g}" if isinstance(v, float) else v


class ProgressCallback(TrainerCallback):
    """tqdm bars for training (with loss and learning rate) and evaluation; log lines above the bar."""

    def __init__(self) -> None:
        self.train_bar = None
        self.eval_bar = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.train_bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.train_bar is not None:
            self.train_bar.update(state.global_step - self.train_bar.n)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.eval_bar is None:
            try:
                total = len(eval_dataloader)
            except TypeError:  # an IterableDataset without __len__: a bar without total
                total = None
            if args.max_eval_batches is not None and total is not None:
                total = min(total, args.max_eval_batches)
            self.eval_bar = tqdm(total=total, desc="eval", leave=self.train_bar is None, dynamic_ncols=True)
        self.eval_bar.update(1)

    def _close_eval(self) -> None:
        if self.eval_bar is not None:
            self.eval_bar.close()
            self.eval_bar = None

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_eval()

    def on_predict(self, args, state, control, **kwargs):
        self._close_eval()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.train_bar is not None and "loss" in logs:
            self.train_bar.set_postfix(loss=_fmt(logs["loss"]), lr=f"{logs.get('learning_rate', 0):.3g}")
        shown = {k: _fmt(v) for k, v in logs.items() if k not in ("step", "epoch", "total_flos")}
        tqdm.write(f"[step {state.global_step}] " + " ".join(f"{k}={v}" for k, v in shown.items()))

    def on_train_end(self, args, state, control, **kwargs):
        if self.train_bar is not None:
            self.train_bar.close()
            self.train_bar = None


class PrinterCallback(TrainerCallback):
    """Prints every log (used instead of the progress bar when disable_tqdm=True)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.pop("total_flos", None)  # (as transformers' PrinterCallback, which removes it from the logs)
        if state.is_world_process_zero and logs:
            print({k: _fmt(v) for k, v in logs.items()}, flush=True)


Summary = Callable[[dict[str, Any], str], dict[str, float]]


def eval_sets(metrics: dict[str, Any], prefix: str = "eval") -> list[str]:
    """The named eval sets of an evaluation (a dict of eval datasets logs `<prefix>_<set>_samples` per set)."""
    pattern = re.compile(rf"^{re.escape(prefix)}_(.+)_samples$")
    return [m.group(1) for m in map(pattern.match, metrics) if m and not m.group(1).startswith("skipped_")]


def eval_line(step: int, metrics: dict[str, Any], max_steps: int | None = None, summary: Summary | None = None,
              untrained: dict[str, str] | None = None, prefix: str = "eval") -> str:
    """One evaluation in one line: its headline metric over all eval sets (exact match where it was computed,
    else the loss), the loss, the source's summary (e.g. single-/multi-image means), then each eval set's value.
    Sets named in ``untrained`` (set -> why the training data has not asked them yet) get a `*` and a second
    line saying why they are at 0 by design."""
    main = "exact_match" if f"{prefix}_exact_match" in metrics else "loss"
    parts = [f"[step {step}{f'/{max_steps}' if max_steps else ''}] {prefix} {main.replace('_', ' ')} "
             f"{_num(metrics.get(f'{prefix}_{main}'))}"]
    if main != "loss" and f"{prefix}_loss" in metrics:
        parts[0] += f", loss {_num(metrics[f'{prefix}_loss'])}"
    sets = eval_sets(metrics, prefix)
    extra = summary(metrics, prefix) if summary is not None else {}
    groups = [(k[len(prefix) + 1:-len(main) - 1], v) for k, v in extra.items() if k.endswith(f"_{main}")]
    if groups:
        parts.append(", ".join(f"{name.replace('_', '-')} {_num(v)}" for name, v in groups))
    untrained = {s: why for s, why in (untrained or {}).items() if s in sets}
    if sets:
        parts.append(", ".join(f"{s} {_num(metrics.get(f'{prefix}_{s}_{main}'))}{'*' if s in untrained else ''}"
                               for s in sets))
    line = " | ".join(parts)
    if untrained:
        line += ("\n  * by design, not asked in training yet (a warm-up curriculum, see docs/own-vlm.md): "
                 + "; ".join(f"{s} ({why})" for s, why in untrained.items()))
    return line


def _num(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "n/a"


class EvalLinesCallback(ProgressCallback):
    """The training progress bar (unless train.disable_tqdm) and :func:`eval_line` once per evaluation, on
    rank 0; no line per training log. ``untrained(step)`` names the eval sets the training data has not asked
    yet at that step (see DataSource.untrained)."""

    def __init__(self, summary: Summary | None = None,
                 untrained: Callable[[int], dict[str, str]] | None = None) -> None:
        super().__init__()
        self.summary, self.untrained = summary, untrained
        self._pending: dict[str, Any] = {}
        self._pending_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not args.disable_tqdm:
            super().on_train_begin(args, state, control, **kwargs)

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if args.disable_tqdm or not state.is_world_process_zero:
            return
        if self.eval_bar is None:  # a bar while it runs, gone after (none in a log file): the line stays
            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            self.eval_bar = tqdm(total=total, desc="eval", leave=False, dynamic_ncols=True, disable=None)
        self.eval_bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if self.train_bar is not None and "loss" in logs:
            self.train_bar.set_postfix(loss=f"{logs['loss']:.4g}", lr=f"{logs.get('learning_rate', 0):.3g}")
        evals = {k: v for k, v in logs.items() if k.startswith("eval_")}
        if not evals:
            return
        step = int(logs.get("step", state.global_step))
        if step != self._pending_step:
            self._pending, self._pending_step = {}, step
        self._pending.update(evals)
        if "eval_loss" in logs or "eval_exact_match" in logs:  # the row of all sets (or of the only one): done
            untrained = self.untrained(step) if self.untrained is not None else None
            tqdm.write(eval_line(step, self._pending, state.max_steps or None, self.summary, untrained))
            self._pending = {}
