"""transformers' TrainingArguments names that only the compat layer reads.

A script written for transformers' Trainer passes its `TrainingArguments(...)` unchanged: every transformers 5.24
argument name is a field of vlmtrain's TrainingArguments. The names vlmtrain implements live in
vlmtrain/trainer/args_fields.py, the evaluation and logging layers' arguments.py and :class:`CompatArguments`
below (older aliases and values that arguments.py resolves or refuses at construction); the rest are the fields of
:class:`TransformersOnlyArguments` below, with transformers' defaults. What each of those does (refused at any
value but its default, or accepted with no effect) is arguments.py's table, which checks them when
TrainingArguments (arguments.py) is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompatArguments:
    """transformers' names vlmtrain implements in the compat layer, which resolves or refuses their values at
    construction (arguments.py); the trainer core never reads them."""

    include_for_metrics: list[str] = field(default_factory=list)
    """transformers' 'inputs' / 'loss' extras for compute_metrics: not implemented yet, only [] is accepted."""
    gradient_checkpointing: bool | None = None
    """transformers' older name of activation_checkpointing (used when that is unset; then mirrors it)."""
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    """transformers' older name of activation_checkpointing_kwargs (used when that is unset; then mirrors it)."""
    auto_find_batch_size: bool = False
    """On a CUDA out-of-memory error in a training micro-batch: halve per_device_train_batch_size, double
    gradient_accumulation_steps (the optimizer step takes the same samples) and go on from the start of that step
    (transformers restarts its training loop). One process only."""
    debug: str | list[str] = ""
    """As transformers': 'underflow_overflow' stops training at the first inf/nan in a forward, printing the
    frames before it (transformers' DebugUnderflowOverflow, put on the model when train() starts);
    'tpu_metrics_debug' has no effect (no TPU)."""
    remove_unused_columns: bool = True
    """As transformers' for a `datasets.Dataset`: drop its columns the model's forward does not take (and that
    are not `label`, `label_ids` or `label_names`; under score heads each head's `labels_<head>` is an input too)
    before the data collator sees them, in training, evaluation and prediction. Other datasets (lists, torch
    datasets, streams) reach the collator whole, and so do the samples of vlmtrain's own collators (VLM, Hub VLM,
    text, packing, tasks), which read whole samples: a config run (`vlmtrain train`) uses those, so this key changes
    nothing there."""


@dataclass
class TransformersOnlyArguments:
    """transformers' TrainingArguments names vlmtrain does not implement, with transformers' defaults."""

    optim_args: str | None = None
    optim_target_modules: None | str | list[str] = None
    average_tokens_across_devices: bool = True
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    log_level: str = "passive"
    log_level_replica: str = "warning"
    trackio_static_space_id: str | None = None  # (transformers: also False; Literal[False] upsets jsonargparse)
    eval_delay: float = 0
    prediction_loss_only: bool = False
    eval_do_concat_batches: bool = True
    eval_use_gather_object: bool = False
    eval_accumulation_steps: int | None = None
    save_only_model: bool = False
    save_on_each_node: bool = False
    enable_jit_checkpoint: bool = False
    push_to_hub: bool = False
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_always_push: bool = False
    hub_revision: str | None = None
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    full_determinism: bool = False
    accelerator_config: dict[str, Any] | str | None = None
    parallelism_config: Any = None
    dataloader_in_order: bool = True
    length_column_name: str = "length"
    ddp_backend: str | None = None
    fsdp_config: dict[str, Any] | str | None = None
    deepspeed: dict[str, Any] | str | None = None
    skip_memory_metrics: bool = True
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    local_rank: int = -1
