"""Resuming a checkpoint that another number of processes (world size) wrote.

A map-style dataset's position is exact in any world size: every rank's sampler takes its share of one shuffle
of the epoch (rank r: positions r, r + W, ...), so a checkpoint whose ranks had each taken k samples had taken
the shuffle's first W x k, and each of W' new ranks goes on after its share of them. The loop's counters go with
it: micro-steps scale by W / W', the per-rank sums of the logging window, of the run's mean loss and of the
skipped samples are summed into rank 0's. An epoch-based run (max_steps unset) ends at its epoch's end, whatever
the steps took before. A position that W' ranks cannot split evenly, and a streamed (iterable) dataset, whose
position is one per rank and its shards', are refused naming both world sizes. New ranks start from rank 0's RNG
state (all ranks are seeded alike at the start).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import Any

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from .loader_state import batches_yielded
from .model_files import CheckpointError

_RANK_FILE = re.compile(r"^(?:loop_state|rng_state)_(\d+)\.(?:pt|pth)$")


def saved_world_size(path: str) -> int:
    """How many processes wrote the checkpoint ``path``: its per-rank files (loop_state_<r>.pt, else
    rng_state_<r>.pth; transformers' rng_state.pth alone: 1)."""
    ranks = {int(m.group(1)) for m in map(_RANK_FILE.match, os.listdir(path)) if m}
    return max(ranks) + 1 if ranks else 1


def loop_state_for_rank(states: list[dict], rank: int) -> dict:
    """This rank's loop state from every saved rank's (``states``, by rank; other world size): rank 0's position
    and counters, with the per-rank sums (logging window, run loss, skipped samples) of all of them on rank 0 and
    none on the other ranks, so that their sums over the new ranks are the saved ones."""
    loop = dict(states[0])
    for key in ("train_losses", "run_loss"):
        sums: Counter[str] = Counter()
        weights: Counter[str] = Counter()
        for state in states if rank == 0 else []:
            sums.update(state.get(key, {}).get("sums", {}))
            weights.update(state.get(key, {}).get("weights", {}))
        loop[key] = {"sums": dict(sums), "weights": dict(weights)}
    skipped: Counter[str] = Counter()
    for state in states if rank == 0 else []:
        skipped.update(state.get("skipped", {}))
    loop["skipped"] = dict(skipped)
    return loop


def reposition(loader: Any, loop: dict, saved: int, world_size: int, accumulation: int, path: str) -> int:
    """Put ``loader`` (this rank's, of ``world_size``) at the epoch position of ``loop`` (saved by ``saved``
    ranks) and return the micro-step there in this world size; a CheckpointError naming both world sizes where
    it is not exact."""
    micro_step, state = loop["micro_step"], loop["loader"]
    refusal = f"{path} was written by {saved} process(es) and is resumed by {world_size}"
    if state is None:  # (at an epoch's end, or a loader without state: the epoch's data starts afresh)
        return micro_step * saved // world_size // accumulation * accumulation
    sampler = getattr(loader, "sampler", None)
    if isinstance(getattr(loader, "dataset", None), IterableDataset) or \
            not isinstance(sampler, StatefulDistributedSampler) or getattr(loader, "batch_size", None) is None:
        raise CheckpointError(f"{refusal}: a streamed train_dataset keeps one position per process, mid-epoch here; "
                              f"resume with {saved} process(es) (torchrun --nproc_per_node={saved}).")
    taken = batches_yielded(state) * loader.batch_size * saved  # the epoch's samples the saved ranks had taken
    if taken % world_size or micro_step * saved % (world_size * accumulation):
        raise CheckpointError(f"{refusal}: its epoch position ({taken} samples, {micro_step} micro-batches per "
                              f"process) does not split evenly over {world_size}; resume with {saved} process(es), "
                              "or from a checkpoint at another step.")
    sampler.load_state_dict({"yielded": min(taken // world_size, len(sampler))})
    return micro_step * saved // world_size


def max_steps_after(global_step: int, epoch_index: int, micro_step: int, steps_in_epoch: int,
                    accumulation: int, num_train_epochs: float) -> int:
    """An epoch-based run's last step when resumed at ``micro_step`` of epoch ``epoch_index`` in a new world
    size: the steps done, then the new size's steps left to the end of num_train_epochs."""
    per_epoch = math.ceil(steps_in_epoch / accumulation)
    done = epoch_index * per_epoch + micro_step // accumulation
    return global_step + max(0, math.ceil(num_train_epochs * per_epoch) - done)
