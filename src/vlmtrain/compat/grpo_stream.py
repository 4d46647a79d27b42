"""GRPO's prompts from a stream (an iterable dataset: vlmtrain's StreamingDataset, a ``datasets.IterableDataset``,
a torch IterableDataset). Every process reads the whole stream, in its order, and takes its slice of each
generation batch, as GroupSampler slices an indexed dataset's (and as TRL's accelerate shards an iterable one):
a group may span processes and the rewards are gathered anyway, so several processes train what one process does
on the same prompts. Prompts are small; a process opens the images of its own slice only.

:class:`GroupStream` is the streaming counterpart of grpo_rollout.GroupSampler (TRL's ``repeat_iterable_dataset``):
each generation batch's ``batch_size`` prompts, each ``mini_repeat_count`` times in a row, the batch
``repeat_count`` times, this process's slice of each; a partial batch at an epoch's end is dropped. Its state (a
checkpoint's data position) is the stream's place where the current generation batch began (a
:class:`PromptStream`'s stream: O(1); another iterable: the prompts read this epoch, read again on resume) and the
repeats of it already handed out. :class:`PromptStream` turns a StreamingDataset's records into prompts, bad
ones skipped and counted (``skipped_<reason>`` in the logs)."""

from __future__ import annotations

import itertools
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset

from ..data.processing import SkipSample, load_image
from ..data.sources import DROPPED, drop_counts, is_counts_only
from ..errors import ConfigError

logger = logging.getLogger(__name__)
SKIPPED = "__skipped__"  # (a prompt row's count of the records skipped just before it: the batch's `skipped`)


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream (no indexing): a torch or HF ``datasets`` IterableDataset."""
    return isinstance(dataset, IterableDataset) or is_hf_iterable(dataset)


def is_hf_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset`` (shuffled in a buffer by seed, as TRL shuffles it)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - the extra is missing
        return False
    return isinstance(dataset, datasets.IterableDataset)


def streamed_prompts(dataset: Any, max_steps: int) -> Any:
    """The train dataset GRPOTrainer samples from: a stream needs ``max_steps`` (it has no length; refused before
    the model loads), and a StreamingDataset's records become a :class:`PromptStream`."""
    if not is_stream(dataset):
        return dataset
    if max_steps <= 0:
        raise ValueError(f"train_dataset is a stream ({type(dataset).__name__}, no length): set max_steps to the "
                         "optimizer steps to train.")
    if hasattr(dataset, "splits_by_rank") and not isinstance(dataset, PromptStream):
        return PromptStream(dataset)
    return dataset


def _prompt_columns(record: dict[str, Any]) -> dict[str, Any]:
    row = {k: v for k, v in record.items() if not k.startswith("__")}  # (the stream's bookkeeping: __key__, ...)
    if not row.get("prompt"):
        raise SkipSample("not_a_prompt", f"no 'prompt' (columns: {sorted(row)})")
    return row


class PromptStream(IterableDataset):
    """A StreamingDataset's records as GRPO prompts (``convert``: record -> prompt row, SkipSample for a bad one;
    default: a record with a ``prompt``), read whole by every process. The records a source or ``convert`` skips
    ride on the next prompt (``__skipped__``); a pass over the stream without a prompt is a ConfigError naming
    it (``name``)."""

    exact_resume = True  # (its state is the stream's position: GroupStream seeks there)

    def __init__(self, stream: Any, convert: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 name: str = "train_dataset") -> None:
        stream.rank, stream.world_size = 0, 1  # (every process reads every record: see the module docstring)
        self.stream, self.convert, self.name = stream, convert or _prompt_columns, name
        self._warned: set[str] = set()
        self._resumed = False  # (the next pass begins at a checkpoint's place: see __iter__)

    def set_epoch(self, epoch: int) -> None:
        self.stream.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
        self._resumed = True

    def __iter__(self) -> Iterator[dict[str, Any]]:
        pending, total, records, prompts = Counter[str](), Counter[str](), 0, 0
        resumed, self._resumed = self._resumed, False
        for sample in self.stream:
            pending.update(drop_counts(sample))
            total.update(drop_counts(sample))
            records += sum(drop_counts(sample).values())
            if is_counts_only(sample):
                continue
            records += 1
            try:
                row = self.convert({k: v for k, v in sample.items() if k != DROPPED})
            except SkipSample as err:
                if err.reason not in self._warned:
                    self._warned.add(err.reason)
                    logger.warning("GRPO: a record of %s is not a usable prompt (%s: %s), skipped and counted "
                                   "(skipped_%s)", self.name, err.reason, err, err.reason)
                pending[err.reason] += 1
                total[err.reason] += 1
                continue
            prompts += 1
            yield {**row, SKIPPED: dict(pending)} if pending else row
            pending.clear()
        if not prompts and not resumed:  # (a pass resumed at an epoch's end reads nothing: the next epoch follows)
            raise ConfigError(f"{self.name}: none of its {records} samples is a GRPO prompt ({dict(total)}); see "
                              "docs/data.md#grpo-prompts.")

    @staticmethod
    def open_row(row: dict[str, Any]) -> dict[str, Any]:
        """The row with its images (paths, bytes) opened: done for a process's own rows only."""
        return {**row, "images": [load_image(i) for i in row["images"]]} if row.get("images") else row


def _as_is(batch: dict[str, Any]) -> dict[str, Any]:
    return batch


class GroupStream(IterableDataset):
    """TRL's RepeatSampler order over a stream of prompt rows (module docstring): yields this process's slice of
    each generation batch, ``repeat_count`` times, as ``{"rows": [...]}`` (the records skipped while reading the
    batch under ``skipped``, on process 0: every process reads them)."""

    def __init__(self, prompts: Any, mini_repeat_count: int, batch_size: int, repeat_count: int, rank: int = 0,
                 world_size: int = 1) -> None:
        self.prompts, self.mini, self.batch, self.repeat = prompts, mini_repeat_count, batch_size, repeat_count
        self.rank, self.world_size, self.epoch = rank, world_size, 0
        self.exact = getattr(prompts, "exact_resume", False)
        self._resume: dict[str, Any] | None = None
        self._state: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self._resume, self._state = epoch, None, None
        if hasattr(self.prompts, "set_epoch"):  # (a stream's shards, a datasets shuffle: reshuffled per epoch)
            self.prompts.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        state = self._state or self._resume or {"epoch": self.epoch, "start": None, "read": 0, "yielded": 0}
        return dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._resume, self._state = state["epoch"], dict(state), None

    def _place(self, read: int) -> dict[str, Any]:
        """Where the stream is now: its own state (None before this epoch's first prompt) and the prompts read."""
        return {"start": self.prompts.state_dict() if self.exact and read else None, "read": read}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume, self._resume, self._state = self._resume, None, None
        epoch = self.epoch
        if hasattr(self.prompts, "set_epoch"):
            self.prompts.set_epoch(epoch)
        read, done = (resume["read"], resume["yielded"]) if resume else (0, 0)
        if self.exact and resume and resume["start"] is not None:
            self.prompts.load_state_dict(resume["start"])
        rows = iter(self.prompts)
        if not self.exact and read:  # (an iterable without a seekable state: read again up to the place)
            next(itertools.islice(rows, read - 1, None))
        share = self.batch * self.mini // self.world_size
        first, last = self.rank * share // self.mini, ((self.rank + 1) * share - 1) // self.mini
        while True:
            start = self._place(read)
            batch = list(itertools.islice(rows, self.batch))
            read += len(batch)
            if len(batch) < self.batch:  # (a partial batch dropped, as TRL and GroupSampler drop it)
                if read == len(batch) and not resume:
                    raise ValueError(f"the training prompts of epoch {epoch} are {len(batch)}, fewer than a generation "
                                     f"batch's {self.batch} (generation_batch_size / num_generations): give more "
                                     "prompts or a smaller generation batch.")
                return
            after = self._place(read)
            skipped = Counter[str]()
            for row in batch:
                skipped.update(row.get(SKIPPED, {}))
            opened = {i: self._open({k: v for k, v in batch[i].items() if k != SKIPPED}) for i in range(first, last + 1)}
            mine = [opened[j // self.mini] for j in range(self.rank * share, (self.rank + 1) * share)]
            for repeat in range(done, self.repeat):
                final = repeat == self.repeat - 1
                self._state = {"epoch": epoch, **(after if final else start), "yielded": 0 if final else repeat + 1}
                out = {"rows": mine}
                if repeat == 0 and skipped and self.rank == 0:
                    out["skipped"] = dict(skipped)
                yield out
            done = 0

    def _open(self, row: dict[str, Any]) -> dict[str, Any]:
        opener = getattr(self.prompts, "open_row", None)
        return row if opener is None else opener(row)


def stream_loader(trainer: Any) -> Any:
    """GRPOTrainer's train loader over a stream: a StatefulDataLoader (its position is the checkpoint's) over a
    :class:`GroupStream`. ``shuffle_dataset``: a StreamingDataset's shards are shuffled per epoch (else read in
    order); a ``datasets.IterableDataset`` is shuffled by ``seed`` in a buffer, as TRL shuffles it (datasets'
    default buffer, 1,000 prompts; reshuffled per epoch); another iterable is read as it comes."""
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    args, prompts = trainer.args, trainer.train_dataset
    if isinstance(prompts, PromptStream):  # (its shards reshuffled per epoch, by the stream's own seed)
        prompts.stream.shuffle = args.shuffle_dataset
    elif args.shuffle_dataset and is_hf_iterable(prompts):
        prompts = prompts.shuffle(seed=args.seed)
    groups = GroupStream(prompts, args.num_generations, args.generation_batch_size // args.num_generations,
                         args.num_iterations * args.steps_per_generation, trainer.rank, trainer.world_size)
    with warnings.catch_warnings():  # (torchdata calls torch.set_vital, which torch deprecates)
        warnings.filterwarnings("ignore", message=".set_vital. is deprecated", category=UserWarning)
        # (a generator of its own: a loader's seed drawn from torch's RNG would move the rollouts' sampling)
        return StatefulDataLoader(groups, batch_size=None, collate_fn=_as_is,
                                  generator=torch.Generator().manual_seed(args.seed))
