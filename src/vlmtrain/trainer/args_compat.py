"""transformers' TrainingArguments names that vlmtrain accepts but does not implement.

A script written for transformers' Trainer passes its `TrainingArguments(...)` unchanged: every transformers 5.23
argument name is a field of vlmtrain's TrainingArguments. The names vlmtrain implements live in args.py; the rest
are fields of :class:`TransformersOnlyArguments` below, with transformers' defaults. Each of them is either

- refused at anything but its default (:data:`REFUSED`: a ConfigError says what vlmtrain does instead), or
- accepted at any value because vlmtrain already behaves one fixed, documented way (:data:`IGNORED`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError

_OWN_OPTIMIZER = "build the optimizer yourself and pass Trainer(optimizers=(optimizer, scheduler))"
_HALF_EVAL = "evaluation runs under the same autocast as training (bf16=True)"
_LIGER = "apply Liger's patches to the model (liger_kernel.transformers.apply_liger_kernel_to_*) before Trainer(...)"
_LOG_LEVEL = "set levels with logging.getLogger(...).setLevel; vlmtrain logs metrics from rank 0 only"
_HUB = "upload output_dir (or a checkpoint-N folder) with huggingface_hub's upload_folder after training"
_ACCELERATE = "vlmtrain does not use accelerate: launch with torchrun; DDP is automatic and fsdp=True shards the model"
_SAMPLING = "training data is shuffled by a seeded sampler (data_seed); use data.packing for length-efficient batches"

# name -> what vlmtrain does instead, or how to get the feature: the end of "<name>=<value> is not supported by
# vlmtrain; ...".
REFUSED: dict[str, str] = {
    "optim_args": _OWN_OPTIMIZER,
    "optim_target_modules": _OWN_OPTIMIZER,
    "average_tokens_across_devices": "the loss is always normalized by the target tokens of the whole step, across "
                                     "gradient accumulation and ranks",
    "fp16": "use bf16=True (bfloat16 autocast, no loss scaling needed)",
    "bf16_full_eval": _HALF_EVAL,
    "fp16_full_eval": _HALF_EVAL,
    "use_liger_kernel": _LIGER,
    "liger_kernel_config": _LIGER,
    "use_cache": "training forwards pass use_cache=False; override Trainer.compute_loss if a model needs its cache",
    "neftune_noise_alpha": "add the embedding noise in the model (e.g. a forward hook on its input embeddings)",
    "auto_find_batch_size": "vlmtrain does not restart training after an out-of-memory error (transformers does "
                            "it with accelerate's find_executable_batch_size): set per_device_train_batch_size and "
                            "gradient_accumulation_steps yourself",
    "log_level": _LOG_LEVEL,
    "log_level_replica": _LOG_LEVEL,
    "logging_nan_inf_filter": "steps with a NaN/Inf loss or gradients are skipped (no update) and logged as "
                              "nonfinite_steps, so they never reach the logged averages",
    "trackio_static_space_id": "a static trackio Space comes with push_to_hub, which vlmtrain does not do; after "
                               "training publish the project with trackio's CLI (trackio sync / trackio freeze)",
    "eval_delay": "evaluation follows eval_strategy from the start; a TrainerCallback can clear "
                  "control.should_evaluate for early steps",
    "prediction_loss_only": "evaluation returns only the losses when Trainer(compute_metrics=None)",
    "eval_do_concat_batches": "predictions are always concatenated over batches (padded to the longest)",
    "save_only_model": "checkpoints keep optimizer, scheduler, data and RNG state for exact resume; "
                       "Trainer.save_model() writes the weights alone",
    "save_on_each_node": "put output_dir on storage that every node shares",
    "push_to_hub": _HUB,
    "hub_token": _HUB,
    "hub_private_repo": _HUB,
    "hub_model_id": _HUB,
    "hub_strategy": _HUB,
    "hub_always_push": _HUB,
    "hub_revision": _HUB,
    "ignore_data_skip": "resume restores the data loader's position in O(1) time, so nothing is skipped",
    "full_determinism": "call torch.use_deterministic_algorithms(True) yourself (CPU runs are already bitwise "
                        "reproducible)",
    "accelerator_config": _ACCELERATE,
    "parallelism_config": _ACCELERATE,
    "ddp_backend": "the backend is NCCL on GPUs and gloo on CPU",
    "dataloader_in_order": "batches always arrive in order, which exact resume needs",
    "length_column_name": _SAMPLING,
    "fsdp_config": "fsdp=True shards every transformer block with FSDP2 (full_shard; bf16 compute with bf16=True) "
                   "and takes no further options",
    "deepspeed": "use fsdp=True (FSDP2 under torchrun) for models that do not fit one device",
    "debug": "use torch.autograd.set_detect_anomaly(True) or forward hooks to debug a model",
    "skip_memory_metrics": "memory metrics are not recorded; read torch.cuda.max_memory_allocated() in a "
                           "TrainerCallback",
}

# Names vlmtrain implements, but not exactly as transformers 5.x: name -> how it differs (the migration guide's
# "different" rows; every other implemented name behaves as in transformers, which tests compare).
DIFFERENT: dict[str, str] = {
    "optim": "adamw_torch_fused (the default, as transformers'), adamw_torch and sgd; transformers' other "
             "optimizers are refused: build one and pass Trainer(optimizers=(optimizer, scheduler))",
    "lr_scheduler_type": "constant, constant_with_warmup, linear, cosine, cosine_with_min_lr and polynomial (the "
                         "same curves as transformers'); its other schedules are refused",
    "weight_decay": "also exempts every 1-dimensional parameter (transformers: biases and normalization layers "
                    "only)",
    "report_to": "metrics.jsonl is always written; trackers: tensorboard, wandb, mlflow, trackio (others refused); "
                 "'all' stays ['all'] (every installed one at run time); None means [] (transformers: [None])",
    "fsdp": "any true value shards with FSDP2, one unit per transformer block (transformers' full_shard auto_wrap); "
            "shard_grad_op, hybrid_shard, offload and no_shard are refused",
    "tf32": "on a machine without a GPU a warning, not transformers' error",
    "disable_tqdm": "None means False (transformers: True when its logger is quieter than WARNING)",
    "ddp_find_unused_parameters": "None means False, DDP's default (transformers: True unless activation "
                                  "checkpointing is on)",
    "remove_unused_columns": "accepted, no effect: vlmtrain never drops dataset columns; the data collator decides "
                             "what a batch holds",
    "train_sampling_strategy": "random is a seeded per-epoch shuffle (data_seed) whose order differs from "
                               "transformers' RandomSampler; sequential is the same; group_by_length and "
                               "batch_rebalance are refused (use data.packing)",
    "data_seed": "seeds vlmtrain's shuffle, so the order differs from transformers' for the same seed",
    "resume_from_checkpoint": "Trainer.train() uses it when called without resume_from_checkpoint (transformers' "
                              "Trainer ignores the field; it is for scripts)",
    "include_for_metrics": "only [] is accepted: compute_metrics receives predictions and label_ids",
}

# name -> why any value is fine: vlmtrain always behaves one way, which the name cannot change.
IGNORED: dict[str, str] = {
    "do_train": "transformers' Trainer ignores it too; it is for your script",
    "do_eval": "transformers' Trainer ignores it too; it is for your script",
    "do_predict": "transformers' Trainer ignores it too; it is for your script",
    "local_rank": "torchrun's LOCAL_RANK environment variable picks the device",
    "log_on_each_node": "metrics are reduced over all ranks and logged once, by rank 0",
    "eval_use_gather_object": "evaluation results are always gathered over ranks as objects",
    "eval_accumulation_steps": "predictions move to the CPU after every batch",
    "enable_jit_checkpoint": "SIGTERM/SIGUSR1 always finish the step, save a checkpoint and stop",
    "restore_callback_states_from_checkpoint": "resume always restores the callbacks that have load_state_dict",
}


@dataclass
class TransformersOnlyArguments:
    """transformers' TrainingArguments names vlmtrain does not implement, with transformers' defaults."""

    optim_args: str | None = None
    optim_target_modules: None | str | list[str] = None
    average_tokens_across_devices: bool = True
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    use_liger_kernel: bool = False
    liger_kernel_config: dict[str, bool] | None = None
    use_cache: bool = False
    neftune_noise_alpha: float | None = None
    auto_find_batch_size: bool = False
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
    debug: str | list[str] = ""
    skip_memory_metrics: bool = True
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    local_rank: int = -1


def describe(name: str) -> str:
    """One line on what a transformers-only name does in vlmtrain (for --help and the README reference)."""
    if name in IGNORED:
        return f"Any value; no effect: {IGNORED[name]}."
    return f"Default only; any other value is an error: {REFUSED[name]}."


# Field docstrings, in the Google "Attributes:" form that jsonargparse reads for each option's help.
TransformersOnlyArguments.__doc__ = "\n".join(
    [str(TransformersOnlyArguments.__doc__), "", "Attributes:"]
    + [f"    {f.name}: {describe(f.name)}" for f in fields(TransformersOnlyArguments)])

_OFF = (None, False, "", "no", [], {}, ())


def _at_default(value: Any, default: Any) -> bool:
    """Equal to the default, or both leave the feature off (None, False, '', 'no', empty)."""
    try:
        if value == default:
            return True
    except Exception:  # e.g. an object whose == is not a plain bool
        return False
    return any(value is off or (type(value) is type(off) and value == off) for off in _OFF) and default in _OFF


def check_transformers_only(args: Any) -> None:
    """Raise ConfigError naming the first transformers-only argument set to a value vlmtrain cannot honour."""
    for f in fields(TransformersOnlyArguments):
        value = getattr(args, f.name)
        if f.name not in IGNORED and not _at_default(value, f.default):
            raise ConfigError(f"{f.name}={value!r} is not supported by vlmtrain; {REFUSED[f.name]}.")
