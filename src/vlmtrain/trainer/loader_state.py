"""A train loader's saved position, restored by a loader with the same or another number of worker processes.

torchdata's StatefulDataLoader saves a state whose layout depends on ``num_workers`` (one process, or a snapshot
per worker), and refuses a state of the other layout (``State doesn't contain key '_num_yielded'``). The
number changes when a run moves between machines (``dataloader_num_workers: auto`` resolves to 0 on CPU and
up to 4 on CUDA). For a map-style dataset the position does not depend on the workers: it is how many of this
rank's sample indices the epoch has consumed, which the sampler (a StatefulDistributedSampler) restarts from.
A streamed dataset keeps one position per worker (each reads its own share of the shards): it needs the saved
number, and is refused naming it.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler


def saved_workers(state: dict[str, Any]) -> int:
    """The ``num_workers`` of the StatefulDataLoader that wrote ``state`` (its ``state_dict()``)."""
    snapshot = state.get("_snapshot")
    return 0 if snapshot is None else int(snapshot["_main_snapshot"]["_num_workers"])


def batches_yielded(state: dict[str, Any]) -> int:
    """How many batches the loader that wrote ``state`` had yielded in its epoch."""
    snapshot = state.get("_snapshot")
    if snapshot is None:
        return int(state["_num_yielded"])
    return int(snapshot["_snapshot_step"]) + int(state.get("_steps_since_snapshot", 0))


def load_loader_state(loader: Any, state: dict[str, Any], checkpoint: str) -> None:
    """Restore ``loader`` (a StatefulDataLoader) to ``state``, saved in ``checkpoint`` by a loader with the same
    or (map-style data) another number of workers: then the sampler restarts after the samples the epoch had
    consumed, ``batches x batch_size``, and the loader starts a fresh iterator there."""
    workers, saved = int(getattr(loader, "num_workers", 0)), saved_workers(state)
    if workers == saved:
        loader.load_state_dict(state)
        return
    sampler, batch_size = getattr(loader, "sampler", None), getattr(loader, "batch_size", None)
    if isinstance(getattr(loader, "dataset", None), IterableDataset) or not isinstance(sampler, StatefulDistributedSampler) \
            or batch_size is None:
        raise ValueError(
            f"{checkpoint}: its data position was saved with dataloader_num_workers={saved}, and this run has "
            f"dataloader_num_workers={workers}. A streamed (iterable) train_dataset keeps one position per worker: "
            f"resume with train.dataloader_num_workers={saved} ('auto' resolves by machine: 0 without CUDA, up to "
            f"4 with it).")
    sampler.load_state_dict({"yielded": min(batches_yielded(state) * batch_size, len(sampler))})
