"""Training datasets whose samples depend on the training step (curricula such as shapes' side warm-up).

Such a dataset declares ``follows_step = True`` and defines ``get_item_at_step(index, step)``. The training
sampler then yields ``(index, step)`` pairs, where step is the number of optimizer steps done before the step
that sample feeds: a function of the sample's position in the data order, so data-loader workers, prefetching
and resumes see exactly what an uninterrupted 0-worker run sees. No message goes from the loop to the dataset.
The Trainer gets the dataset and sampler through its ``step_sampling`` part (:func:`step_sampling` in
vlmtrain.Trainer) and sets the sampler's ``first_step`` as each epoch begins.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from vlmtrain.errors import ConfigError


def follows_step(dataset: Any) -> bool:
    """True for a dataset whose items depend on the training step (``follows_step = True``)."""
    return bool(getattr(dataset, "follows_step", False))


def check_step_dataset(dataset: Any) -> None:
    """Fail at the start of training on a step-following dataset whose items workers could not reproduce."""
    name = type(dataset).__name__
    if hasattr(dataset, "set_step"):
        raise ConfigError(f"The train_dataset {name} has set_step(step): the Trainer no longer tells datasets the "
                          "step (worker processes and prefetching would not see it). Define follows_step = True "
                          "and get_item_at_step(index, step) instead: the step comes with each index.")
    if not follows_step(dataset):
        return
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"The train_dataset {name} follows the training step but is an iterable (stream) "
                          "dataset: only a map-style dataset (__getitem__/__len__) gets each sample's step from "
                          "the sampler. Make it map-style, or drop its step dependence.")
    if not callable(getattr(dataset, "get_item_at_step", None)):
        raise ConfigError(f"The train_dataset {name} has follows_step = True but no get_item_at_step(index, step).")


class ItemsAtStep(Dataset):
    """A step-following dataset indexed by the ``(index, step)`` pairs that :class:`StepSampler` yields."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        index, step = key
        return self.dataset.get_item_at_step(index, step)


class StepSampler(StatefulDistributedSampler):
    """The per-rank shuffle of StatefulDistributedSampler, each index paired with the optimizer step it feeds.

    Position ``p`` of this rank's share of the epoch is in micro-batch ``p // batch_size``, which feeds step
    ``first_step + micro_batch // gradient_accumulation_steps``; every rank's micro-batch ``k`` feeds the same
    step. ``first_step`` is the number of steps done when the epoch began (set by the loop before iterating, so
    an epoch cut short still numbers the next one right). The position is the sampler's own ``yielded`` count,
    which the loader's state_dict saves and restores: a resumed epoch continues the same numbering.
    """

    def __init__(self, dataset: Any, num_replicas: int, rank: int, seed: int, batch_size: int,
                 gradient_accumulation_steps: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.samples_per_step = batch_size * gradient_accumulation_steps
        self.first_step = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for index in super().__iter__():
            position = self.yielded - 1  # (the parent counts the index it just yielded)
            yield index, self.first_step + position // self.samples_per_step


def step_sampling(dataset: Any, num_replicas: int, rank: int, seed: int, batch_size: int,
                  gradient_accumulation_steps: int) -> tuple[ItemsAtStep, StepSampler] | None:
    """The Trainer's ``step_sampling`` part: for a train dataset that follows the step, the dataset indexed
    by ``(index, step)`` pairs and its sampler; None for any other. :func:`check_step_dataset` comes first."""
    check_step_dataset(dataset)
    if not follows_step(dataset):
        return None
    sampler = StepSampler(dataset, num_replicas, rank, seed, batch_size, gradient_accumulation_steps)
    return ItemsAtStep(dataset), sampler
