"""What transformers' TrainingArguments names and value forms mean in vlmtrain.

A script written for transformers' Trainer passes its `TrainingArguments(...)` unchanged: every transformers 5.24
argument name is a field of vlmtrain's :class:`TrainingArguments`, defined here. The names vlmtrain implements
(:class:`ImplementedArguments`) are the trainer core's (vlmtrain/trainer/args_fields.py, checked by its
TrainingArgumentsCore, vlmtrain/trainer/args.py) and the groups each higher layer declares: evaluation/arguments.py,
logging/arguments.py and this layer's CompatArguments (arguments_fields.py). The rest are the fields of
:class:`~vlmtrain.compat.arguments_fields.TransformersOnlyArguments`, with transformers' defaults. Each of them
is either

- refused at anything but its default (:data:`REFUSED`: a ConfigError says what vlmtrain does instead), or
- accepted at any value because vlmtrain already behaves one fixed, documented way (:data:`IGNORED`).

:data:`DIFFERENT` lists the implemented names that do not behave exactly as transformers' (the migration guide's
rows, written by scripts/gen_migrating.py). :func:`apply` is what TrainingArguments does with transformers'
conventions at construction (JSON dict strings, refused values, aliases and value forms, report_to's names,
do_eval), before the core's checks; transformers' derived values come from vlmtrain.compat.arguments_methods.
vlmtrain.Trainer's ``arguments_class`` part is this class.
"""

from __future__ import annotations

import functools
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ConfigError
from ..evaluation.arguments import EvaluationArguments
from ..logging.arguments import LoggingArguments
from ..logging.trackers import TRACKERS
from ..models.speed.checkpointing_policies import checkpointing_mode
from ..trainer.args import TrainingArgumentsCore, check_choice
from ..trainer.args_fields import CoreArguments, FsdpValue, WorkersValue  # noqa: F401 (the last two: __init__'s)
from . import arguments_methods
from .arguments_fields import CompatArguments, TransformersOnlyArguments

_OWN_OPTIMIZER = "build the optimizer yourself and pass Trainer(optimizers=(optimizer, scheduler))"
_HALF_EVAL = "evaluation runs under the same autocast as training (bf16=True)"
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
    "use_cache": "training forwards pass use_cache=False; override Trainer.compute_loss if a model needs its cache",
    "neftune_noise_alpha": "add the embedding noise in the model (e.g. a forward hook on its input embeddings)",
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
    "skip_memory_metrics": "memory metrics are not recorded; read torch.cuda.max_memory_allocated() in a "
                           "TrainerCallback",
}

# Names vlmtrain implements, but not exactly as transformers 5.x: name -> how it differs (the migration guide's
# "different" rows; every other implemented name behaves as in transformers, which tests compare).
DIFFERENT: dict[str, str] = {
    "debug": "underflow_overflow as transformers (its DebugUnderflowOverflow on the model when train() starts: the "
             "first inf/nan stops training, printing the frames before it); tpu_metrics_debug has no effect "
             "(no TPU)",
    "optim": "adamw_torch_fused (the default, as transformers'), adamw_torch and sgd; transformers' other "
             "optimizers are refused: build one and pass Trainer(optimizers=(optimizer, scheduler))",
    "lr_scheduler_type": "constant, constant_with_warmup, linear, cosine, cosine_with_min_lr and polynomial (the "
                         "same curves as transformers'); its other schedules are refused",
    "weight_decay": "also exempts every 1-dimensional parameter (transformers: biases and normalization layers "
                    "only)",
    "label_smoothing_factor": "the labels are shifted for every causal model: transformers' causal-LM classes (as "
                              "transformers), and also vlmtrain's own VLM and its Hub VLM families (Qwen-VL, "
                              "Idefics3 / SmolVLM, LLaVA-OneVision), which transformers smooths unshifted",
    "report_to": "metrics.jsonl is always written; trackers: tensorboard, wandb, mlflow, trackio (others refused); "
                 "'all' becomes transformers' list of the installed integrations, less any vlmtrain has no writer for; "
                 "None means [] (transformers: [None])",
    "fsdp": "any true value shards with FSDP2, one unit per transformer block (transformers' full_shard auto_wrap); "
            "shard_grad_op, hybrid_shard, offload and no_shard are refused",
    "tf32": "on a machine without a GPU a warning, not transformers' error",
    "disable_tqdm": "None means False (transformers: True when its logger is quieter than WARNING)",
    "ddp_find_unused_parameters": "None means False, DDP's default (transformers: True unless activation "
                                  "checkpointing is on)",
    "remove_unused_columns": "as transformers' for a datasets.Dataset (the columns the model's forward does not "
                             "take are dropped before the collator), except under vlmtrain's own collators (VLM, "
                             "Hub VLM, text, packing rows, tasks), which read whole samples; other datasets (lists, "
                             "torch datasets, streams) reach the collator whole (transformers: each dict sample "
                             "loses those keys)",
    "use_liger_kernel": "Liger's RMSNorm, rotary, SwiGLU/GeGLU and LayerNorm kernels on the Hub VLM families Liger "
                        "covers (qwen3_vl, qwen2_5_vl, gemma3, smolvlm; Qwen3-VL's SwiGLU too), never its loss "
                        "kernels (vlmtrain's chunked LM loss stays); without liger-kernel, a CUDA device or a "
                        "covered model an error (transformers: an error, or a warning and no kernels)",
    "liger_kernel_config": "Liger's options as transformers passes them, but fused_linear_cross_entropy and "
                           "cross_entropy cannot be true, an option the family's patch lacks is an error "
                           "(transformers: dropped), and setting it without use_liger_kernel is an error",
    "train_sampling_strategy": "random is a seeded per-epoch shuffle (data_seed) whose order differs from "
                               "transformers' RandomSampler; sequential is the same; group_by_length and "
                               "batch_rebalance are refused (use data.packing)",
    "data_seed": "seeds vlmtrain's shuffle, so the order differs from transformers' for the same seed",
    "resume_from_checkpoint": "Trainer.train() uses it when called without resume_from_checkpoint (transformers' "
                              "Trainer ignores the field; it is for scripts)",
    "auto_find_batch_size": "after an out-of-memory error training goes on from the same step at half the batch and "
                            "twice the accumulation (transformers restarts its training loop); one process only "
                            "(under torchrun an error)",
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
    "enable_jit_checkpoint": "vlmtrain's preemption checkpoint is always on: on SIGTERM/SIGUSR1 the step in "
                             "progress finishes, checkpoint-<step> is saved and train() returns (trainer.preempted); "
                             "transformers' JIT checkpoint (SIGTERM only) waits 3 s, saves and stops",
    "restore_callback_states_from_checkpoint": "resume always restores the callbacks that have load_state_dict",
}


def _reports(args: Any, name: str) -> bool:
    reporters = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
    return name in reporters or "all" in reporters


_VLMTRAIN_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd")
# REFUSED names that transformers reads only while a feature is on: name -> (the feature, whether it is on).
# While it is off any value is accepted, as transformers ignores it then (its value form still checked, as there).
WHEN_USED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **{name: ("push_to_hub", lambda a: bool(a.push_to_hub)) for name in (
        "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision")},
    "trackio_static_space_id": ("trackio (report_to)", lambda a: _reports(a, "trackio")),
    "fsdp_config": ("fsdp", lambda a: a.fsdp is not None and _fsdp_flag(a.fsdp)),
    "eval_delay": ("evaluation (eval_strategy)", lambda a: str(getattr(a.eval_strategy, "value", a.eval_strategy)) != "no"),
    "length_column_name": ("group_by_length (train_sampling_strategy)",
                           lambda a: a.train_sampling_strategy == "group_by_length"),
    "optim_args": ("optim='sgd' (AdamW ignores optim_args)", lambda a: a.optim == "sgd"),
    "optim_target_modules": ("a GaLore / APOLLO optim", lambda a: a.optim not in _VLMTRAIN_OPTIMIZERS),
}
# transformers' value checks at construction (its enums) for names accepted while their feature is off.
VALUE_CHOICES = {"hub_strategy": ("end", "every_save", "checkpoint", "all_checkpoints")}


def _debug_options(value: str | list[str] | None) -> list[str]:
    return value.split() if isinstance(value, str) else [getattr(o, "value", o) for o in value or []]


# report_to: these, or a tracker of vlmtrain.logging.trackers.TRACKERS (tensorboard, wandb, mlflow, trackio).
REPORTERS = ("none", "jsonl", "all")
# transformers' report_to names that vlmtrain has no writer for.
UNIMPLEMENTED_REPORTERS = ("azure_ml", "clearml", "codecarbon", "comet_ml", "dagshub", "dvclive", "flyte", "kubeflow",
                           "neptune", "swanlab")
FSDP_OPTIONS = {"full_shard": None, "auto_wrap": None,  # what vlmtrain's FSDP2 does: shard per transformer block
                "shard_grad_op": "vlmtrain's FSDP2 always reshards parameters after forward (full_shard)",
                "hybrid_shard": "vlmtrain's FSDP2 shards over all ranks (full_shard)",
                "hybrid_shard_zero2": "vlmtrain's FSDP2 shards over all ranks (full_shard)",
                "no_shard": "leave fsdp off to replicate the model with DDP",
                "offload": "CPU offload is not supported; use more ranks or activation_checkpointing"}


def describe(name: str) -> str:
    """One line on what a transformers-only name does in vlmtrain (for --help and the README reference)."""
    if name in IGNORED:
        return f"Any value; no effect: {IGNORED[name]}."
    if name in WHEN_USED:
        return (f"Any value while {WHEN_USED[name][0]} is off (transformers ignores it then); with it on, "
                f"default only, any other value an error: {REFUSED[name]}.")
    return f"Default only; any other value is an error: {REFUSED[name]}."


# Field docstrings, in the Google "Attributes:" form that jsonargparse reads for each option's help (set when
# vlmtrain is imported, before any parser reads them).
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
        if f.name in VALUE_CHOICES:
            check_choice(f.name, str(getattr(value, "value", value)), VALUE_CHOICES[f.name])
        if f.name in WHEN_USED and not WHEN_USED[f.name][1](args):
            continue
        if f.name not in IGNORED and not _at_default(value, f.default):
            raise ConfigError(f"{f.name}={value!r} is not supported by vlmtrain; {REFUSED[f.name]}.")


def resolve_transformers_names(args: Any) -> None:
    """transformers' aliases and value forms -> the one form the Trainer reads (idempotent): the older
    gradient_checkpointing names mirror activation_checkpointing's, fsdp and include_num_input_tokens_seen
    become the Trainer's values, report_to a list of implemented names; do_eval is set by an eval_strategy."""
    for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                     ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
        if getattr(args, new) is None and getattr(args, old) is not None:
            setattr(args, new, getattr(args, old))
        setattr(args, old, getattr(args, new))
    if args.gradient_checkpointing is None:  # (as activation_checkpointing: the trainer reads None as False)
        args.gradient_checkpointing = False
    if not args.do_eval and args.eval_strategy != "no":  # as transformers (for the script: the Trainer ignores it)
        args.do_eval = True
    if isinstance(args.include_num_input_tokens_seen, bool):
        args.include_num_input_tokens_seen = "all" if args.include_num_input_tokens_seen else "no"
    check_choice("include_num_input_tokens_seen", args.include_num_input_tokens_seen, ("no", "all", "non_padding"))
    if args.use_cpu:
        args.dataloader_pin_memory = False
    args.fsdp = None if args.fsdp is None else _fsdp_flag(args.fsdp)  # (transformers: None stays None)
    if isinstance(args.debug, str):  # as transformers: a list of options (None: none)
        args.debug = args.debug.split()
    elif args.debug is None:
        args.debug = []
    for option in _debug_options(args.debug):
        check_choice("debug", option, ("underflow_overflow", "tpu_metrics_debug"))
    if args.torch_compile_backend is not None or args.torch_compile_mode is not None:
        args.torch_compile = True
    if args.torch_compile and args.torch_compile_backend is None:  # (transformers' default off HPU / Neuron)
        args.torch_compile_backend = "inductor"
    reporters = [args.report_to] if isinstance(args.report_to, str) else list(args.report_to or [])
    implemented = (*REPORTERS[:2], *TRACKERS, REPORTERS[2])
    for r in reporters:
        if r in UNIMPLEMENTED_REPORTERS:
            raise ConfigError(f"report_to={r!r} is not implemented by vlmtrain; implemented: "
                              f"{', '.join(implemented)} (metrics.jsonl is always written).")
        check_choice("report_to", r, implemented + UNIMPLEMENTED_REPORTERS)
    if reporters == ["all"]:  # as transformers: the installed integrations, in its order (those vlmtrain writes to)
        from transformers.integrations import get_available_reporting_integrations

        reporters = [n for n in get_available_reporting_integrations() if n in TRACKERS and TRACKERS[n].available()]
    args.report_to = [] if reporters == ["none"] else reporters  # (transformers: 'none' -> [])


def refuse_transformers_values(args: Any) -> None:
    """transformers' values of implemented names that vlmtrain lacks: include_for_metrics' extras and the
    length-grouping samplers of train_sampling_strategy."""
    for extra in args.include_for_metrics:
        check_choice("include_for_metrics", extra, ("inputs", "loss"))
    if args.include_for_metrics:
        raise ConfigError(f"include_for_metrics={args.include_for_metrics!r} is not supported by vlmtrain yet; "
                          "compute_metrics receives predictions and label_ids (see label_names).")
    check_choice("train_sampling_strategy", args.train_sampling_strategy,
                 ("random", "sequential", "group_by_length", "batch_rebalance"))
    if args.train_sampling_strategy in ("group_by_length", "batch_rebalance"):
        raise ConfigError(f"train_sampling_strategy={args.train_sampling_strategy!r} is not supported by vlmtrain; "
                          "use data.packing for length-efficient batches (or 'random' / 'sequential').")


def parse_json_dicts(args: Any) -> None:
    """A dict argument given as a JSON string (a command line's '{"factor": 0.5}') -> the dict, its string
    values converted as transformers does ('true' -> True, '3' -> 3, '0.5' -> 0.5)."""
    hints = _type_hints(type(args))
    for f in fields(args):
        value = getattr(args, f.name)
        if not isinstance(value, str) or "dict" not in str(hints[f.name]):
            continue
        if not value.startswith("{"):
            if f.name not in _IMPLEMENTED:  # (transformers-only: refused below at any value but the default)
                continue
            raise ConfigError(f"{f.name}={value!r}: expected a mapping or a JSON object string such as "
                              "'{\"key\": 1}'.")
        try:
            setattr(args, f.name, _convert_str_dict(json.loads(value)))
        except json.JSONDecodeError as e:
            raise ConfigError(f"{f.name}={value!r} is not valid JSON ({e.msg} at character {e.pos}).") from None


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert_str_dict(passed_value: dict) -> dict:
    """transformers' _convert_str_dict: string values 'true'/'false' -> bool, digits -> int or float, nested."""
    for key, value in passed_value.items():
        if isinstance(value, dict):
            passed_value[key] = _convert_str_dict(value)
        elif isinstance(value, str):
            if value.lower() in ("true", "false"):
                passed_value[key] = value.lower() == "true"
            elif value.isdigit():
                passed_value[key] = int(value)
            elif value.replace(".", "", 1).isdigit():
                passed_value[key] = float(value)
    return passed_value


def _fsdp_flag(value: bool | str | list[str] | None) -> bool:
    """transformers' fsdp values (a bool, 'full_shard auto_wrap', ['full_shard', ...], '' or None) -> on/off."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):  # (a command line's --fsdp true)
        return value.strip().lower() == "true"
    items = value.split() if isinstance(value, str) else [i for v in value for i in str(v).split()]
    for item in items:
        if item not in FSDP_OPTIONS:
            raise ConfigError(f"fsdp={value!r}: unknown option {item!r}; use true/false (or transformers' "
                              f"'full_shard auto_wrap').")
        if FSDP_OPTIONS[item] is not None:
            raise ConfigError(f"fsdp={value!r}: {item!r} is not supported by vlmtrain; {FSDP_OPTIONS[item]}.")
    return bool(items)

def apply(args: Any) -> None:
    """transformers' conventions at TrainingArguments' construction, before its own checks: JSON dict strings
    parsed, transformers-only values refused, aliases and value forms resolved, transformers' values that
    vlmtrain lacks refused, activation_checkpointing_kwargs' mode checked."""
    parse_json_dicts(args)
    check_transformers_only(args)
    resolve_transformers_names(args)
    refuse_transformers_values(args)
    checkpointing_mode(args.activation_checkpointing_kwargs, allow_auto=True)  # (full, selective, attention, auto)


@dataclass
class ImplementedArguments(CompatArguments, LoggingArguments, EvaluationArguments, CoreArguments):
    """Every name vlmtrain implements, in the order of TrainingArguments' fields: the trainer core's, then the
    evaluation, logging and compat layers' groups."""


_IMPLEMENTED = frozenset(f.name for f in fields(ImplementedArguments))


@dataclass
class TrainingArguments(TransformersOnlyArguments, ImplementedArguments, TrainingArgumentsCore):
    """Everything about how to train. Every transformers 5.24 TrainingArguments name is accepted: the ones
    vlmtrain implements behave as there; the rest (arguments_fields.py) take their default, and any other value
    is a ConfigError that says what vlmtrain does instead (the table above). Invalid combinations fail here, at
    construction. transformers' derived values and serializations besides `device` (world_size, should_save,
    main_process_first(), to_dict(), ...) come from vlmtrain.compat.arguments_methods."""

    def __post_init__(self) -> None:
        apply(self)  # transformers' conventions first, then the core's checks with the groups' in their place
        self._resolve_logging()
        super().__post_init__()

    def _check_evaluation(self) -> None:
        """The core's evaluation limits, between the evaluation group's lmms-eval and async_eval checks."""
        self._check_lmms_eval()
        super()._check_evaluation()
        self._check_async_eval()


arguments_methods.add_to(TrainingArguments)
