"""`vlmtrain report RUN_DIR`: one self-contained RUN_DIR/report.html (viewable offline: every image is a data:
URI, no external file, script or font) and RUN_DIR/curves.png.

Read from the run dir: metrics.jsonl (training curves; eval metrics per evaluated step, inline and
asynchronous rows told apart by `eval_async`), eval_samples_step_N.jsonl with eval_thumbnails/ (the held-out
sample gallery, written by evaluation: vlmtrain.logging.eval_samples) and config.yaml. A line that is not a
JSON object is skipped and counted (the page says how many); a run dir without metrics.jsonl is an error.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vlmtrain.errors import ConfigError

from . import plot
from .report_files import read_jsonl
from .report_html import PAGE

MAX_CARDS = 48
"""Gallery cards per evaluated step (split over the eval sets, half of them wrong answers)."""

# Chart title -> which training-row keys it plots (a key matches a name or a `prefix*`).
TRAIN_CHARTS = [
    ("loss", ("loss", "loss_*")),
    ("learning rate", ("learning_rate*",)),
    ("grad norm", ("grad_norm",)),
    ("samples / s", ("samples_per_second",)),
    ("tokens / s", ("tokens_per_second",)),
    ("TFLOP/s", ("tflops_per_second",)),
    ("MFU", ("mfu",)),
    ("data wait (fraction of step time)", ("data_wait_fraction*",)),
]
_EVAL_BOOKKEEPING = ("eval_async", "eval_checkpoint", "eval_arrived_step", "eval_arrived_at", "eval_async_error",
                     "eval_async_status")
_EVAL_NOTES = ("eval_async_error", "eval_async_status")  # why an async evaluation logged no metrics
# Timings and counts of an evaluation: in the table, never a chart (model_preparation_time: transformers' key of
# an evaluation without training, e.g. `vlmtrain eval --checkpoint`)
_NOT_CHARTED = ("runtime", "samples_per_second", "samples", "steps_per_second", "model_preparation_time")
def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _matches(key: str, patterns: Iterable[str]) -> bool:
    return any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in patterns)


def _is_eval_row(row: dict[str, Any]) -> bool:
    return any(k.startswith("eval_") for k in row)


def train_series(rows: list[dict[str, Any]]) -> dict[str, list[plot.Series]]:
    """Chart title -> its series, for each of TRAIN_CHARTS that the training rows have data for."""
    train = [r for r in rows if not _is_eval_row(r)]
    charts = {}
    for title, patterns in TRAIN_CHARTS:
        keys = sorted({k for r in train for k in r if _matches(k, patterns) and _number(r[k]) is not None},
                      key=lambda k: (k != patterns[0].rstrip("*"), k))
        if keys:
            charts[title] = [_series(k, [(r["step"], _number(r.get(k))) for r in train]) for k in keys]
    return charts


def _series(name: str, points: list[tuple[float, float | None]], hollow: list[bool] | None = None) -> plot.Series:
    kept = sorted((x, y, h) for (x, y), h in zip(points, hollow or [False] * len(points)) if y is not None)
    return plot.Series(name, [p[0] for p in kept], [p[1] for p in kept], [p[2] for p in kept])


@dataclass
class EvalRecord:
    """Every eval metric logged for one evaluated step, inline or by asynchronous evaluation."""

    step: int
    is_async: bool
    checkpoint: str | None = None
    arrived_step: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"step {self.step}" + (" (async)" if self.is_async else "")


def eval_records(rows: list[dict[str, Any]], run_dir: str) -> list[EvalRecord]:
    """Eval rows merged per (step, inline/async), in step order (async rows may arrive out of order)."""
    records: dict[tuple[int, bool], EvalRecord] = {}
    for row in rows:
        metrics = {k: v for k, v in row.items() if k.startswith("eval_") and k not in _EVAL_BOOKKEEPING}
        notes = [str(row[k]) for k in _EVAL_NOTES if row.get(k)]
        if not metrics and not notes:
            continue
        step, is_async = int(row["step"]), bool(row.get("eval_async"))
        record = records.setdefault((step, is_async), EvalRecord(step, is_async))
        record.metrics.update(metrics)
        record.notes += notes
        if is_async:
            record.checkpoint = row.get("eval_checkpoint") or record.checkpoint
            arrived = row.get("eval_arrived_step")
            record.arrived_step = int(arrived) if _number(arrived) is not None else record.arrived_step
    for record in records.values():
        if record.checkpoint is None and os.path.isdir(os.path.join(run_dir, f"checkpoint-{record.step}")):
            record.checkpoint = f"checkpoint-{record.step}"
    return [records[k] for k in sorted(records)]


def metric_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Eval metric names (without `eval_`) grouped by the metric they measure: `color_exact_match` joins
    `exact_match` (the combined metric of several eval sets), `loss_lm` stays its own; losses first."""
    names = sorted(set(names))
    groups: dict[str, list[str]] = {}
    for name in names:  # the shortest metric it ends with: multi_color_exact_match -> exact_match
        bases = [m for m in names if m != name and name.endswith("_" + m)]
        groups.setdefault(min(bases, key=len) if bases else name, []).append(name)
    return dict(sorted(groups.items(), key=lambda g: (not g[0].startswith("loss"), g[0])))


def _charted(name: str) -> bool:
    return not any(name == n or name.endswith("_" + n) for n in _NOT_CHARTED) and "skipped_" not in name


def eval_charts(records: list[EvalRecord]) -> list[tuple[str, Any]]:
    """One chart per metric group; asynchronous evaluations are hollow markers."""
    names = {k[len("eval_"):] for r in records for k, v in r.metrics.items() if _number(v) is not None}
    charts = []
    async_note = "hollow: async evaluation" if any(r.is_async for r in records) else ""
    for base, members in metric_groups(n for n in names if _charted(n)).items():
        series = []
        for name in sorted(members, key=lambda n: (n != base, n)):
            points = [(r.step, _number(r.metrics.get(f"eval_{name}"))) for r in records]
            legend = "all sets" if name == base and len(members) > 1 else name[:-len(base) - 1] or name
            series.append(_series(legend if len(members) > 1 else name, points, [r.is_async for r in records]))
        charts.append((f"eval {base}", plot.line_chart(f"eval {base}", series, note=async_note)))
    return charts


def _format(value: Any) -> str:
    number = _number(value)
    if number is None:
        return html.escape(str(value)) if value is not None else ""
    return str(int(number)) if number.is_integer() and abs(number) < 1e6 else plot.format_number(number)


def baselines(rows: list[dict[str, Any]], run_dir: str) -> dict[str, dict[str, float]]:
    """Column title -> {metric without `eval_`: value} to show beside the model's scores: the blank-image
    evaluation the shapes demo logs (`blank_*` keys, its last step) and the data source's chance values."""
    source = _source(run_dir)
    out: dict[str, dict[str, float]] = {}
    blank_rows = [r for r in rows if any(k.startswith("blank_") for k in r)]
    if blank_rows:
        step = max(int(r["step"]) for r in blank_rows)
        blank = {k: v for r in blank_rows if int(r["step"]) == step for k, v in r.items() if k.startswith("blank_")}
        if source is not None and source.summary is not None:
            blank.update(source.summary(blank, "blank"))
        out[f"blank images (step {step})"] = {k[len("blank_"):]: v for k, v in blank.items()
                                               if _number(v) is not None}
    if source is not None and source.chance is not None:
        out["chance"] = source.chance()
    return out


def _source(run_dir: str) -> Any:
    """The data source (vlmtrain.data.registry) named by RUN_DIR/config.yaml, or None."""
    import yaml

    from vlmtrain.data.registry import SOURCES, get_source

    path = os.path.join(run_dir, "config.yaml")
    try:
        with open(path, encoding="utf-8") as f:
            name = ((yaml.safe_load(f) or {}).get("data") or {}).get("source")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return get_source(name) if name in SOURCES else None


def eval_table(records: list[EvalRecord], baseline: dict[str, dict[str, float]] | None = None) -> str:
    """Metrics as rows, evaluated steps as columns (a run has few evaluations and many metrics); then one
    column per baseline (title -> {metric without `eval_`: value}), e.g. blank images and chance."""
    baseline = baseline or {}
    head = ["<th>metric</th>"]
    for r in records:
        tag = ('<span class="tag async">async</span>' if r.is_async else '<span class="tag inline">inline</span>')
        extra = f"<br>arrived at step {r.arrived_step}" if r.arrived_step is not None else ""
        ckpt = f"<br>{html.escape(r.checkpoint)}" if r.checkpoint else ""
        notes = "".join(f'<br><span class="note" title="{html.escape(n)}">{html.escape(n[:60])}</span>'
                        for n in r.notes)
        head.append(f"<th>step {r.step} {tag}{ckpt}{extra}{notes}</th>")
    head += [f'<th class="baseline">{html.escape(title)}</th>' for title in baseline]
    names = {k[len("eval_"):] for r in records for k in r.metrics}
    groups = metric_groups(n for n in names if _charted(n))
    other = sorted(n for n in names if n in _NOT_CHARTED or n.startswith("skipped_"))  # not per set: noise
    if other:
        groups["runtime, samples, skipped"] = other
    body = []
    for base, members in groups.items():
        if len(members) > 1:
            body.append(f'<tr class="group"><td colspan="{len(records) + len(baseline) + 1}">'
                        f'{html.escape(base)}</td></tr>')
        for name in sorted(members, key=lambda n: (n != base, n)):
            cells = "".join(f"<td>{_format(r.metrics.get(f'eval_{name}'))}</td>" for r in records)
            cells += "".join(f'<td class="baseline">{_format(values.get(name))}</td>' for values in baseline.values())
            body.append(f"<tr><td>eval_{html.escape(name)}</td>{cells}</tr>")
    return (f'<div class="table-wrap"><table class="metrics"><thead><tr>{"".join(head)}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def png_data_uri(image: Any) -> str:
    """A PIL image as a data:image/png URI (charts: reduced to a palette, which they hardly need more of)."""
    buffer = io.BytesIO()
    image.quantize(colors=128, method=2).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _chart_tags(charts: list[tuple[str, Any]]) -> str:
    return "".join(f'<img alt="{html.escape(title)}" src="{png_data_uri(chart)}">' for title, chart in charts)


def write_report(run_dir: str, max_cards: int = MAX_CARDS) -> str:
    """Write RUN_DIR/report.html and RUN_DIR/curves.png; returns the report's path."""
    from .report_completions import completions_section
    from .report_gallery import gallery

    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise ConfigError(f"{run_dir!r} has no metrics.jsonl: pass a run directory (train.output_dir of a run "
                          "that logged at least once).")
    rows, bad = read_jsonl(metrics_path)
    records = eval_records(rows, run_dir)
    source = _source(run_dir)
    if source is not None and source.summary is not None:  # e.g. shapes' single-/multi-image means
        for record in records:
            record.metrics = {**source.summary(record.metrics, "eval"), **record.metrics}
    train = [(title, plot.line_chart(title, series)) for title, series in train_series(rows).items()]
    evals = eval_charts(records)
    plot.grid([chart for _, chart in train + evals]).save(os.path.join(run_dir, "curves.png"), optimize=True)
    warnings = [f"metrics.jsonl: {bad} line(s) were not JSON objects with a step and were skipped."] if bad else []
    gallery_html, styles, gallery_warnings = gallery(run_dir, max_cards)
    warnings += gallery_warnings
    eval_section = (f'<div class="charts">{_chart_tags(evals)}</div>{eval_table(records, baselines(rows, run_dir))}'
                    if records
                    else '<p class="note">No evaluation was logged (eval_* keys in metrics.jsonl).</p>')
    page = PAGE.substitute(
        title=html.escape(os.path.basename(os.path.abspath(run_dir))),
        meta=html.escape(f"{os.path.abspath(run_dir)} · written {datetime.datetime.now():%Y-%m-%d %H:%M} · "
                         f"{len(rows)} metric rows"),
        warnings="".join(f'<p class="warn">{html.escape(w)}</p>' for w in warnings),
        summary=_summary(rows),
        train_charts=_chart_tags(train) or '<p class="note">No training rows in metrics.jsonl.</p>',
        completions=completions_section(rows),
        eval_section=eval_section, gallery=gallery_html, thumbnail_styles="\n".join(styles),
        config=_config(run_dir))
    path = os.path.join(run_dir, "report.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def _summary(rows: list[dict[str, Any]]) -> str:
    """Last step, last training loss, and the run's final numbers (train_runtime, ...)."""
    train = [r for r in rows if not _is_eval_row(r)]
    items = {}
    if rows:
        items["last step"] = max(int(r["step"]) for r in rows)
    last_loss = next((r for r in reversed(train) if _number(r.get("loss")) is not None), None)
    if last_loss is not None:
        items[f"loss at step {last_loss['step']}"] = last_loss["loss"]
    for row in train:
        items.update({k: v for k, v in row.items() if k.startswith("train_")})
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{_format(v)}</td></tr>" for k, v in items.items())
    return f'<table class="summary">{cells}</table>' if cells else '<p class="note">No rows.</p>'


def _config(run_dir: str) -> str:
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return f"<h2>Config</h2><details><summary>config.yaml</summary><pre>{html.escape(text)}</pre></details>"
