"""TrainingArgumentsCore: the arguments the trainer core reads (transformers' field names and defaults), validated
at construction. ``vlmtrain.TrainingArguments`` is this class with the higher layers' arguments and transformers'
other names and conventions (vlmtrain/compat/arguments.py)."""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .args_fields import CoreArguments, FsdpValue, WorkersValue  # noqa: F401 (__init__'s annotations)

if TYPE_CHECKING:
    import torch

OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr", "polynomial")
INTERVALS = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
SAMPLING_STRATEGIES = ("random", "sequential")

# Each numeric argument's range: name -> (whether a value is in it, the end of the ConfigError's message after the
# name; {v} is the value). Checked at construction, in this order.
RANGES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {  # (each section checked in its place, beside a group's own)
    "steps": {
        "per_device_train_batch_size": (lambda v: v >= 1, "must be >= 1, got {v}."),
        "per_device_eval_batch_size": (lambda v: v >= 1, "must be >= 1, got {v}."),
        "gradient_accumulation_steps": (lambda v: v >= 1, "must be >= 1, got {v}.")},
    "optimization": {
        "learning_rate": (lambda v: v >= 0, "must be >= 0, got {v}."),
        "warmup_ratio": (lambda v: 0 <= v < 1, "must be in [0, 1), got {v}."),
        "warmup_steps": (lambda v: v >= 0, "must be >= 0, got {v}."),
        "max_grad_norm": (lambda v: v >= 0, "must be >= 0 (0 disables clipping), got {v}."),
        "save_total_limit": (lambda v: v is None or v >= 1, "must be >= 1, or None to keep every checkpoint.")},
    "evaluation": {
        "max_eval_batches": (lambda v: v is None or v >= 1, "must be >= 1, or None for the whole eval set.")},
    "runtime": {
        "peak_tflops": (lambda v: v is None or v > 0, "must be > 0 (the device's peak TFLOP/s), or None; got {v}."),
        "preemption_grace_s": (lambda v: v >= 1, "must be >= 1 second, got {v}."),
        "ddp_timeout": (lambda v: v >= 1, "must be >= 1 second, got {v}."),
        "max_consecutive_nonfinite_steps": (lambda v: v >= 0, "must be >= 0 (0: never stop)."),
        "max_bad_sample_fraction": (lambda v: 0 < v <= 1, "must be in (0, 1], got {v}."),
        "label_smoothing_factor": (lambda v: 0 <= v < 1, "must be in [0, 1), got {v}.")},
}


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ConfigError naming the closest ones."""
    if value not in choices:
        near = difflib.get_close_matches(str(value), choices, n=2)
        hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}.{hint}")
    return value


@dataclass
class TrainingArgumentsCore(CoreArguments):
    """Everything about how to train that the trainer core reads. Invalid combinations fail here, at construction.
    ``vlmtrain.TrainingArguments`` (what vlmtrain.Trainer without args builds: its ``arguments_class`` part) adds
    the higher layers' arguments (evaluation, logging), transformers' other names, its conventions, derived
    values and serializations (world_size, should_save, to_dict(), ...)."""

    def __post_init__(self) -> None:
        self._resolve_defaults()
        self._check_strategies_and_steps()
        self._check_optimization()
        self._check_best_model()
        self._check_evaluation()
        self._check_runtime()

    def _resolve_defaults(self) -> None:
        """Unset values -> what the Trainer reads (idempotent)."""
        if self.activation_checkpointing is None:
            self.activation_checkpointing = False
        self.output_dir = os.path.expanduser("trainer_output" if self.output_dir is None else self.output_dir)

    def _check_ranges(self, section: str) -> None:
        """Every argument of RANGES[section] in its range."""
        for name, (allowed, message) in RANGES[section].items():
            if not allowed(getattr(self, name)):
                raise ConfigError(f"{name} {message.format(v=getattr(self, name))}")

    def _check_strategies_and_steps(self) -> None:
        """The choices of optimizer, schedule and strategies; batch sizes; logging/save/eval steps; a length."""
        check_choice("optim", self.optim, OPTIMIZERS)
        check_choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULERS)
        check_choice("logging_strategy", self.logging_strategy, INTERVALS)
        check_choice("eval_strategy", self.eval_strategy, INTERVALS)
        check_choice("save_strategy", self.save_strategy, SAVE_STRATEGIES)
        self._check_ranges("steps")
        if self.eval_strategy == "steps" and not self.eval_steps:  # (transformers: None or 0 -> logging_steps)
            self.eval_steps = self.logging_steps
        self._check_steps("logging_steps", self.logging_strategy)
        self._check_steps("save_steps", self.save_strategy)
        self._check_steps("eval_steps", self.eval_strategy)
        if self.max_steps == 0 or (self.max_steps < 0 and self.num_train_epochs <= 0):
            raise ConfigError("Set max_steps > 0 or num_train_epochs > 0: there is nothing to train otherwise.")

    def _check_optimization(self) -> None:
        """Learning rates, warmup, clipping, checkpoint rotation and the schedule's arguments."""
        self._check_ranges("optimization")
        for key, lr in (self.module_learning_rates or {}).items():
            if lr < 0:
                raise ConfigError(f"module_learning_rates[{key!r}] must be >= 0, got {lr}.")
        kwargs = self.lr_scheduler_kwargs or {}
        if self.lr_scheduler_type == "cosine_with_min_lr" and "min_lr_rate" not in kwargs and "min_lr" not in kwargs:
            raise ConfigError("lr_scheduler_type='cosine_with_min_lr' needs lr_scheduler_kwargs={'min_lr_rate': 0.1} "
                              "(or 'min_lr').")

    def _check_best_model(self) -> None:
        """save_strategy='best' and load_best_model_at_end: what they need; metric_for_best_model's defaults."""
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ConfigError("save_strategy='best' needs evaluation: set eval_strategy to 'steps' or 'epoch'.")
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            raise ConfigError("save_strategy='best' needs metric_for_best_model (e.g. 'loss' or 'accuracy'): the "
                              "metric whose improvement triggers a save (transformers refuses it too).")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ConfigError("load_best_model_at_end=True needs eval_strategy 'steps' or 'epoch'.")
            if self.save_strategy not in (self.eval_strategy, "best"):
                raise ConfigError(
                    f"load_best_model_at_end=True needs save_strategy to match eval_strategy "
                    f"(got save_strategy={self.save_strategy!r}, eval_strategy={self.eval_strategy!r}), or 'best'.")
            if self.save_strategy == "steps" and self.eval_strategy == "steps" and self.save_steps % self.eval_steps:
                raise ConfigError(f"load_best_model_at_end=True needs save_steps ({self.save_steps}) to be a "
                                  f"multiple of eval_steps ({self.eval_steps}).")
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None and self.greater_is_better is None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _check_evaluation(self) -> None:
        """Evaluation's limits (vlmtrain.TrainingArguments checks its own here too)."""
        self._check_ranges("evaluation")

    def _check_runtime(self) -> None:
        """Throughput, distributed, failure, sampling, memory, loss and data loader settings."""
        self._check_ranges("runtime")
        check_choice("train_sampling_strategy", self.train_sampling_strategy, SAMPLING_STRATEGIES)
        if self.torch_empty_cache_steps is not None and not (
                isinstance(self.torch_empty_cache_steps, int) and self.torch_empty_cache_steps > 0):
            raise ConfigError(f"torch_empty_cache_steps must be an integer bigger than 0, got "
                              f"{self.torch_empty_cache_steps}.")
        if isinstance(self.dataloader_num_workers, str) and self.dataloader_num_workers.strip().isdigit():
            self.dataloader_num_workers = int(self.dataloader_num_workers)
        if self.dataloader_num_workers != "auto" and not (
                isinstance(self.dataloader_num_workers, int) and self.dataloader_num_workers >= 0):
            raise ConfigError(f"dataloader_num_workers must be a number >= 0 or 'auto', got "
                              f"{self.dataloader_num_workers!r}.")
        if self.dataloader_prefetch_factor is not None and self.dataloader_num_workers == 0:
            raise ConfigError("dataloader_prefetch_factor needs dataloader_num_workers > 0 (batches are loaded ahead "
                              "by worker processes); unset it or add workers.")

    def _check_steps(self, name: str, strategy: str) -> None:
        """logging/save/eval_steps as transformers takes them: > 0; a float in (0, 1) is a ratio of the total
        steps; above 1 a whole number (10.0 -> 10, 10.5 refused). Checked when its strategy is 'steps'."""
        value = getattr(self, name)
        if strategy != "steps" or value is None:
            return
        if value <= 0:
            raise ConfigError(f"{name} must be > 0 (a number of steps, or a float in (0, 1) as a ratio of the total "
                              f"steps), got {value}.")
        if value > 1 and value != int(value):
            raise ConfigError(f"{name} must be an integer if bigger than 1 (a float in (0, 1) is a ratio of the "
                              f"total steps), got {value}.")
        if value >= 1:
            setattr(self, name, int(value))

    # -- derived values -------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this process computes on: its CUDA device (LOCAL_RANK under torchrun), else the CPU;
        the CPU whenever use_cpu=True."""
        import torch  # (here: `vlmtrain train --help` lists these fields without torch)

        from . import distributed as dist
        if self.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        if dist.is_distributed() or int(os.environ.get("WORLD_SIZE", 1)) > 1:
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda", torch.cuda.current_device())

    def absolute_steps(self, name: str, max_steps: int) -> int | None:
        """logging_steps / eval_steps / save_steps in steps: a ratio in (0, 1) of max_steps rounded up (as
        transformers' TrainerState.compute_steps), else the value itself."""
        value = getattr(self, name)
        if value is not None and value < 1:
            return math.ceil(max_steps * value)
        return None if value is None else int(value)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup length in steps: warmup_steps (int, or ratio if in (0, 1)), else warmup_ratio."""
        if 0 < self.warmup_steps < 1:
            return math.ceil(self.warmup_steps * num_training_steps)
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(self.warmup_ratio * num_training_steps)

    def ddp_kwargs(self) -> dict[str, Any]:
        """DistributedDataParallel's keyword arguments from the ddp_* fields that are set."""
        values = {"find_unused_parameters": self.ddp_find_unused_parameters, "bucket_cap_mb": self.ddp_bucket_cap_mb,
                  "broadcast_buffers": self.ddp_broadcast_buffers, "static_graph": self.ddp_static_graph}
        return {k: v for k, v in values.items() if v is not None}
