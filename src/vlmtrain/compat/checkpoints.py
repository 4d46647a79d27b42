"""Resuming from a checkpoint that transformers' Trainer wrote: it has no ``loop_state_<rank>.pt`` (vlmtrain's
data position and logging window), so the position follows from its global_step, by transformers' rule. The
trainer never imports this module: :func:`position_from_step` is vlmtrain.Trainer's
``step_position`` part (trainer/parts.py)."""

from __future__ import annotations

import itertools
import math
import warnings
from typing import Any

from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from vlmtrain.errors import CheckpointError


def position_from_step(path: str, loop_file: str, loader: Any, global_step: int, max_steps: int,
                       steps_in_epoch: int | None, accumulation: int) -> tuple[int, int]:
    """Where a checkpoint without vlmtrain's loop state (``loop_file``, e.g. loop_state_0.pt) resumes, as
    (epoch index, micro-step), by transformers' rule: epoch global_step // updates per epoch, after (global_step %
    updates per epoch) * gradient_accumulation_steps micro-batches of it, which ``loader`` (the train data
    loader) reads and drops (O(position): once). Lost next to a vlmtrain checkpoint: the losses of a logging
    window cut by the save (the first log after the resume averages the steps since it, as transformers' does),
    the run's mean loss before it (TrainOutput.training_loss covers the resumed steps), and the skipped-sample
    counts."""
    warnings.warn(f"{path!r} has no {loop_file} (a checkpoint of transformers' Trainer?): "
                  f"resuming at the data position global_step gives, as transformers does.", stacklevel=4)
    per_epoch = math.ceil(steps_in_epoch / accumulation) if steps_in_epoch is not None else max_steps
    epoch_index, micro_step = global_step // per_epoch, (global_step % per_epoch) * accumulation
    if micro_step == 0:
        return epoch_index, micro_step
    if not hasattr(loader, "load_state_dict"):
        raise CheckpointError(f"Resuming {path!r} mid-epoch without {loop_file} needs a "
                              "train data loader with state_dict/load_state_dict (a StatefulDataLoader).")
    if isinstance(loader.sampler, StatefulDistributedSampler):
        loader.sampler.set_epoch(epoch_index)
    elif hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch_index)
    skip_batches(loader, micro_step)
    return epoch_index, micro_step


def skip_batches(loader: Any, count: int) -> None:
    """Position a StatefulDataLoader after its first ``count`` batches of the epoch (drawn and dropped: the only
    way for a loader without a saved position), so that its next iteration starts there."""
    batches = iter(loader)
    for _ in itertools.islice(batches, count):
        pass
    position = loader.state_dict()
    del batches
    loader.load_state_dict(position)
