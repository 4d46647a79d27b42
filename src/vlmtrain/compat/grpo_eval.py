"""GRPOTrainer's evaluation, as TRL 1.16's GRPOTrainer evaluates: each eval prompt is rolled out
``num_generations`` times (TRL's seeded RepeatSampler order, the same at every evaluation), an eval batch of
``per_device_eval_batch_size`` completions (whole groups) is generated, scored and run through the objective
without gradients; the loss and the objective's metrics (``kl``, ``entropy``, ``clip_ratio/...``) and the
rollout's (``reward``, ``rewards/<func>/mean``, ``completions/...``) are logged with the ``eval_`` prefix."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from ..errors import ConfigError
from .grpo_rollout import GroupSampler


def check_eval_batch(args: Any) -> None:
    """TRL's rule: the eval batch holds whole groups of ``num_generations`` completions."""
    if (args.per_device_eval_batch_size * args.world_size) % args.num_generations:
        raise ConfigError(f"The global eval batch size ({args.per_device_eval_batch_size} * {args.world_size}) must "
                          f"be divisible by the number of generations used for evaluation ({args.num_generations}): "
                          "set per_device_eval_batch_size to a multiple of num_generations.")


class GRPOEvaluation:
    """The evaluation part of vlmtrain.GRPOTrainer (a mixin before its Trainer base)."""

    _eval_rollout_metrics: dict[str, list[float]]

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
        sampler = GroupSampler(len(dataset), args.num_generations, 1, 1, True, args.seed)
        return DataLoader(dataset, batch_size=args.per_device_eval_batch_size, sampler=sampler,
                          collate_fn=lambda rows: {"rows": rows})

    def prediction_step(self, model: nn.Module, inputs: Mapping[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        """The eval batch rolled out and scored, then the objective's forward (its loss alone, as TRL's)."""
        if "rows" in inputs:
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
