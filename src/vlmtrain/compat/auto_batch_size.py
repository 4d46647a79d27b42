"""transformers' ``auto_find_batch_size`` without accelerate: when a training micro-batch runs out of CUDA memory,
free what it held, halve ``per_device_train_batch_size``, double ``gradient_accumulation_steps`` (the optimizer
step sees the same samples) and go on from the start of the same step with a rebuilt train loader, as often as
needed down to a batch of 1. A mixin of :class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py): the loop
(trainer/trainer.py) knows nothing of it.

transformers restarts its whole inner training loop at the smaller size; here the steps already taken stand. One
process only: under torchrun a rank that runs out of memory alone would leave the others waiting in a collective.
A resume restores the batch the checkpoint was trained with (its ``train_batch_size``, as transformers), with the
accumulation the halvings doubled.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import ConfigError
from ..trainer import checkpoint as ckpt
from ..trainer.state import TrainerState
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
    _window_batch = 0  # the loader's batch (of this epoch) that starts the current step: where a retry begins

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if self.args.auto_find_batch_size and (self.world_size > 1 or self.args.fsdp):
            raise ConfigError("auto_find_batch_size=True works in one process only (a rank out of memory alone would "
                              "leave the others waiting): under torchrun set per_device_train_batch_size and "
                              "gradient_accumulation_steps yourself.")
        if self.args.auto_find_batch_size:
            self._restore_shrunk_batch(self.args.resume_from_checkpoint if resume_from_checkpoint is None
                                       else resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    def _restore_shrunk_batch(self, resume: str | bool | None) -> None:
        """Before the train loader is built: the batch of the checkpoint to resume, if the run had shrunk it (its
        trainer_state.json's train_batch_size, as transformers restores it), halving per_device_train_batch_size
        and doubling gradient_accumulation_steps as the run did; a batch that halving does not reach is refused."""
        if not ckpt.resume_requested(resume):
            return
        latest = resume is True or str(resume).lower() in ("true", "latest")
        path = ckpt.latest_checkpoint(self.args.output_dir) if latest else str(resume)
        state_file = os.path.join(path or "", ckpt.STATE_NAME)
        if not os.path.isfile(state_file):  # (no checkpoint: train() says so)
            return
        saved, args = TrainerState.load_from_json(state_file).train_batch_size, self.args
        batch, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
        if saved is None or saved >= batch:
            return
        while batch > saved:
            batch, accum = batch // 2, accum * 2
        if batch != saved:
            raise ConfigError(f"{path}: auto_find_batch_size had shrunk the batch to {saved}, which halving "
                              f"per_device_train_batch_size={args.per_device_train_batch_size} does not reach: resume "
                              "with the per_device_train_batch_size and gradient_accumulation_steps the run went on "
                              "with (its auto_find_batch_size warning names them).")
        args.per_device_train_batch_size, args.gradient_accumulation_steps = batch, accum

    def _event(self, name: str, **kwargs: Any) -> Any:
        if name == "on_step_begin" and self.args.auto_find_batch_size:  # what a retried step must not count twice
            self._step_start = {"num_input_tokens_seen": self.state.num_input_tokens_seen,
                                "current_flos": getattr(self, "current_flos", 0.0),
                                "skipped": self._throughput.skipped.copy(),  # (bad samples the retry reads again)
                                "skipped_total": self._throughput.skipped_total.copy()}
        return super()._event(name, **kwargs)  # type: ignore[misc]

    def _usable_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loop's batches, noting the loader's position of each step's first one: batches the collator emptied
        (every sample bad) are drawn from the loader but take no micro-step, so a retry cannot count micro-steps."""
        micro_step = self._micro_step
        for batch in super()._usable_batches(batches):  # type: ignore[misc]
            if micro_step % self.args.gradient_accumulation_steps == 0:  # (torch's count of the epoch's batches,
                drawn = getattr(batches, "_num_yielded", None)  # restored on resume; None: another iterable)
                self._window_batch = micro_step if drawn is None else drawn - 1
            micro_step += 1
            yield batch

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
        window_start, first_sample = self._micro_step // accum * accum, self._window_batch * batch
        model.zero_grad(set_to_none=True)
        self._step_losses.reset()
        self._window_weight = self._window_counts = None
        self._unsynced = False
        for key, value in (self._step_start or {}).items():
            owner = self.state if key == "num_input_tokens_seen" else self._throughput if "skipped" in key else self
            setattr(owner, key, value)
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
        self._rebuild_loader(window_start * 2, first_sample)

    def _rebuild_loader(self, micro_step: int, first_sample: int) -> None:
        """A train loader at the new batch size, the loop after ``micro_step`` micro-batches of this epoch, its data
        at the ``first_sample``-th sample of the epoch (of this process's share of a map-style dataset's shuffle)."""
        loader = self.train_dataloader = self.get_train_dataloader()
        self.callback_handler.refs["train_dataloader"] = loader
        if self._steps_in_epoch is not None:
            self._steps_in_epoch = len(loader)
        self._micro_step = micro_step
        self._set_data_epoch(loader)
        skip_batches(loader, first_sample // self.args.per_device_train_batch_size)
