"""Predictions with a trained checkpoint: the eval set's answers or head scores (`vlmtrain predict --config C
--checkpoint DIR`), and new data scored by the heads (`vlmtrain predict --checkpoint DIR --data ...`). Rows are
keyed by each sample's place (and id) in its data, so a skipped sample never shifts the others, also when
ranks share the work."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

from vlmtrain.checkpoint_paths import check_writable, resolve_checkpoint
from vlmtrain.compose import build
from vlmtrain.config import ConfigError, RunConfig
from vlmtrain.errors import warn_caller

logger = logging.getLogger(__name__)


def predict(cfg: RunConfig, checkpoint: str) -> list[str]:
    """Predictions for the eval set with a checkpoint's weights: the generated answers, or for a model with
    score heads one JSON object per eval sample, keyed by its place in the eval set (``index``; also ``id``
    when the record has one, ``eval_set`` with several eval sets): each head's output (class and
    probabilities, or value), or ``skipped`` (the reason) for a sample the processing skips. Head rows are
    also written to <train.output_dir>/predictions.jsonl. Under torchrun each rank scores its share."""
    ckpt = resolve_checkpoint(checkpoint, cfg.train.output_dir)
    heads = bool(getattr(cfg.model, "heads", None))
    if heads:  # predictions.jsonl goes there
        check_writable(cfg.train.output_dir, "--train.output_dir")
    args = dataclasses.replace(cfg.train, predict_with_generate=not heads)  # predict means generate, or heads
    trainer = build(dataclasses.replace(cfg, train=args), checkpoint=ckpt)
    if trainer.eval_dataset is None:
        raise ConfigError("predict needs an eval set: set data.num_eval > 0 (or data.eval_file).")
    datasets = trainer.eval_dataset if isinstance(trainer.eval_dataset, dict) else {None: trainer.eval_dataset}
    if heads:
        return _predict_heads(cfg, trainer, datasets)
    lines: list[str] = []
    for dataset in datasets.values():
        out = trainer.predict(dataset)
        if out.texts is not None:
            lines += list(out.texts)
        else:
            ids = [[int(t) for t in row if t >= 0] for row in out.predictions]  # drop -100 padding
            lines += trainer.processing_class.batch_decode(ids, skip_special_tokens=True)
    return lines


def _predict_heads(cfg: RunConfig, trainer: Any, datasets: dict[str | None, Any]) -> list[str]:
    """Score-head rows of the eval set(s), each keyed by the sample's index (skipped samples keep theirs)."""
    from vlmtrain.inference import InferenceModel, score_rows
    from vlmtrain.trainer import distributed

    collator = trainer.data_collator.without_packing()
    model = trainer.model.to(trainer.device).eval()
    inference = InferenceModel(model, trainer.processing_class, collator.processor.process, collator,
                               device=trainer.device)
    lines: list[str] = []
    for name, dataset in datasets.items():
        rows = score_rows(inference, _indexed_share(dataset, trainer.rank, trainer.world_size),
                          batch_size=cfg.train.per_device_eval_batch_size,
                          num_workers=trainer.dataloader_workers())
        rows = _gather_rows(rows, distributed)
        for row in rows:
            order = row.pop("__order__")
            lines.append(json.dumps({**({"eval_set": name} if name else {}), "index": order, **row}))
    if trainer.rank == 0:
        os.makedirs(cfg.train.output_dir, exist_ok=True)
        path = os.path.join(cfg.train.output_dir, "predictions.jsonl")
        _write_lines(path, lines)
        logger.info("wrote %d head predictions to %s", len(lines), path)
        warn_skipped([json.loads(line) for line in lines])
    return lines


def _indexed_share(dataset: Any, rank: int, world_size: int) -> Any:
    """A map-style eval set's samples r, r + W, ... for rank r of W (a stream: its own per-rank share, numbered
    by rank and position), tagged with their index (``__order__``) and their record's id (``__id__``)."""
    from torch.utils.data import IterableDataset, get_worker_info

    class IndexedShare(IterableDataset):
        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = get_worker_info()
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
                for n, sample in enumerate(dataset):  # a stream splits itself across ranks
                    if n % workers == worker:
                        yield {**sample, "__order__": (rank, n), "__id__": sample.get("id")}
                return
            for i in range(rank + world_size * worker, len(dataset), world_size * workers):
                sample = dict(dataset[i])
                yield {**sample, "__order__": i, "__id__": sample.get("id")}

    return IndexedShare()


def _gather_rows(rows: list[dict[str, Any]], distributed: Any) -> list[dict[str, Any]]:
    """Every rank's rows on every rank, in data-set order (by ``__order__``)."""
    everyone = [row for part in distributed.all_gather_objects(rows) for row in part]
    return sorted(everyone, key=lambda r: r["__order__"])


def _write_lines(path: str, lines: list[str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(line + "\n" for line in lines)
    os.replace(tmp, path)


def predict_data(checkpoint: str, data: str | list[str], output: str = "predictions.jsonl", batch_size: int = 8,
                 num_workers: int = 0, device: str | None = None, dtype: str | None = None,
                 max_new_tokens: int | None = None) -> str:
    """Score new data with a checkpoint's heads, or answer it without heads (``vlmtrain predict --checkpoint DIR
    --data ...``): ``data`` is a JSONL file (image paths relative to it) or WebDataset shards in the training
    sample format (labels optional). Writes ``output``: one JSON row per input sample, in data order, ``{"id":
    ..., <head>: ...}`` (see InferenceModel.score for the head fields), for a model without heads ``{"id": ...,
    "generated": answer}`` (greedy, at most ``max_new_tokens``: default the run's
    train.generation_max_new_tokens, else 32), or ``{"id": ..., "skipped": reason, "detail": ...}``; ids
    as NumberedSamples gives them. Samples are processed in ``num_workers`` data-loader workers and scored in
    batches of ``batch_size`` on the GPU when there is one; under torchrun each rank scores its share and
    rank 0 writes the file. No config needed (limits come from the run's config.yaml when there is one). Data
    without any sample is a ConfigError naming it (nothing is written).
    Returns ``output``."""
    from vlmtrain.inference import NumberedSamples, generate_rows, load_for_inference, open_data, score_rows
    from vlmtrain.trainer import distributed

    distributed.init_from_env()
    source = open_data(data)
    if not any(True for shard in range(len(source.shards)) for _ in source.read(shard, {})):
        raise ConfigError(f"--data {data!r} holds no samples (an empty file, or shards without members): "
                          f"nothing to predict; point --data at a JSONL file or shards in the training format.")
    check_writable(os.path.dirname(output) or ".", "--output")  # (written after every sample is scored)
    inference = load_for_inference(checkpoint, device=device, dtype=dtype)  # (None: inference's default device)
    samples = NumberedSamples(source, distributed.rank(), distributed.world_size())
    if inference.head_configs:
        rows = score_rows(inference, samples, batch_size=batch_size, num_workers=num_workers)
    else:  # answers, as evaluation with predict_with_generate makes them
        rows = generate_rows(inference, samples, batch_size=batch_size, num_workers=num_workers,
                             max_new_tokens=max_new_tokens or _run_max_new_tokens(inference.checkpoint))
    rows = _gather_rows(rows, distributed)
    if distributed.rank() == 0:
        if os.path.dirname(output):
            os.makedirs(os.path.dirname(output), exist_ok=True)
        for row in rows:
            row.pop("__order__")
        _write_lines(output, [json.dumps(row) for row in rows])
        logger.info("wrote %d rows to %s", len(rows), output)
        warn_skipped(rows)
    return output


def _run_max_new_tokens(checkpoint: str | None) -> int:
    """The run's train.generation_max_new_tokens (its config.yaml next to the checkpoint), else 32."""
    from vlmtrain.models.hub.hub_loading import run_config_section

    return int(run_config_section(checkpoint, "train").get("generation_max_new_tokens") or 32) if checkpoint else 32


def warn_skipped(rows: list[dict[str, Any]]) -> None:
    """Say how many rows are skipped samples, by reason, as training does (one warning; none without skips)."""
    reasons = Counter(row["skipped"] for row in rows if "skipped" in row)
    if reasons:
        warn_caller(f"{sum(reasons.values())} of {len(rows)} samples were skipped (rows with 'skipped'): "
                    f"{dict(sorted(reasons.items()))}")
