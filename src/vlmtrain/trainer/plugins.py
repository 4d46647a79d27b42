"""What the trainer takes from the layers above it without importing them.

The trainer defines a named slot; a higher layer (models, logging, evaluation) fills it when ``vlmtrain`` is
imported (``vlmtrain/__init__.py`` imports the modules that register), so ``import vlmtrain.trainer`` and
``from vlmtrain import Trainer`` see the same filled slots. The trainer reads a slot where it needs it: with
:func:`lookup` and a plain default where one exists, with :func:`require` where none does. Every slot is listed in ``SLOTS`` below with what it holds (add a line there
for a new one).
"""

from __future__ import annotations

from typing import Any

SLOTS: dict[str, str] = {  # slot name -> what it holds, and who fills it
    "trainer_class": "vlmtrain.Trainer: TrainerCore with transformers' counts, evaluation conventions and extra "
                     "public methods, what vlmtrain.trainer.Trainer names (vlmtrain.compat.trainer)",
    "arguments_class": "vlmtrain.TrainingArguments: TrainingArgumentsCore with transformers' other names and "
                       "conventions, what vlmtrain.trainer.TrainingArguments names and Trainer(args=None) builds "
                       "(vlmtrain.compat.arguments)",
    "label_smoothing": "(epsilon, model) -> (outputs, labels) -> loss: label_smoothing_factor (compat/loss_extras.py)",
    "batch_eval_metrics": "check(compute_metrics) at Trainer(...), compute(...) at evaluation's end: "
                          "batch_eval_metrics as transformers (compat/loss_extras.py)",
    "early_stopping_callback": "transformers' EarlyStoppingCallback, what vlmtrain.trainer names so "
                               "(vlmtrain.compat.callbacks)",
    "step_sampling": "(dataset, num_replicas, rank, seed, batch_size, gradient_accumulation_steps) -> None, "
                     "or for a train dataset that follows the training step (the dataset indexed by (index, "
                     "step), a sampler whose first_step the loop sets as each epoch begins); "
                     "vlmtrain.data.step_data",
    "default_collator": "pad_token_id -> the collator a Trainer without data_collator uses (vlmtrain.data.collate)",
    "checkpoint_evaluator": "(args) -> the evaluator of saved checkpoints in other processes (rank 0 keeps it), "
                            "None unless train.async_eval (check_command, enqueue, poll(step, at_end) and its "
                            "waiting flag, in_use, state_dict, load_state_dict); vlmtrain.evaluation.async_eval",
    "logging_callbacks": "(args) -> the callbacks every Trainer gets after DefaultFlowCallback: progress bar or "
                         "printer, metrics.jsonl, report_to's trackers; vlmtrain.logging.writers",
    "eval_samples": "(trainer, dataset, output, metric_key_prefix) -> None: keeps one evaluated set's per-sample "
                    "results for the run report; vlmtrain.logging.eval_samples",
    "loss_targets": "(model, inputs) -> how many targets its loss averaged over, or None (models/lm_loss.py)",
    "window_rates": "(flops, peak_tflops) -> a logging window's rates (stats.py's Throughput); logging/throughput.py",
    "flop_counter": "model -> (batch -> training FLOPs) or None, for tflops_per_second / mfu (models/flops.py)",
    "checkpoint_parts": "objects for models that save in parts, see model_files.py (models/lora_files.py, head_files.py)",
    "fsdp_blocks": "model -> the modules FSDP shards one by one before the root (models/sharding.py)",
    "activation_checkpointing": "(model, activation_checkpointing_kwargs) -> None: turns it on in the transformers "
                                "models the model is or holds (models/training_prep.py)",
    "liger_kernel": "(model, liger_kernel_config) -> None: use_liger_kernel's Triton kernels patched into the "
                    "transformers VLM the model is or holds, or a ConfigError (models/liger.py)",
    "compile_model": "(model, wrapped, backend, mode) -> what training steps run: torch_compile of each transformer "
                     "layer of a model marked for it, in place, else of the whole wrapped model (default: the "
                     "latter); models/training_prep.py",
    "generation": "predict_with_generate's greedy generate(model, prompt, processing_class, max_new_tokens, "
                  "synced_gpus), generates_in_step(model) and texts(processing_class, ids); models/generation.py",
    "sharding": "train.fsdp's plan (sharding.py's ShardingPlan: shard, save and load model and optimizer "
                "state); vlmtrain.parallel.fsdp",
    "model_files": "(checkpoint_parts, read_sharded_weights) -> a model's files (model_files.py; models/model_files.py)",
    "read_sharded_weights": "directory -> a DCP checkpoint's model weights, in one process (models/sharded_files.py)",
    "checkpoint_writer": "(output_dir, rank, after_publish) -> train.async_checkpoint's background writer (save(step, "
                         "files, model, processing_class), poll, wait, abandon); none: checkpoints are written "
                         "synchronously (vlmtrain.checkpointing.async_writer)",
    "step_position": "(path, loop_file, loader, global_step, max_steps, steps_in_epoch, accumulation) -> (epoch, "
                     "micro-step) of a checkpoint without loop state (transformers'); vlmtrain.compat.checkpoints",
}
_filled: dict[str, Any] = {}


def register(slot: str, value: Any) -> None:
    """Fill ``slot`` (called by a higher layer at import); the last registration wins."""
    if slot not in SLOTS:
        raise KeyError(f"no trainer slot {slot!r}; the slots are {sorted(SLOTS)}")
    _filled[slot] = value


def lookup(slot: str, default: Any = None) -> Any:
    """The value registered for ``slot``, or ``default`` when none is."""
    return _filled.get(slot, default)


def require(slot: str) -> Any:
    """The value registered for ``slot``; an error naming it when none is (``import vlmtrain`` fills them all)."""
    if slot not in _filled:
        raise RuntimeError(f"the trainer's {slot!r} slot is empty: import vlmtrain (it fills the trainer's slots) "
                           f"before building a Trainer")
    return _filled[slot]
