"""What the loop counts as transformers' Trainer counts it: each micro-batch's FLOP estimate (state.total_flos)
and input tokens (include_num_input_tokens_seen), the row state.log_history keeps of a log call, and the speed
metrics of a train() call, with transformers' public methods for them (floating_point_ops, store_flos,
num_examples, get_total_train_batch_size). A mixin of :class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py)
that fills the trainer core's counting hooks (vlmtrain/trainer/counts.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..trainer import distributed as dist

# Per-step figures vlmtrain logs besides transformers' keys: they go to on_log (metrics.jsonl, the console, the
# trackers) and never into state.log_history, whose rows stay what transformers' Trainer writes.
STEP_FIGURES = frozenset({
    "samples_per_second", "tokens_per_second", "data_wait_fraction", "data_wait_fraction_max", "tflops_per_second",
    "mfu", "pack_fill", "padding_fraction", "images_per_pack"})


def _input_tokens_mode(args: Any) -> str:
    """transformers' include_num_input_tokens_seen as 'no' / 'all' / 'non_padding' (True means 'all')."""
    value = getattr(args, "include_num_input_tokens_seen", "no")
    if value is True:
        return "all"
    return "no" if value in (False, None, "no") else str(value)


def input_tokens(batch: Mapping[str, Any], mode: str, main_input_name: str, pad_token_id: int | None) -> int:
    """Tokens of a micro-batch as transformers' include_num_input_tokens_seen counts them (this rank's): every
    element of the main input ('all'), or its non-padding ones ('non_padding': the attention mask's ones, else
    those that are not the pad token). 0 when the batch has no main input."""
    ids = batch.get(main_input_name)
    if not isinstance(ids, torch.Tensor):
        return 0
    if mode == "non_padding":
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return int(mask.sum())
        if pad_token_id is not None:
            return int((ids != pad_token_id).sum())
    return ids.numel()


class TransformersCounts:
    """Trainer methods that count FLOPs, tokens, samples and time, with transformers' names, over TrainerCore's
    attributes (args, state, model, processing_class, world_size, train_dataloader)."""

    def num_examples(self, dataloader: Any) -> int:
        """Samples in a loader's dataset; without a length, batches x per_device_train_batch_size."""
        try:
            return len(dataloader.dataset)
        except (AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: per-device batch x accumulation x ranks."""
        return args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """transformers' estimate of a batch's training FLOPs: 6 x input tokens x non-embedding parameters (0 for
        a model without ``num_parameters``). vlmtrain's analytic count is logged as tflops_per_second."""
        main = getattr(self.model, "main_input_name", "input_ids")
        if main in inputs and hasattr(self.model, "num_parameters"):
            if getattr(self, "_flos_params", None) is None:
                self._flos_params = self.model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main].numel() * self._flos_params
        return 0

    def store_flos(self) -> None:
        """Add this process's FLOPs since the last call (over all ranks) to ``state.total_flos``."""
        flos = float(getattr(self, "current_flos", 0.0))
        self.state.total_flos += dist.reduce_cpu([flos])[0]  # (the value itself in one process)
        self.current_flos = 0.0

    def _count_batch(self, batch: Any) -> None:
        """Per micro-batch, as transformers' loop: its FLOP estimate and (include_num_input_tokens_seen) its
        input tokens, summed over ranks. Any mapping counts: a plain dict or transformers' BatchEncoding (a
        UserDict, what DataCollatorWithPadding and DataCollatorForLanguageModeling return)."""
        if not isinstance(batch, Mapping):
            return
        self.current_flos = getattr(self, "current_flos", 0.0) + float(self.floating_point_ops(batch))
        mode = _input_tokens_mode(self.args)
        if mode == "no":
            return
        tokens = input_tokens(batch, mode, getattr(self.model, "main_input_name", "input_ids"),
                              getattr(self.processing_class, "pad_token_id", None))
        self.state.num_input_tokens_seen += int(dist.reduce_cpu([float(tokens)])[0])  # summed over ranks

    def _log_row(self, logs: dict[str, Any], start_time: float | None) -> dict[str, Any]:
        """What state.log_history keeps of a log call: transformers' keys (vlmtrain's per-step figures left
        out), with num_input_tokens_seen (and train_tokens_per_second) when include_num_input_tokens_seen asks."""
        if _input_tokens_mode(self.args) != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                seen = self.state.num_input_tokens_seen - getattr(self, "_initial_tokens_seen", 0)
                runtime = time.time() - start_time
                logs["train_runtime"] = round(runtime, 4)
                if runtime > 0:
                    logs["train_tokens_per_second"] = round(seen / runtime, 3)
        return {k: v for k, v in logs.items() if k not in STEP_FIGURES}

    def _train_speed_metrics(self, start: float, steps: int) -> dict[str, float]:
        """train_runtime / train_samples_per_second / train_steps_per_second over this train() call, counted as
        transformers counts them (planned samples x the share of the steps run)."""
        runtime = time.time() - start
        per_step = self.get_total_train_batch_size(self.args)
        if self.args.max_steps > 0 or self._steps_in_epoch is None:
            planned = self.state.max_steps * per_step
        else:
            planned = self.num_examples(self.train_dataloader) * self.args.num_train_epochs
        samples = planned * steps / max(self.state.max_steps, 1)
        out = {"train_runtime": round(runtime, 4)}
        if runtime > 0:
            out.update(train_samples_per_second=round(samples / runtime, 3),
                       train_steps_per_second=round(steps / runtime, 3))
        return out
