"""Resuming a checkpoint that another number of processes (world size) or of data loader workers wrote: the
train loader's position and the loop's counters carried over. The trainer never imports this module:
:data:`REPOSITION` is vlmtrain.Trainer's ``reposition`` part (trainer/parts.py); the core alone refuses such a
checkpoint, naming the part.

Workers. torchdata's StatefulDataLoader saves a state whose layout depends on ``num_workers`` (one process, or a
snapshot per worker), and refuses a state of the other layout (``State doesn't contain key '_num_yielded'``). The
number changes when a run moves between machines (``dataloader_num_workers: auto`` resolves to 0 on CPU and up to
4 on CUDA). For a map-style dataset the position does not depend on the workers: it is how many of this rank's
sample indices the epoch has consumed, which the sampler (a StatefulDistributedSampler) restarts from. A streamed
dataset keeps one position per worker (each reads its own share of the shards): it needs the saved number, and is
refused naming it.

Processes. A map-style dataset's position is exact in any world size: every rank's sampler takes its share of one
shuffle of the epoch (rank r: positions r, r + W, ...), so a checkpoint whose ranks had each taken k samples had
taken the shuffle's first W x k, and each of W' new ranks goes on after its share of them. The loop's counters go
with it: micro-steps scale by W / W', the per-rank sums of the logging window, of the run's mean loss and of the
skipped samples are summed into rank 0's. An epoch-based run (max_steps unset) ends at its epoch's end, whatever
the steps took before. A position that W' ranks cannot split evenly, and a streamed (iterable) dataset, whose
position is one per rank and its shards', are refused naming both world sizes. New ranks start from rank 0's RNG
state (all ranks are seeded alike at the start).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from typing import Any

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from ..errors import CheckpointError
from ..trainer.resume import saved_workers


def batches_yielded(state: dict[str, Any]) -> int:
    """How many batches the loader that wrote ``state`` had yielded in its epoch."""
    snapshot = state.get("_snapshot")
    if snapshot is None:
        return int(state["_num_yielded"])
    return int(snapshot["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))


def load_loader_state(loader: Any, state: dict[str, Any], checkpoint: str) -> None:
    """Restore ``loader`` (a StatefulDataLoader) to ``state``, saved in ``checkpoint`` by a loader with another
    number of workers (map-style data): the sampler restarts after the samples the epoch had consumed,
    ``batches x batch_size``, and the loader starts a fresh iterator there."""
    workers, saved = int(getattr(loader, "num_workers", 0)), saved_workers(state)
    sampler, batch_size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
    if isinstance(getattr(loader, "dataset", None), IterableDataset) or not isinstance(sampler, StatefulDistributedSampler) \
            or batch_size is None:
        raise ValueError(
            f"{checkpoint}: its data position was saved with dataloader_num_workers={saved}, and this run has "
            f"dataloader_num_workers={workers}. A streamed (iterable) train_dataset keeps one position per worker: "
            f"resume with train.dataloader_num_workers={saved} ('auto' resolves by machine: 0 without CUDA, up to "
            f"4 with it).")
    sampler.load_state_dict({"yielded": min(batches_yielded(state) * batch_size, len(sampler))})


def loop_state(states: list[dict], loader: Any, path: str, saved: int, rank: int, world_size: int,
               accumulation: int) -> dict:
    """This rank's loop state from the saved ranks' ``states`` (by rank: every one on rank 0, rank 0's on the
    others) of checkpoint ``path``, written by ``saved`` processes and resumed by ``world_size``: ``loader`` put
    at the epoch's global sample position (see the module docstring), or a CheckpointError naming both sizes."""
    loop = loop_state_for_rank(states, rank)
    loop["micro_step"] = reposition(loader, loop, saved, world_size, accumulation, path)
    if rank == 0:
        warnings.warn(f"{path} was written by {saved} process(es), resumed by {world_size}: the epoch goes "
                      f"on at its global sample position, an optimizer step now takes the samples of "
                      f"{world_size} process(es).", stacklevel=5)
    return loop


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
    if state is None or not micro_step:  # (at an epoch's end, or a loader without state: the next data starts afresh)
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


class Reposition:
    """The trainer's ``reposition`` part: the functions of this module it calls."""

    load_loader_state = staticmethod(load_loader_state)
    loop_state = staticmethod(loop_state)
    max_steps_after = staticmethod(max_steps_after)


REPOSITION = Reposition()  # vlmtrain.Trainer's reposition part (compat/trainer.py)
