"""GRPOTrainer's evaluation, as TRL 1.16's GRPOTrainer evaluates: each eval prompt is rolled out
``num_generations`` times (TRL's seeded RepeatSampler order, the same at every evaluation), an eval batch of
``per_device_eval_batch_size`` completions (whole groups) is generated, scored and run through the objective
without gradients; the loss and the objective's metrics (``kl``, ``entropy``, ``clip_ratio/...``) and the
rollout's (``reward``, ``rewards/<func>/mean``, ``completions/...``) are logged with the ``eval_`` prefix.

Several processes: the eval batches one process would evaluate are dealt round-robin (batch ``i`` to process
``i % world_size``, as accelerate deals TRL's), each evaluated once by its process on its own: its groups are
whole in it, so its rewards, advantages and statistics are those one process computes for that batch, and no
collective runs per batch (the processes may hold different numbers of batches: an eval set that does not
divide evenly leaves the last processes one batch fewer, where accelerate repeats the first batches). After the
last batch the processes' losses (trainer/evaluation.py's gather) and rollout metrics are put together, so the
logged metrics are one process's over the whole set. The samples evaluated (``eval_samples``, what
``eval_samples_per_second`` counts) are the eval prompts, as TRL's ``len(eval_dataset)``.

An iterable eval set (a ``datasets.IterableDataset``, a torch IterableDataset, vlmtrain's StreamingDataset) is
read whole at each evaluation, in TRL's order (a ``datasets.IterableDataset`` shuffled by ``seed`` in datasets'
buffer, as TRL's ``get_eval_dataloader``; another as it comes), and its prompts evaluated as a list's are."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..errors import ConfigError
from ..trainer import distributed as dist
from .grpo_rollout import GroupSampler
from .grpo_state import gather_rows
from .grpo_stream import SKIPPED, PromptStream, is_hf_iterable, is_stream


def eval_prompts(dataset: Any, seed: int) -> list[dict]:
    """An iterable eval set's prompts, in the order TRL 1.16 evaluates them (module docstring); the records a
    StreamingDataset skips are left out (a set without a prompt is refused, naming ``eval_dataset``)."""
    check_eval_dataset(dataset)  # (also a set given to evaluate())
    if hasattr(dataset, "splits_by_rank") and not isinstance(dataset, PromptStream):
        dataset = PromptStream(dataset, name="eval_dataset")
    if is_hf_iterable(dataset):
        dataset = dataset.shuffle(seed=seed)
    opener = getattr(dataset, "open_row", None)
    rows = [{k: v for k, v in row.items() if k != SKIPPED} for row in dataset]
    return [opener(row) for row in rows] if opener is not None else rows


def check_eval_batch(args: Any) -> None:
    """TRL's rule: the eval batch holds whole groups of ``num_generations`` completions; under several processes
    each process's batch does (module docstring: a process evaluates its batches on its own)."""
    if (args.per_device_eval_batch_size * args.world_size) % args.num_generations:
        raise ConfigError(f"The global eval batch size ({args.per_device_eval_batch_size} * {args.world_size}) must "
                          f"be divisible by the number of generations used for evaluation ({args.num_generations}): "
                          "set per_device_eval_batch_size to a multiple of num_generations.")
    if args.per_device_eval_batch_size % args.num_generations:
        raise ConfigError(f"per_device_eval_batch_size={args.per_device_eval_batch_size} on {args.world_size} "
                          f"processes: each process evaluates whole groups of num_generations="
                          f"{args.num_generations} completions; set per_device_eval_batch_size to a multiple of it.")


def check_eval_dataset(dataset: Any) -> None:
    """An eval set is read whole at each evaluation: a StreamingDataset mixing several sources is endless (refused
    before the model loads, naming ``eval_dataset``)."""
    sources = getattr(getattr(dataset, "stream", dataset), "sources", None)
    if hasattr(dataset, "splits_by_rank") and sources is not None and len(sources) > 1:
        raise ConfigError(f"eval_dataset: a StreamingDataset mixing {len(sources)} sources never ends, and an "
                          "evaluation reads its eval set whole: give a StreamingDataset of one source, a "
                          "datasets.Dataset or IterableDataset, or a list of prompts.")


class GRPOEvaluation:
    """The evaluation part of vlmtrain.GRPOTrainer (a mixin before its Trainer base)."""

    _eval_rollout_metrics: dict[str, list[float]]
    _eval_prompts = 0  # (this process's prompts evaluated: the evaluation's num_samples)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """Eval batches of dataset rows: each prompt ``num_generations`` times in a row, the prompts in TRL's
        seeded order."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(eval_dataset, str):  # (the name of one of several eval sets)
            dataset = self.eval_dataset[eval_dataset]
        if dataset is None:
            raise ValueError("Evaluation needs an eval_dataset: pass GRPOTrainer(eval_dataset=...) or "
                             "evaluate(dataset).")
        args = self.args
        iterable = is_stream(dataset)
        if iterable:  # (read whole, in TRL's order: module docstring)
            dataset = eval_prompts(dataset, args.seed)
        order = list(GroupSampler(len(dataset), args.num_generations, 1, 1, not iterable, args.seed))
        size = args.per_device_eval_batch_size
        batches = [order[i:i + size] for i in range(0, len(order), size)]
        if self._eval_sharding(dataset) == "strided":  # (the trainer puts the processes' losses together)
            batches = batches[self.rank::self.world_size]
        return DataLoader(dataset, batch_sampler=batches, collate_fn=lambda rows: {"rows": rows})

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """A rollout's rows of every process (training: a group may span processes); in evaluation this
        process's own (its batch holds whole groups; the processes are not in step)."""
        return gather_rows(tensor) if self.model.training else tensor

    def _own_rows(self, count: int) -> slice:
        """This process's rows among :meth:`_gather`'s."""
        return slice(self.rank * count, (self.rank + 1) * count) if self.model.training else slice(0, count)

    def evaluation_loop(self, dataloader: DataLoader, *args: Any, **kwargs: Any) -> Any:
        """Trainer.evaluation_loop, then, where the processes shared the eval batches, every process's per-batch
        rollout metrics, in the batches' order (each process calls it)."""
        self._eval_prompts = 0
        output = super().evaluation_loop(dataloader, *args, **kwargs)
        if self._eval_sharding(getattr(dataloader, "dataset", None)) != "strided":
            return output._replace(num_samples=self._eval_prompts)  # (the core counts the {"rows"} batches)
        parts = dist.all_gather_objects((self._eval_prompts, dict(self._eval_rollout_metrics)))
        prompts, parts = sum(part[0] for part in parts), [part[1] for part in parts]
        merged: dict[str, list[float]] = defaultdict(list)
        for key in dict.fromkeys(k for part in parts for k in part):
            lists = [part.get(key, []) for part in parts]  # (rank r held batches r, r + W, ...)
            merged[key] = [v[i] for i in range(max(map(len, lists))) for v in lists if i < len(v)]
        self._eval_rollout_metrics = merged
        return output._replace(num_samples=prompts)

    def prediction_step(self, model: nn.Module, inputs: Mapping[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        """The eval batch rolled out and scored, then the objective's forward (its loss alone, as TRL's)."""
        if "rows" in inputs:
            self._eval_prompts += len(inputs["rows"]) // self.args.num_generations
            inputs = self._generate_and_score(inputs["rows"])
        return super().prediction_step(model, inputs, True, ignore_keys)

    def _log_eval_rollout(self, logs: dict[str, Any]) -> None:
        """Into an evaluation's logs (the keys ``<prefix>_loss``): the window's rollout metrics, each averaged
        over the eval batches, under the same prefix."""
        prefix = next((k[:-len("loss")] for k in logs if k.startswith("eval") and k.endswith("_loss")), None)
        if prefix is None:
            return
        for key, values in self._eval_rollout_metrics.items():
            valid = [v for v in values if v == v]
            if valid:
                logs[prefix + key] = sum(valid) / len(valid)
        self._eval_rollout_metrics = defaultdict(list)
