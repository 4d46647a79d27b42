"""Evaluation over several ranks: each rank evaluated its share of the eval set (rank r: samples r, r + W,
r + 2W, ... of a map-style set, or its part of a stream that splits by rank), and every rank gets the whole set's
losses, counts, predictions and labels back, rows in dataset order. Counts and tensor layouts go as small
pickles; predictions and labels as tensors (one padded all_gather per output). The trainer never imports this
module: :func:`gather_shards` is vlmtrain.Trainer's ``eval_gather`` part (trainer/parts.py)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as torch_dist

from ..trainer import distributed as dist
from ..trainer.predictions import Collected, pad_cat
from ..trainer.stats import LossAverager


def gather_shards(losses: LossAverager, preds: Collected, labels: Collected, samples: int, skipped: Counter,
                  interleave: bool) -> tuple[LossAverager, int, Counter]:
    """Every rank's evaluation results, combined on every rank (``preds`` and ``labels`` in place; the losses,
    samples and skipped counts returned). Rows come back in dataset order: rank r evaluated samples r, r + W,
    r + 2W, ... (``interleave``), or in rank order for a stream. Every rank calls it."""
    mine = {"losses": losses.state_dict(), "preds": layout(preds), "labels": layout(labels), "samples": samples,
            "skipped": dict(skipped)}
    everyone = dist.all_gather_objects(mine)
    total = LossAverager()
    for part in everyone:
        shard = LossAverager()
        shard.load_state_dict(part["losses"])
        total.merge(shard)
    gather(preds, [part["preds"] for part in everyone], interleave)
    gather(labels, [part["labels"] for part in everyone], interleave)
    return total, sum(p["samples"] for p in everyone), sum((Counter(p["skipped"]) for p in everyone), Counter())


def layout(collected: Collected) -> dict[str, Any]:
    """What the other ranks need to gather this rank's :func:`rows` as tensors: the kind and, per key, the dtype
    and the shape of a row (small: this goes through pickling, the rows do not)."""
    return {"kind": collected.kind, "keys": {k: (c[0].dtype, tuple(c[0].shape[1:]))
                                             for k, c in collected.chunks.items() if c}}


def rows(collected: Collected) -> dict[str, Any]:
    """This rank's rows: the kind and one tensor per key (its batches concatenated, padded along dim 1)."""
    return {"kind": collected.kind, "rows": {k: pad_cat(c) for k, c in collected.chunks.items() if c}}


def gather(collected: Collected, layouts: list[dict[str, Any]], interleave: bool) -> None:
    """Every rank's rows, put together in ``collected`` on every rank (see :func:`set_rows`) through one padded
    tensor all_gather per key. Every rank calls it, with every rank's :func:`layout` in rank order."""
    mine, parts = rows(collected)["rows"], [{"kind": lay["kind"], "rows": {}} for lay in layouts]
    for key in dict.fromkeys(k for lay in layouts for k in lay["keys"]):
        dtype, row_shape = next(lay["keys"][key] for lay in layouts if key in lay["keys"])
        tensor = mine.get(key, torch.empty((0, *row_shape), dtype=dtype))
        for part, lay, theirs in zip(parts, layouts, all_gather_padded(tensor)):
            if key in lay["keys"]:
                part["rows"][key] = theirs
    set_rows(collected, parts, interleave)


def set_rows(collected: Collected, parts: list[dict[str, Any]], interleave: bool) -> None:
    """Every rank's :func:`rows` put together in ``collected``: round-robin over ranks (rank r evaluated samples
    r, r + W, ...: dataset order) if ``interleave``, else in rank order."""
    collected.kind = next((p["kind"] for p in parts if p["kind"] is not None), None)
    keys = list(dict.fromkeys(k for p in parts for k in p["rows"]))
    collected.chunks, collected._arrays = {}, None
    for key in keys:
        per_rank = [p["rows"][key] for p in parts if key in p["rows"]]
        counts = [len(t) for t in per_rank]
        starts = [sum(counts[:r]) for r in range(len(counts))]
        if interleave:
            order = [starts[r] + i for i in range(max(counts)) for r in range(len(counts)) if i < counts[r]]
        else:
            order = list(range(sum(counts)))
        collected.chunks[key] = [pad_cat(per_rank)[order]]


def all_gather_padded(tensor: torch.Tensor, pad: float = -100) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same ndim and dtype on every rank; shapes may differ), in rank order, as tensors
    through the gloo metrics group (no pickling): the shapes first, then one all_gather of the tensors padded
    with ``pad`` to the largest shape. Each comes back with its own rows (dim 0), padded along the other dims."""
    if not dist.is_distributed():
        return [tensor]
    group = dist.metrics_group()
    shape = torch.tensor(tensor.shape, dtype=torch.long)
    shapes = [torch.empty_like(shape) for _ in range(dist.world_size())]
    torch_dist.all_gather(shapes, shape, group=group)
    largest = torch.stack(shapes).amax(0).tolist()
    padded = tensor.new_full(largest, pad)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    out = [torch.empty_like(padded) for _ in shapes]
    torch_dist.all_gather(out, padded, group=group)
    return [t[:int(s[0])] for t, s in zip(out, shapes)]
