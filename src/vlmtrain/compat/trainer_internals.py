"""transformers' Trainer internals that subclasses written for it read or override (TRL-style trainers,
run_qa's QuestionAnsweringTrainer): ``_train_batch_size``, ``accelerator`` (an error naming what to use),
``_load_callback_state``'s warning for a checkpoint's callbacks the Trainer lacks. A mixin of
:class:`vlmtrain.Trainer` (vlmtrain/compat/trainer.py); the loop's own names (``_evaluate``, ``_get_output_dir``,
``_load_callback_state``) are the core's."""

from __future__ import annotations

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
        takes (they are ignored)."""
        present = {type(cb).__name__ for cb in [*self.callback_handler.every_callback, self.control]}
        not_found = [name for name in self.state.stateful_callbacks if name not in present]
        if not_found:
            warnings.warn("Checkpoint included callbacks not included in current configuration. Ignoring. "
                          f"({', '.join(not_found)})", stacklevel=2)
        super()._load_callback_state()  # type: ignore[misc]
