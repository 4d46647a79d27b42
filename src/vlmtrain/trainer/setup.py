"""What happens before the first step and after the last: the model and what is done to it
(tf32, activation checkpointing and torch_compile: the last two are parts, parts.py), the train data loader,
optimizer and scheduler, the loop's counters, and the end-of-training summary. A mixin of TrainerCore, kept
apart so each file reads on its own."""

from __future__ import annotations

import math
import os
import random
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from .distributed import NamedSums
from .optim import create_optimizer, create_scheduler
from .parts import TrainerParts
from .sharding import sharding_of
from .state import TrainerState, TrainOutput
from .stats import LossAverager, NonfiniteSteps
from .step import step_hooks


def set_seed(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_tf32(tf32: bool | None, device: torch.device) -> None:
    """TrainingArguments.tf32 on CUDA: allow (True) or forbid (False) TF32 matmuls and convolutions."""
    if tf32 is None:
        return
    if device.type != "cuda":
        if tf32:
            warnings.warn("tf32=True has no effect without a CUDA device: ignored.", stacklevel=3)
        return
    torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.fp32_precision = "tf32" if tf32 else "ieee"


def load_model_state(model: nn.Module, directory: str, parts: TrainerParts) -> None:
    """Load the model weights of a checkpoint directory into ``model``, in place, whatever the checkpoint holds:
    with ``parts.model_files``, or for a model sharded with FSDP (then every rank must call it) with the sharding
    plan's ``load_model_state`` (DCP shards or files, cut into this rank's shards)."""
    sharding = sharding_of(model, parts.sharding)
    if sharding is None:
        parts.model_files.load_model_weights(model, directory)
    else:
        sharding.load_model_state(model, directory)


def dataloader_workers(value: int | str, cuda: bool, cpus: int | None = None,
                       local_world_size: int | None = None) -> int:
    """The data-loader workers ``dataloader_num_workers`` asks for: a number as given; ``'auto'``: on a CUDA
    machine ``min(4, cpus // local_world_size - 2)`` (at least 0: two cores per process stay with the training
    step and the loader's main thread), 0 without CUDA. ``cpus``: the cores this process may run on;
    ``local_world_size``: processes on this machine (torchrun's LOCAL_WORLD_SIZE, else 1)."""
    if value != "auto":
        return int(value)
    if not cuda:
        return 0
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(0, min(4, cpus // max(1, local_world_size) - 2))


class SetupMixin:
    """TrainerCore methods that prepare training and close it."""

    _built_scheduler: Any = None  # the scheduler create_scheduler built (not one passed in optimizers=)

    def _resolve_model(self, model: nn.Module | None, model_init: Callable[..., nn.Module] | None,
                       compute_loss_func: Callable[..., Any] | None, optimizers: tuple[Any, Any],
                       optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None) -> nn.Module:
        """The model to train: ``model`` (vlmtrain.Trainer also takes transformers' ``model_init``:
        compat/model_init.py). Keeps ``compute_loss_func`` ((outputs, labels, num_items_in_batch=) -> loss,
        replacing the model's loss) and ``optimizer_cls_and_kwargs``."""
        self.compute_loss_func, self.optimizer_cls_and_kwargs = compute_loss_func, optimizer_cls_and_kwargs
        if model is None or model_init is not None:
            raise RuntimeError("TrainerCore needs a model: TrainerCore(model=..., args=...); model_init is "
                               "vlmtrain.Trainer's (transformers').")
        return model

    def _reinit_model(self, trial: Any = None) -> None:
        """At the start of each train(): a hyperparameter-search trial is refused; vlmtrain.Trainer builds a new
        model there with transformers' model_init (compat/model_init.py)."""
        if trial is not None:
            raise NotImplementedError("Trainer.train(trial=...) is not supported by vlmtrain: hyperparameter-search "
                                      "trials are not supported. Instead: call train() once per setting, with "
                                      "Trainer(model_init=...).")

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        """``model`` on the Trainer's device, with Liger's kernels (use_liger_kernel) or its elementwise regions
        compiled (fuse_elementwise), and activation checkpointing on where the arguments ask for them (before
        DDP/FSDP wrap it in train(); all are parts, parts.py)."""
        model = model.to(self.device)
        if self.args.use_liger_kernel or self.args.liger_kernel_config is not None:
            self.parts.liger_kernel(model, self.args)  # (the part checks the Liger arguments too)
        if self.args.fuse_elementwise:
            self.parts.fuse_elementwise(model, self.args)
        if self.args.activation_checkpointing:
            self.parts.activation_checkpointing(model, self.args.activation_checkpointing_kwargs)
        return model

    def get_train_dataloader(self) -> StatefulDataLoader:
        """A StatefulDataLoader (its position is saved in checkpoints) over a seeded, per-rank shuffle."""
        if self.train_dataset is None:
            raise ValueError("Trainer.train() needs a train_dataset: pass Trainer(train_dataset=...).")
        args, seed = self.args, self.args.data_seed if self.args.data_seed is not None else self.args.seed
        dataset, collator = self._loader_data(self.train_dataset, self.data_collator, "Training")
        sampler = None
        at_step = self.parts.step_sampling(
            dataset, self.world_size, self.rank, seed, args.per_device_train_batch_size,
            args.gradient_accumulation_steps)
        if at_step is not None:  # a curriculum: each index comes with the step it feeds (data/step_data.py)
            dataset, sampler = at_step
        elif not isinstance(dataset, IterableDataset):
            sampler = StatefulDistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank,
                                                 shuffle=args.train_sampling_strategy != "sequential", seed=seed,
                                                 drop_last=False)
        # torchdata's constructor calls torch.set_vital, which torch deprecates: a warning no user can act on.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".set_vital. is deprecated", category=UserWarning)
            return StatefulDataLoader(dataset, batch_size=args.per_device_train_batch_size, sampler=sampler,
                                      collate_fn=collator, drop_last=args.dataloader_drop_last,
                                      generator=torch.Generator().manual_seed(seed), **self._loader_options())

    def _loader_options(self) -> dict[str, Any]:
        """What the arguments set of a data loader (train or eval): its workers (with their options, which torch
        refuses without workers) and pin_memory (on CUDA)."""
        workers = self.dataloader_workers()
        options = {"num_workers": workers, "pin_memory": self.args.dataloader_pin_memory and self.device.type == "cuda"}
        if workers:
            options.update(persistent_workers=self.args.dataloader_persistent_workers,
                           prefetch_factor=self.args.dataloader_prefetch_factor,
                           multiprocessing_context=self.args.dataloader_multiprocessing_context)
        return options

    def _loader_data(self, dataset: Any, collator: Any, description: str) -> tuple[Any, Any]:
        """The dataset and collator a data loader reads (``description``: 'Training', 'Evaluation' or 'test'):
        both as given here; vlmtrain.Trainer drops the columns the model's forward does not take, as transformers'
        remove_unused_columns (vlmtrain/compat/columns.py)."""
        return dataset, collator

    def dataloader_workers(self) -> int:
        """Worker processes of this Trainer's data loaders: ``args.dataloader_num_workers`` resolved for the
        device it trains on (``'auto'``: see :func:`dataloader_workers`)."""
        return dataloader_workers(self.args.dataloader_num_workers, cuda=self.device.type == "cuda")

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer over ``model`` (default: the Trainer's): Trainer(optimizer_cls_and_kwargs=...)'s class, or
        args.optim's, over parameter groups with per-module learning rates."""
        if self.optimizer is None:
            self.optimizer = create_optimizer(model or self.model, self.args,
                                              getattr(self, "optimizer_cls_and_kwargs", None))
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = self._built_scheduler = create_scheduler(optimizer or self.optimizer, self.args,
                                                                         num_training_steps)
        return self.lr_scheduler

    def _setup_training(self, loader: StatefulDataLoader) -> int:
        """Work out max_steps / epochs, reset the state, build optimizer and scheduler. Returns the epoch count."""
        args, accum = self.args, self.args.gradient_accumulation_steps
        try:  # (get_train_dataloader may be overridden to return any iterable)
            self._steps_in_epoch = len(loader) if hasattr(getattr(loader, "dataset", loader), "__len__") else None
        except TypeError:  # (a DataLoader over a stream)
            self._steps_in_epoch = None
        if not callable(getattr(loader, "state_dict", None)):
            warnings.warn(f"The train dataloader ({type(loader).__name__}) has no state_dict(): a resumed run starts "
                          "its epoch's data from the beginning. Return a StatefulDataLoader from "
                          "get_train_dataloader for an exact resume.", stacklevel=3)
        self._unsynced = False
        if self._steps_in_epoch == 0:
            raise ValueError("The train_dataset yields no batch (empty dataset, or fewer samples than a batch with "
                             "dataloader_drop_last=True).")
        if self._steps_in_epoch is None:
            if args.max_steps <= 0:
                raise ValueError("train_dataset has no length (an iterable/streaming dataset): set max_steps.")
            max_steps, epochs = args.max_steps, 2**31
        else:
            updates_per_epoch = math.ceil(self._steps_in_epoch / accum)
            max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * updates_per_epoch)
            epochs = math.ceil(max_steps / updates_per_epoch)
        self.state = TrainerState(max_steps=max_steps, num_train_epochs=epochs,
                                  **{name: args.absolute_steps(name, max_steps)  # (ratios of max_steps -> steps)
                                     for name in ("logging_steps", "eval_steps", "save_steps")},
                                  train_batch_size=args.per_device_train_batch_size,
                                  is_world_process_zero=self.rank == 0, is_local_process_zero=self.rank == 0)
        self.create_optimizer()
        self.create_scheduler(max_steps)
        self.callback_handler.refs.update(optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
                                          train_dataloader=loader)
        self._epoch_index, self._micro_step, self._last_logged_step = 0, 0, 0
        self._window_weight = self._window_counts = self._grad_norm = self._last_lrs = None
        self._epoch_cut = False
        self._train_losses, self._run_loss = LossAverager(), LossAverager()
        count_flops = self.parts.flop_counter  # (model -> batch FLOPs; None: no tflops_per_second, mfu)
        self._throughput = self.parts.window_stats(count_flops(self.model) if count_flops else None, args.peak_tflops)
        self._step_losses = LossAverager()
        self._step_hooks = step_hooks(self.model)  # (models/protocol.py's STEP_HOOK_ATTR: step.py)
        self._count_names = NamedSums()  # (the losses count_items counts, agreed over ranks)
        self._nonfinite = NonfiniteSteps(args.max_consecutive_nonfinite_steps)
        self.model.zero_grad(set_to_none=True)
        return epochs

    def _finish_training(self, start: float) -> TrainOutput:
        if self._async_saver is not None:  # (async_checkpoint) the last save is complete before train() returns
            self._async_saver.wait()
        self._poll_async_evaluations(at_end=True)  # (async_eval) evaluations still running, for a bounded time
        train_loss = self._run_loss.compute().get("loss", math.nan)
        steps = self.state.global_step
        # transformers' keys: train_runtime, train_samples_per_second, train_steps_per_second (this call's steps),
        # total_flos, train_loss; `epoch` is added by log()
        metrics = self._train_speed_metrics(start, steps - self._initial_global_step)
        self.store_flos()
        metrics.update(total_flos=self.state.total_flos, train_loss=train_loss)
        if self._nonfinite.total:
            metrics["train_nonfinite_steps"] = self._nonfinite.total
        # samples the collator dropped, by reason, over the whole run (resumes included) and ranks
        metrics.update(self._throughput.run_totals(self.rank == 0))
        self.log(metrics)
        if self.args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            load_model_state(self.model, self.state.best_model_checkpoint, self.parts)
        if self.rank == 0:
            self._rotate_checkpoints(at_end=True)
        self.control = self._event("on_train_end")
        return TrainOutput(steps, train_loss, metrics)
