"""transformers' ``auto_find_batch_size`` without accelerate: when a training micro-batch runs out of CUDA memory,
free what it held, halve ``per_device_train_batch_size``, double ``gradient_accumulation_steps`` (the optimizer
step sees the same samples) and go on from the start of the same step with a rebuilt train loader, as often as
needed down to a batch of 1. A mixin of :class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py): the loop
(trainer/trainer.py) knows nothing of it.

transformers restarts its whole inner training loop at the smaller size; here the steps already taken stand. One
process only: under torchrun a rank that runs out of memory alone would leave the others waiting in a collective.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

from ..errors import ConfigError
from .checkpoints import skip_batches

# transformers' (accelerate's) should_reduce_batch_size: the errors a smaller batch may avoid.
_OOM_MESSAGES = ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                 "DefaultCPUAllocator: can't allocate memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error that a smaller batch may avoid."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and len(error.args) == 1 and any(m in str(error.args[0])
                                                                             for m in _OOM_MESSAGES)


class _StepOutOfMemory(RuntimeError):
    """A training micro-batch's forward or backward ran out of memory (its cause: the error): nothing of its step
    has reached the weights yet, so the step can be taken again at a smaller batch."""


class AutoBatchSize:
    """``TrainingArguments.auto_find_batch_size``: on an out-of-memory error in a training micro-batch, halve the
    batch, double accumulation, rebuild the train loader at the step's first sample and train on."""

    args: Any
    state: Any
    model: Any
    world_size: int
    train_dataloader: Any
    _micro_step: int
    _epoch_index: int
    _step_start: dict[str, Any] | None = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if self.args.auto_find_batch_size and (self.world_size > 1 or self.args.fsdp):
            raise ConfigError("auto_find_batch_size=True works in one process only (a rank out of memory alone would "
                              "leave the others waiting): under torchrun set per_device_train_batch_size and "
                              "gradient_accumulation_steps yourself.")
        return super().train(*args, **kwargs)  # type: ignore[misc]

    def _event(self, name: str, **kwargs: Any) -> Any:
        if name == "on_step_begin" and self.args.auto_find_batch_size:  # what a retried step must not count twice
            self._step_start = {"num_input_tokens_seen": self.state.num_input_tokens_seen,
                                "current_flos": getattr(self, "current_flos", 0.0)}
        return super()._event(name, **kwargs)  # type: ignore[misc]

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        except Exception as error:
            if self.args.auto_find_batch_size and is_out_of_memory(error):
                raise _StepOutOfMemory(str(error)) from error
            raise

    def _evaluate(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._evaluate(*args, **kwargs)  # type: ignore[misc]
        except Exception as error:  # (as transformers: evaluation's memory is not the training batch's)
            if self.args.auto_find_batch_size and is_out_of_memory(error):
                raise RuntimeError("Evaluation hit an out-of-memory error. `auto_find_batch_size` only adjusts the "
                                   "training batch size, reduce `per_device_eval_batch_size` instead.") from error
            raise

    def _run_epoch(self, model: Any, loader: Any) -> None:
        while True:
            try:
                return super()._run_epoch(model, self.train_dataloader)  # type: ignore[misc]
            except _StepOutOfMemory as step_error:
                self._shrink_batch(model, step_error.__cause__)

    def _shrink_batch(self, model: Any, error: BaseException) -> None:
        """Back to the start of the step that ran out of memory, at half the batch and twice the accumulation."""
        args, batch = self.args, self.args.per_device_train_batch_size
        if batch <= 1 or not callable(getattr(self.train_dataloader, "load_state_dict", None)):
            raise error from None
        accum = args.gradient_accumulation_steps
        window_start = self._micro_step // accum * accum
        model.zero_grad(set_to_none=True)
        self._step_losses.reset()
        self._window_weight = self._window_counts = None
        self._unsynced = False
        for key, value in (self._step_start or {}).items():
            setattr(self.state if key == "num_input_tokens_seen" else self, key, value)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if batch % 2:
            warnings.warn(f"auto_find_batch_size: per_device_train_batch_size={batch} is odd: an optimizer step now "
                          f"takes {batch // 2 * accum * 2} samples instead of {batch * accum}.", stacklevel=2)
        args.per_device_train_batch_size, args.gradient_accumulation_steps = batch // 2, accum * 2
        self.state.train_batch_size = batch // 2
        warnings.warn(f"auto_find_batch_size: out of memory at step {self.state.global_step + 1} with "
                      f"per_device_train_batch_size={batch}: going on with {batch // 2} and "
                      f"gradient_accumulation_steps={accum * 2}.", stacklevel=2)
        self._rebuild_loader(window_start * 2)

    def _rebuild_loader(self, micro_step: int) -> None:
        """A train loader at the new batch size, positioned after ``micro_step`` of its micro-batches this epoch."""
        loader = self.train_dataloader = self.get_train_dataloader()
        self.callback_handler.refs["train_dataloader"] = loader
        if self._steps_in_epoch is not None:
            self._steps_in_epoch = len(loader)
        self._micro_step = micro_step
        self._set_data_epoch(loader)
        skip_batches(loader, micro_step)
