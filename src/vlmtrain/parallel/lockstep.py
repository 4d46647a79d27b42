"""Evaluation of a sharded model with each rank on its share of the eval set. Under FSDP every forward is a
collective, so each rank must run as many as the others, though the shares differ in length (and a batch whose
samples were all bad has nothing to run): :func:`eval_in_step` keeps the ranks in step. The trainer never imports
this module: it is the ``eval_in_step`` of vlmtrain.Trainer's ``sharding`` part (fsdp.py's FSDPPlan)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from vlmtrain.trainer import distributed as dist
from vlmtrain.trainer.stats import is_empty_batch, skipped_counts


def eval_in_step(batches: Iterator[Any], skipped: Counter, run_stand_in: Callable[[Any], Any]) -> Iterator[Any]:
    """This rank's eval ``batches`` to run, in step with the other ranks: a batch whose samples were all bad is
    counted in ``skipped``; while any rank still has a batch, a rank without one (its share is done, or its batch
    was all bad) runs a stand-in with ``run_stand_in(batch)`` (its results dropped). Every rank iterates it to
    the end."""
    stand_in = None
    while True:
        batch = next(batches, None)
        if batch is not None and is_empty_batch(batch):
            skipped.update(skipped_counts(batch))
        what, batch = _turn(batch, stand_in)
        if what == "end":
            return
        if what == "skip":
            continue
        stand_in = batch
        if what == "stand_in":  # this rank's share is done (or this batch was all bad): results dropped
            run_stand_in(batch)
            continue
        yield batch


def _turn(batch: Any, stand_in: Any) -> tuple[str, Any]:
    """Every rank reports whether it still has a batch and whether that batch has samples; then it is told what
    to do with this one: ("end", None) when no rank has a batch left, ("skip", None) when no rank has a sample to
    run, ("real", batch), or ("stand_in", B): run B (this rank's last real batch, else a batch another rank sends)
    and drop its results."""
    w, r = dist.world_size(), dist.rank()
    real = batch is not None and not is_empty_batch(batch)
    flags = [0.0] * (3 * w)
    flags[r], flags[w + r], flags[2 * w + r] = float(batch is not None), float(real), float(
        not real and stand_in is None)
    flags = dist.reduce_cpu(flags)
    has_batch, has_samples, needs_one = flags[:w], flags[w:2 * w], flags[2 * w:]
    if not any(has_batch):
        return "end", None
    if not any(has_samples):
        return "skip", None
    if any(has_samples[i] == 0 and needs_one[i] for i in range(w)):  # a rank with no batch to stand in
        donor = next(i for i in range(w) if has_samples[i])
        sent = dist.broadcast_object(batch if r == donor else None, donor)
        stand_in = stand_in if stand_in is not None else sent
    return ("real", batch) if real else ("stand_in", stand_in)
