"""transformers' Trainer internals that subclasses written for it read or override (TRL-style trainers,
run_qa's QuestionAnsweringTrainer): ``_train_batch_size``, ``accelerator`` (an error naming what to use),
debug='underflow_overflow', the loader attributes integrations read (accelerate's ``total_batch_size``, ``total_dataset_length``),
``_load_callback_state`` with transformers' warnings at resume (a checkpoint's callbacks the Trainer lacks, its
best checkpoint gone, its steps and batch not the arguments'). A mixin of
:class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py); the loop's own names (``_evaluate``, ``_get_output_dir``,
``_load_callback_state``) are the core's."""

from __future__ import annotations

import os
import warnings
from typing import Any, NoReturn

ACCELERATOR_INSTEAD = {
    "accelerator.device": "trainer.args.device (or trainer.device)",
    "accelerator.num_processes / process_index / is_main_process": "trainer.args.world_size / "
    "trainer.args.process_index / trainer.is_world_process_zero()",
    "accelerator.autocast()": "trainer.autocast()",
    "accelerator.backward(loss)": "loss.backward() (the Trainer's training_step does it)",
    "accelerator.gather_for_metrics / gather / reduce": "torch.distributed's all_gather_object / all_reduce",
    "accelerator.unwrap_model(model)": "trainer.model (never wrapped: DDP/FSDP wrap a separate reference)",
    "accelerator.wait_for_everyone()": "torch.distributed.barrier() when torch.distributed.is_initialized()",
}


class TransformersTrainerInternals:
    """Internal attributes of transformers' Trainer with its values, or an error saying what to use instead."""

    args: Any
    model: Any
    world_size: int
    callback_handler: Any
    control: Any
    state: Any

    @property
    def _train_batch_size(self) -> int:
        """Samples per training micro-batch of this process, as transformers' (args.train_batch_size)."""
        return self.args.train_batch_size

    @property
    def accelerator(self) -> NoReturn:
        """transformers' accelerate.Accelerator: vlmtrain has none (an AttributeError listing what to use)."""
        instead = "; ".join(f"{k} -> {v}" for k, v in ACCELERATOR_INSTEAD.items())
        raise AttributeError(f"Trainer.accelerator: vlmtrain does not use accelerate (devices and torch.distributed "
                             f"are set up by the Trainer under torchrun). Instead: {instead}.")

    def _load_callback_state(self) -> None:
        """Restore the checkpoint's callback states; warn, as transformers, of the ones no callback of this Trainer
        takes (they are ignored). Called as the checkpoint's state becomes ``self.state``: first transformers'
        warnings on that state (``_check_resumed_state``)."""
        self._check_resumed_state()
        present = {type(cb).__name__ for cb in [*self.callback_handler.every_callback, self.control]}
        not_found = [name for name in self.state.stateful_callbacks if name not in present]
        if not_found and self.args.restore_callback_states_from_checkpoint:  # (vlmtrain restores them either way)
            warnings.warn("Checkpoint included callbacks not included in current configuration. Ignoring. "
                          f"({', '.join(not_found)})", stacklevel=2)
        super()._load_callback_state()  # type: ignore[misc]

    def _check_resumed_state(self) -> None:
        """transformers' warnings as it resumes: the best checkpoint the state names is gone (then ignored), and
        the arguments' logging/eval/save steps or batch differ from the checkpoint's (its compare_trainer_and_
        checkpoint_args; the checkpoint's steps go on)."""
        best = self.state.best_model_checkpoint
        if best is not None and not os.path.isdir(best):
            warnings.warn(f"The best checkpoint {best} recorded in the resumed state does not exist anymore. "
                          "Ignoring it for this run.", stacklevel=3)
            self.state.best_model_checkpoint = None
        differ = [f"\n\t{name}: {getattr(self.args, name)} (from args) != {getattr(self.state, name)} (from "
                  "trainer_state.json)" for name in ("logging_steps", "eval_steps", "save_steps")
                  if None not in (getattr(self.args, name), getattr(self.state, name))
                  and getattr(self.args, name) != getattr(self.state, name)]
        batch, saved = self.args.per_device_train_batch_size, self.state.train_batch_size
        if saved is not None and batch != saved // max(1, self.args.n_gpu):
            differ.append(f"\n\tper_device_train_batch_size: {batch} (from args) != "
                          f"{saved // max(1, self.args.n_gpu)} (from trainer_state.json)")
        if differ:
            warnings.warn("Warning: The following arguments do not match the ones in the `trainer_state.json` within "
                          "the checkpoint directory: " + "".join(differ), stacklevel=3)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """train(), with debug='underflow_overflow' as transformers: its DebugUnderflowOverflow hooks on the model,
        which stop training at the first inf/nan, printing the frames before it."""
        if "underflow_overflow" in self.args.debug:
            from transformers.debug_utils import DebugUnderflowOverflow

            DebugUnderflowOverflow(self.model)
        return super().train(*args, **kwargs)  # type: ignore[misc]

    def get_train_dataloader(self) -> Any:
        return _with_totals(super().get_train_dataloader(), self.world_size)  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return _with_totals(super().get_eval_dataloader(eval_dataset), self.world_size)  # type: ignore[misc]


def _with_totals(loader: Any, world_size: int) -> Any:
    """``loader`` with the attributes accelerate's loaders have under transformers (integrations read them): the
    batch over all processes and, for a dataset with a length, that length."""
    loader.total_batch_size = (loader.batch_size or 0) * world_size
    if hasattr(loader.dataset, "__len__"):
        loader.total_dataset_length = len(loader.dataset)
    return loader
