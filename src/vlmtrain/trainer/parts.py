"""TrainerParts: what the trainer core takes from the layers above it, which it never imports (the model layer's
FLOP counter and model files, the logging callbacks, the FSDP plan, ...), as one frozen dataclass that the
Trainer class holds (``TrainerCore.parts``). A default is the plain behaviour the core has alone: nothing, or a
refusal naming the part. ``vlmtrain.Trainer`` sets every part (vlmtrain/compat/trainer.py); one Trainer swaps
one with ``Trainer(..., parts=dataclasses.replace(vlmtrain.Trainer.parts, flop_counter=mine))`` or a subclass's
``parts = ...``. docs/trainer.md's table of the parts is generated from the docstrings below."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from .args import TrainingArgumentsCore
from .callbacks import LoggingCallbacks
from .model_files import PlainModelFiles
from .sharding import ShardingPlan


class Refused:
    """A part the core has nothing of its own for: calling it, or any method of it, raises a ConfigError that
    names the part and what needed it."""

    def __init__(self, part: str, needed_by: str) -> None:
        self.part, self.needed_by = part, needed_by

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"{self.needed_by} needs the trainer part {self.part!r}, which the trainer core lacks: "
                          f"use vlmtrain.Trainer, or give one in Trainer(parts=TrainerParts({self.part}=...)).")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("part", "needed_by"):
            raise AttributeError(name)
        return self  # (a method of the missing part: calling it raises)


class NoWindowStats:
    """The core's window_stats: nothing counted, logged or checkpointed (skipped samples come from vlmtrain's
    collators; vlmtrain.Trainer counts them, logging/throughput.py). Every method returns {}."""

    def __init__(self, *_: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., dict]:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *_, **__: {}


def compile_whole(model: nn.Module, wrapped: nn.Module, backend: str, mode: str | None) -> nn.Module:
    """The core's torch_compile: ``torch.compile`` of the model as DDP/FSDP wrap it (``wrapped``)."""
    return torch.compile(wrapped, backend=backend, mode=mode)


def no_step_sampling(dataset: Any, *_: Any) -> None:
    """The core's step_sampling: no dataset follows the training step; one that does is refused, naming it."""
    if getattr(dataset, "follows_step", False):
        Refused("step_sampling", f"{type(dataset).__name__} (follows_step = True)")()


def no_step_position(path: str, loop_file: str, *_: Any) -> tuple[int, int]:
    """The core's step_position: a checkpoint without vlmtrain's loop state is refused."""
    raise CheckpointError(f"{path!r} has no {loop_file}: resuming a checkpoint of transformers' Trainer needs the "
                          "trainer part 'step_position' (vlmtrain.Trainer's: vlmtrain/compat/checkpoints.py).")


@dataclasses.dataclass(frozen=True)
class TrainerParts:
    """What a Trainer takes from the layers above the trainer core, one typed field per part; the defaults are
    the core's own behaviour, ``vlmtrain.Trainer.parts`` sets them all (the table in docs/trainer.md)."""

    arguments_class: type[TrainingArgumentsCore] = TrainingArgumentsCore
    """The arguments a Trainer built without ``args`` makes, ``arguments_class()``."""
    default_collator: Callable[[int], Callable[[list], dict]] | None = None
    """``pad_token_id`` -> the collator of a Trainer without ``data_collator``; None: torch's default_collate."""
    logging_callbacks: Callable[[Any], LoggingCallbacks] | None = None
    """``args`` -> the callbacks every Trainer logs through: report_to's trackers, the progress bar or printer
    (listed where transformers lists its own) and metrics.jsonl (called, not listed); None: none."""
    checkpoint_evaluator: Callable[[Any], Any] | None = None
    """``args`` -> train.async_eval's evaluator of saved checkpoints in other processes, or None when the arguments
    ask for none (check_command, enqueue, poll(step, at_end), waiting, in_use, state_dict, load_state_dict)."""
    eval_samples: Callable[[Any, Any, Any, str], None] | None = None
    """``(trainer, dataset, output, metric_key_prefix)``: keeps one evaluated set's per-sample results for the run
    report; None: nothing kept."""
    eval_gather: Callable[..., tuple[Any, int, Any]] | None = None
    """``(losses, preds, labels, samples, skipped, interleave)`` -> every rank's share of an evaluation put together
    on every rank, in dataset order (losses, samples, skipped; preds and labels in place); None: every rank
    evaluates the whole eval set."""
    label_smoothing: Callable[[float, nn.Module], Callable | None] = Refused("label_smoothing",
                                                                            "label_smoothing_factor")
    """``(epsilon, model)`` -> ``(outputs, labels)`` -> the label-smoothed loss (label_smoothing_factor), or None
    where the model is not smoothed."""
    batch_eval_metrics: Any = Refused("batch_eval_metrics", "batch_eval_metrics=True")
    """``check(compute_metrics)`` at Trainer(...) and ``compute(compute_metrics, predictions, label_ids, rows,
    EvalPrediction)`` at evaluation's end: compute_metrics batch by batch, as transformers' batch_eval_metrics."""
    step_sampling: Callable[..., Any] = no_step_sampling
    """``(dataset, num_replicas, rank, seed, batch_size, gradient_accumulation_steps)`` -> None, or for a train
    dataset that follows the training step (follows_step) the dataset indexed by (index, step) and its sampler."""
    loss_targets: Callable[[nn.Module, dict], torch.Tensor | None] | None = None
    """``(model, inputs)`` -> how many targets the model's loss averaged over, when its output has no
    ``num_items`` (a transformers causal LM's shifted labels), or None; None: no count."""
    flop_counter: Callable[[nn.Module], Callable[[dict], float] | None] | None = None
    """``model`` -> (batch -> its training FLOPs), or None, for tflops_per_second and mfu; None: not logged."""
    window_stats: Callable[[Any, float | None], Any] = NoWindowStats
    """``(flops, peak_tflops)`` -> a logging window's counts and rates (samples, skipped samples by reason, tokens
    and FLOPs per second, data wait, pack fill), the run's skipped and bad samples (kept in checkpoints) and
    max_bad_sample_fraction's check: add_batch, exclude, reset, over_ranks, check_bad_fraction, compute,
    run_totals, state_dict, load_state_dict; NoWindowStats: nothing counted or logged."""
    liger_kernel: Callable[[nn.Module, Any], None] = Refused("liger_kernel", "use_liger_kernel=True")
    """``(model, args)``: use_liger_kernel's kernels patched into the model, in place, as liger_kernel_config
    asks; Liger arguments that cannot apply refused (called when use_liger_kernel or liger_kernel_config is set)."""
    fuse_elementwise: Callable[[nn.Module, str], Any] = Refused("fuse_elementwise", "fuse_elementwise='compile'")
    """``(model, args)``: fuse_elementwise's norms, gated MLPs and rotary embeddings compiled in the model, in place
    (or the arguments refused where they cannot apply)."""
    activation_checkpointing: Callable[[nn.Module, Any], None] = Refused("activation_checkpointing",
                                                                         "activation_checkpointing=True")
    """``(model, activation_checkpointing_kwargs)``: activation checkpointing on in the model, in place."""
    compile_model: Callable[[nn.Module, nn.Module, str, str | None], nn.Module] = compile_whole
    """``(model, wrapped, backend, mode)`` -> what training steps run under torch_compile."""
    generation: Any = Refused("generation", "predict_with_generate=True")
    """predict_with_generate's ``generate(model, prompt, processing_class, max_new_tokens, synced_gpus)``,
    ``generates_in_step(model)`` and ``texts(processing_class, ids)``."""
    model_files: Any = PlainModelFiles
    """How a checkpoint holds the model's weights: an object with PlainModelFiles' methods (save_model_files,
    load_model_weights, missing_weight_files, ...); PlainModelFiles: the state dict as model.safetensors."""
    sharding: ShardingPlan | None = None
    """train.fsdp's plan: shards the model, saves and loads its and the optimizer's state; None: no FSDP."""
    checkpoint_writer: Callable[..., Any] | None = None
    """``(output_dir, rank, after_publish, model_files)`` -> train.async_checkpoint's background writer (save,
    poll, wait; the context train() runs in); None: checkpoints are written synchronously."""
    reposition: Any = Refused("reposition", "resuming a checkpoint of another number of processes or of "
                                            "dataloader_num_workers")
    """A checkpoint of another number of processes or data loader workers resumed at its position:
    ``load_loader_state(loader, state, path)`` (other workers), ``loop_state(states, loader, path, saved, rank,
    world_size, accumulation)`` (other processes: the saved ranks' loop states merged, the loader positioned) and
    ``max_steps_after(global_step, epoch_index, micro_step, steps_in_epoch, accumulation, num_train_epochs)``."""
    step_position: Callable[..., tuple[int, int]] = no_step_position
    """``(path, loop_file, loader, global_step, max_steps, steps_in_epoch, accumulation)`` -> (epoch, micro-step)
    of a checkpoint without loop state (transformers'), the loader positioned there."""
