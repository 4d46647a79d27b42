"""Per-sample evaluation results for the run report (`vlmtrain report`).

Each evaluation during training writes ``<output_dir>/eval_samples_step_<N>.jsonl`` (N: the step evaluated),
one row per eval sample, in dataset order::

    {"step": N, "set": "color", "index": 0, "id": "val-0", "question": "...", "truth": "red",
     "generated": "red", "correct": true, "images": ["eval_thumbnails/color/0-0.png"], "num_images": 1}

``set`` names the eval set when there are several (else null). With predict_with_generate, ``generated`` is
the decoded answer and ``correct`` whether it equals the last assistant turn (stripped). A model with score
heads evaluated without generation gets ``heads``: ``{name: {"predicted": ..., "truth": ..., "correct": ...}}``
(``correct`` only for classification) and ``correct`` true when every classification head is right. A run
evaluated with neither (losses only) writes nothing.

Images are stored once per run as small thumbnails under ``<output_dir>/eval_thumbnails/`` (the eval set is
the same at every step): rows refer to them by path relative to the output dir. Only rank 0 writes, only
when the step is known (in training, or evaluating checkpoint-N: `vlmtrain eval --checkpoint`), and only the
`eval` prefix (not, e.g., the demo's
`blank` evaluation). A set whose batches lost bad samples, or a stream split across ranks, cannot be lined up
with its samples: it is left out, with a warning.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

THUMBNAIL_SIZE = 96
"""Longest side of a stored thumbnail, in pixels."""
MAX_THUMBNAIL_SAMPLES = 512
"""Samples per eval set that get thumbnails (the report shows a few dozen cards per checkpoint)."""
THUMBNAIL_DIR = "eval_thumbnails"
_PNG_LIMIT = 6000  # bytes: a thumbnail that compresses worse as PNG (a photo) is stored as JPEG


def samples_path(output_dir: str, step: int) -> str:
    """Where the per-sample results of the evaluation at ``step`` go."""
    return os.path.join(output_dir, f"eval_samples_step_{step}.jsonl")


def save_eval_samples(trainer: Any, dataset: Any, output: Any, metric_key_prefix: str) -> str | None:
    """Write (rank 0) the per-sample results of one evaluated set; returns the file's path, or None when
    nothing was written. Called by Trainer.evaluate once per eval set (its ``eval_samples`` part)."""
    state = trainer.state
    if trainer.rank != 0 or not (state.max_steps or state.global_step) or not trainer.args.output_dir:
        return None  # no step to name the file by: neither training nor a checkpoint's evaluation
    writer = trainer.__dict__.setdefault("_eval_sample_writer", EvalSampleWriter(trainer.args.output_dir))
    return writer.write(trainer, dataset, output, metric_key_prefix, trainer.state.global_step)


class EvalSampleWriter:
    """Writes eval_samples_step_N.jsonl files; remembers each eval set's questions, truths and thumbnails
    (read from the dataset once per run) and which sets each file holds (several sets append to one file;
    evaluating a set again at the same step rewrites the file)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        # (id(dataset), set) -> (dataset, its rows): the reference keeps the id from being reused
        self._samples: dict[tuple[int, str | None], tuple[Any, list[dict[str, Any]]]] = {}
        self._written: dict[str, set[str | None]] = {}
        self._warned: set[str | None] = set()

    def write(self, trainer: Any, dataset: Any, output: Any, prefix: str, step: int) -> str | None:
        if prefix != "eval" and not prefix.startswith("eval_"):
            return None
        name = prefix[len("eval_"):] if prefix != "eval" else None
        predictions = prediction_rows(output, trainer.model, trainer.processing_class)
        if predictions is None:
            return None
        skipped = sum(v for k, v in output.metrics.items() if k.startswith(f"{prefix}_skipped_"))
        if skipped or trainer._eval_sharding(dataset) == "stream":
            self._warn(name, f"eval set {name or prefix!r}: {skipped} bad samples were skipped" if skipped else
                       f"eval set {name or prefix!r} is a stream split across ranks")
            return None
        samples = self._sample_info(dataset, name, len(predictions))
        if samples is None:
            return None
        rows = [{"step": step, "set": name, "index": i, **sample, **pred}
                for i, (sample, pred) in enumerate(zip(samples, predictions))]
        score_rows(rows)
        path = samples_path(self.output_dir, step)
        sets = self._written.get(path)
        append = sets is not None and name not in sets
        self._written[path] = (sets | {name}) if append else {name}
        os.makedirs(self.output_dir, exist_ok=True)  # (`vlmtrain eval` may evaluate before anything is logged)
        with open(path, "a" if append else "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, default=_plain) + "\n" for row in rows)
        return path

    def _warn(self, name: str | None, why: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("%s: its predictions cannot be matched to samples, so eval_samples_step_*.jsonl "
                           "leaves it out", why)

    def _sample_info(self, dataset: Any, name: str | None, count: int) -> list[dict[str, Any]] | None:
        """Question, truth, id and thumbnail paths of the first ``count`` samples (cached per dataset)."""
        key = (id(dataset), name)
        cached = self._samples.get(key, (None, []))[1]
        if len(cached) >= count:
            return cached[:count]
        if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
            raw = (dataset[i] for i in range(min(count, len(dataset))))
        else:
            raw = itertools.islice(iter(dataset), count)
        info = [self._describe(sample, name, i) for i, sample in enumerate(raw)]
        if len(info) < count:
            self._warn(name, f"eval set {name!r} has fewer samples than predictions")
            return None
        self._samples[key] = (dataset, info)
        return info

    def _describe(self, sample: Any, name: str | None, index: int) -> dict[str, Any]:
        if not isinstance(sample, Mapping):
            return {"id": None, "question": None, "truth": None, "images": [], "num_images": 0}
        turns = [t for t in sample.get("texts") or [] if isinstance(t, Mapping)]
        last = turns[-1] if turns else {}
        images = list(sample.get("images") or [])
        info = {"id": sample.get("id", sample.get("__key__")), "question": last.get("user"),
                "truth": last.get("assistant"), "images": [], "num_images": len(images)}
        if isinstance(sample.get("labels"), Mapping):
            info["labels"] = dict(sample["labels"])
        if index < MAX_THUMBNAIL_SAMPLES:
            folder = os.path.join(THUMBNAIL_DIR, name or "eval")
            for k, image in enumerate(images):
                ref = save_thumbnail(image, self.output_dir, os.path.join(folder, f"{index}-{k}"))
                if ref is not None:
                    info["images"].append(ref)
        return info


def save_thumbnail(image: Any, root: str, stem: str) -> str | None:
    """A thumbnail of ``image`` (PIL image, path, bytes, or a {"bytes"|"path"} dict) written to
    ``root/stem.png`` (or .jpg for a photo); returns its path relative to root, or None if it cannot be read."""
    from PIL import Image

    try:
        if isinstance(image, Mapping):
            image = image.get("bytes") or image.get("path")
        if isinstance(image, (bytes, bytearray)):
            image = Image.open(io.BytesIO(image))
        elif isinstance(image, (str, os.PathLike)):
            image = Image.open(image)
        if not isinstance(image, Image.Image):
            return None
        thumb = image.convert("RGB")
        thumb.thumbnail((THUMBNAIL_SIZE, THUMBNAIL_SIZE))
    except (OSError, ValueError):  # a missing or corrupt image: the card shows none
        return None
    buffer = io.BytesIO()
    thumb.save(buffer, format="PNG", optimize=True)
    ext = ".png"
    if buffer.tell() > _PNG_LIMIT:
        buffer = io.BytesIO()
        thumb.save(buffer, format="JPEG", quality=85)
        ext = ".jpg"
    path = os.path.join(root, stem + ext)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
    return stem + ext


def prediction_rows(output: Any, model: Any, processing_class: Any) -> list[dict[str, Any]] | None:
    """Per sample, what the model predicted: ``generated`` text (generation), or ``heads`` (score heads);
    None when the evaluation kept no predictions."""
    if output.heads:
        return _head_rows(output.heads, getattr(model, "head_configs", None) or {})
    if output.predictions is None or output.texts is None:
        return None
    ids = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
    tok = getattr(processing_class, "tokenizer", processing_class)
    eos = getattr(tok, "eos_token_id", None)
    rows = []
    for row in np.asarray(ids).tolist():
        if eos is not None and eos in row:  # what exact match scores: the answer up to its end
            row = row[:row.index(eos)]
        rows.append({"generated": tok.decode([t for t in row if t >= 0], skip_special_tokens=True).strip()})
    return rows


def _head_rows(heads: Mapping[str, Any], configs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per sample, each head's prediction: class index (ce), 0/1 list (bce) or value(s) (regression)."""
    rows: list[dict[str, Any]] = []
    for name, logits in heads.items():
        config, values = configs.get(name), np.asarray(logits, dtype=np.float64)
        for i, v in enumerate(values.reshape(len(values), -1)):
            if len(rows) <= i:
                rows.append({"heads": {}})
            if config is not None and config.type == "classification":
                predicted = [int(x) for x in v > 0] if config.loss == "bce" else int(np.argmax(v))
            else:
                predicted = round(float(v[0]), 6) if v.size == 1 else [round(float(x), 6) for x in v]
            rows[i]["heads"][name] = {"predicted": predicted, "classification": bool(
                config is not None and config.type == "classification")}
    return rows


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def score_rows(rows: list[dict[str, Any]]) -> None:
    """Fill ``truth``/``correct`` of each head from the sample's labels, and each row's ``correct``."""
    for row in rows:
        labels = row.pop("labels", None) or {}
        if "heads" not in row:
            if row.get("generated") is not None and row.get("truth") is not None:
                row["correct"] = row["generated"] == str(row["truth"]).strip()
            continue
        verdicts = []
        for name, head in row["heads"].items():
            truth = labels.get(name)
            head["truth"] = truth.tolist() if hasattr(truth, "tolist") else truth
            if head.pop("classification") and truth is not None:
                head["correct"] = head["predicted"] == head["truth"]
                verdicts.append(head["correct"])
        if verdicts:
            row["correct"] = all(verdicts)

