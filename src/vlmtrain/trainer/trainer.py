"""TrainerCore: transformers' Trainer API (train / evaluate / predict, callbacks, checkpoints) in a small loop.
``vlmtrain.Trainer`` is TrainerCore with transformers' counts, evaluation conventions and extra public methods
(vlmtrain/compat/). One optimizer step (forward, backward, gradient scaling, the optimizer step) is step.py's.
"""

from __future__ import annotations

import inspect
import itertools
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from . import checkpoint as ckpt
from . import distributed as dist
from .args import TrainingArgumentsCore
from .callbacks import CallbackHandler, DefaultFlowCallback, LoggingCallbacks, TrainerCallback
from .counts import CountsMixin
from .evaluation import EvaluationMixin
from .optim import freeze_zero_lr, learning_rates
from .parts import TrainerParts
from .preemption import PreemptionGuard
from .resume import CheckpointMixin
from .setup import SetupMixin, set_seed, set_tf32
from .state import TrainerControl, TrainerState, TrainOutput
from .stats import (
    BOOKKEEPING_KEYS,
    LOSS_ONLY_ATTR,
    dropped_for_rank_sync,
    is_empty_batch,
)
from .step import StepMixin, step_hooks


class TrainerCore(SetupMixin, StepMixin, CheckpointMixin, EvaluationMixin, CountsMixin):
    """The loop, evaluation and checkpoints of the Trainer: trains any module whose forward returns a mapping (or
    ModelOutput) with `loss`, or a tuple `(loss, ...)`, on any map-style or iterable dataset of dict samples.
    ``vlmtrain.Trainer`` adds transformers' extra public methods (log_metrics, save_metrics, ...)."""

    callback_handler_class: type[CallbackHandler] = CallbackHandler
    parts: TrainerParts = TrainerParts()  # what the layers above give (parts.py): vlmtrain.Trainer sets them all

    def __init__(self, model: nn.Module | None = None, args: TrainingArgumentsCore | None = None,
                 data_collator: Any = None, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | dict[str, Dataset] | None = None, processing_class: Any = None,
                 model_init: Any = None, compute_loss_func: Any = None, compute_metrics: Any = None,
                 callbacks: list[TrainerCallback] | None = None, optimizers: tuple[Any, Any] = (None, None),
                 optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
                 preprocess_logits_for_metrics: Any = None, parts: TrainerParts | None = None) -> None:
        self.parts = parts if parts is not None else self.parts  # (Trainer(parts=...): this Trainer's own)
        self.args = args if args is not None else self.parts.arguments_class()
        set_seed(self.args.seed)  # (at construction, as transformers: before a model is built or prepared)
        model = self._resolve_model(model, model_init, compute_loss_func, optimizers, optimizer_cls_and_kwargs)
        if eval_dataset is None:
            self._check_no_eval_needed()
        # under torchrun: join the process group (gloo / NCCL)
        dist.init_from_env(self.args.ddp_timeout, cpu=self.args.use_cpu)
        self.device = self.args.device
        set_tf32(self.args.tf32, self.device)
        self.model = self._prepare_model(model)  # (activation checkpointing on, before DDP/FSDP wrap it)
        self.rank, self.world_size = dist.rank(), dist.world_size()
        pad_id = getattr(processing_class, "pad_token_id", None) or 0
        default_collator = self.parts.default_collator
        self.data_collator = data_collator if data_collator is not None or default_collator is None else \
            default_collator(pad_id)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class, self.compute_metrics = processing_class, compute_metrics
        if self.args.batch_eval_metrics:
            self.parts.batch_eval_metrics.check(compute_metrics)
        # (logits, labels) -> what evaluation keeps of each batch for compute_metrics, e.g. argmax ids
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.state, self.control = TrainerState(), TrainerControl()
        self.state.is_world_process_zero = self.state.is_local_process_zero = self.rank == 0
        # the trackers, the progress bar and metrics.jsonl (vlmtrain.Trainer's: vlmtrain/logging/writers.py)
        logs = self.parts.logging_callbacks(self.args) if self.parts.logging_callbacks else LoggingCallbacks()
        self.callback_handler = self.callback_handler_class(
            [DefaultFlowCallback(), *logs.integrations, *(callbacks or []), *logs.progress],
            model=self.model, processing_class=processing_class, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler)
        self.callback_handler.writers = list(logs.writers)
        self.train_dataloader: StatefulDataLoader | None = None
        self._preemption: PreemptionGuard | None = None
        self.preempted = False  # set when a SIGTERM/SIGUSR1 ended training early (a checkpoint was saved)
        # train.async_eval: rank 0 has saved checkpoints evaluated by other processes (vlmtrain.evaluation.async_eval;
        # its evaluator is None when the arguments ask for none); every rank waits with it (_poll_async_evaluations)
        make_evaluator = self.parts.checkpoint_evaluator
        self._async_eval_waits = make_evaluator(self.args) if make_evaluator is not None else None
        self._async_eval = self._async_eval_waits if self.rank == 0 else None
        self._forward_takes_use_cache = "use_cache" in inspect.signature(self.model.forward).parameters
        self._forward_takes_loss_only = bool(getattr(self.model, LOSS_ONLY_ATTR, False))
        self._label_smoother = (self.parts.label_smoothing(self.args.label_smoothing_factor, self.model)
                                if self.args.label_smoothing_factor else None)
        self.control = self._event("on_init_end")

    def _check_no_eval_needed(self) -> None:
        """Without an eval_dataset, the arguments must not ask for evaluation."""
        if self.args.eval_strategy != "no":
            raise ValueError(f"eval_strategy={self.args.eval_strategy!r} needs an eval_dataset; pass "
                             "Trainer(eval_dataset=...) or set eval_strategy='no'.")
        if self.args.eval_on_start:
            raise ValueError("eval_on_start=True needs an eval_dataset: pass Trainer(eval_dataset=...).")

    # -- callbacks -------------------------------------------------------------------------------------
    def add_callback(self, callback: type | TrainerCallback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: type | TrainerCallback) -> TrainerCallback | None:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: type | TrainerCallback) -> None:
        self.callback_handler.remove_callback(callback)

    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        return self.evaluate(ignore_keys=ignore_keys_for_eval)  # (transformers' name: the loop's evaluations)

    def _event(self, name: str, **kwargs: Any) -> TrainerControl:
        return self.callback_handler.call(name, self.args, self.state, self.control, **kwargs)

    # -- data ------------------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Move tensors to the device. `prompt_*` keys (generation only) and the collator's bookkeeping
        (`skipped` samples, `pack_stats`) stay out of forward."""
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items() if not k.startswith("prompt_") and k not in BOOKKEEPING_KEYS}

    # -- the loop --------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None) -> TrainOutput:
        """Train for max_steps (or num_train_epochs); resume from a checkpoint path, or True for the newest."""
        args, self._eval_ignore_keys = self.args, ignore_keys_for_eval
        self._reinit_model(trial)  # (model_init: a fresh model per train(); a trial is refused)
        resume = ckpt.resolve_resume(args.resume_from_checkpoint if resume_from_checkpoint is None
                                     else resume_from_checkpoint, args.output_dir, self.rank, self.parts.model_files)
        ckpt.prepare_output_dir(args.output_dir, self.rank)
        if self._async_eval is not None:
            self._async_eval.check_command()
        self.train_dataloader = loader = self.get_train_dataloader()
        if args.fsdp and self.optimizer is not None and self.world_size > 1:
            raise ValueError("train.fsdp shards the model's parameters: let the Trainer build the optimizer (do "
                             "not pass optimizers=), or shard the model yourself before building it.")
        if self.optimizer is None:  # module_learning_rates 0: frozen before DDP registers what needs gradients
            freeze_zero_lr(self.model, args)
        # Before the optimizer: FSDP replaces the parameters.
        model = dist.wrap_model(self.model, self.device, args.fsdp, args.bf16, ddp_kwargs=args.ddp_kwargs(),
                                sharding=self.parts.sharding)
        if args.torch_compile:  # the whole model, or each transformer layer (a Hub VLM: models/speed/training_prep.py)
            model = self.parts.compile_model(self.model, model, args.torch_compile_backend or "inductor",
                                             args.torch_compile_mode)
        epochs = self._setup_training(loader)
        if resume is not None:
            self._load_checkpoint(resume)
        requested = resume_from_checkpoint if resume_from_checkpoint is not None else args.resume_from_checkpoint
        start = self._begin_session(restarted=resume is None and ckpt.resume_requested(requested))
        self.control = self._event("on_train_begin")
        if self.state.global_step >= self.state.max_steps:  # resumed from the run's final checkpoint: done
            self.control.should_training_stop = True
        if args.eval_on_start:  # a sanity check of the eval setup, logged at the current step (0 unless resumed)
            paused = time.perf_counter()
            self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)
            self._throughput.exclude(time.perf_counter() - paused)
        # SIGTERM/SIGUSR1: finish the step, save, return. An error waits for a checkpoint being written.
        with PreemptionGuard() as self._preemption, self._start_checkpoint_writer():
            while self._epoch_index < epochs and not self.control.should_training_stop:
                self.control = self._event("on_epoch_begin")
                self._run_epoch(model, loader)
                self.control = self._event("on_epoch_end")
                self._maybe_log_save_evaluate()
        return self._finish_training(start)

    def _run_epoch(self, model: nn.Module, loader: StatefulDataLoader) -> None:
        accum, steps_in_epoch = self.args.gradient_accumulation_steps, self._steps_in_epoch
        self._set_data_epoch(loader)
        batches, seen, self._epoch_cut = self._usable_batches(iter(loader)), self._micro_step, False
        count_items = getattr(self.model, "count_items", None)
        window: list[Any] = []
        while True:
            if not window:
                window = self._next_window(batches, count_items)
                if not window:
                    break  # the epoch's data is done (on every rank alike)
            batch = window.pop(0)
            seen += 1
            if self._micro_step % accum == 0:
                self.control = self._event("on_step_begin")
            self._count_batch(batch)  # FLOP estimate (total_flos), input tokens (include_num_input_tokens_seen)
            ends_window = (self._micro_step + 1) % accum == 0 or self._micro_step + 1 == steps_in_epoch
            with dist.maybe_no_sync(model, sync=ends_window):  # DDP all-reduces once per window
                self.training_step(model, batch, self._window_counts)
            self._unsynced = not ends_window and hasattr(model, "no_sync")
            self._micro_step += 1
            if self._micro_step % accum == 0 or self._micro_step == steps_in_epoch:
                self._optimizer_step(model)
            else:
                self.control = self._event("on_substep_end")
            if self.control.should_training_stop:
                return
            if self.control.should_epoch_stop:
                # A callback ended the epoch: drop an unfinished accumulation window and go on with the next epoch
                # (transformers too moves on, but leaves that window's gradients in .grad for the next step).
                model.zero_grad(set_to_none=True)
                self._window_weight, self._window_counts, self._epoch_cut = None, None, True
                self._step_hooks = step_hooks(self.model)  # (their notes of the dropped window cleared)
                break
        # The epoch is complete.
        if self._window_weight is not None:
            self._optimizer_step(model)  # an iterable dataset ran out mid-window: step on what was accumulated
        self._epoch_index, self._micro_step = self._epoch_index + 1, 0
        if seen == 0:  # (a resumed epoch counts its batches before the checkpoint: a stream may end there)
            warnings.warn("The train dataloader yielded no batch this epoch: stopping training.", stacklevel=2)
            self.control.should_training_stop = True

    def _set_data_epoch(self, loader: StatefulDataLoader) -> None:
        """Tell the loader's sampler (or a stream) which epoch begins: its shuffle, and where it resumes."""
        sampler, dataset = getattr(loader, "sampler", None), getattr(loader, "dataset", None)  # (any iterable)
        if isinstance(sampler, StatefulDistributedSampler):
            sampler.set_epoch(self._epoch_index)
        if hasattr(sampler, "first_step"):  # steps done when this epoch began (micro_step > 0: resumed)
            sampler.first_step = self.state.global_step - self._micro_step // self.args.gradient_accumulation_steps
        elif hasattr(dataset, "set_epoch"):  # a stream (e.g. StreamingDataset) reshuffles its shards
            dataset.set_epoch(self._epoch_index)

    def _next_window(self, batches: Iterator[Any], count_items: Any) -> list[Any]:
        """The next micro-batches to run ([] when the epoch's data is done). A model that counts each loss's
        items (count_items) gets the rest of the accumulation window at once, counted before its first forward
        (transformers' get_batch_samples); others get one micro-batch at a time."""
        size = 1
        if count_items is not None:  # the rest of this accumulation window
            accum = self.args.gradient_accumulation_steps
            size = accum - self._micro_step % accum
            if self._steps_in_epoch is not None:
                size = max(1, min(size, self._steps_in_epoch - self._micro_step))
        window = list(itertools.islice(batches, size))
        if window and count_items is not None:
            self._window_counts = self._count_window(count_items, window)
        return window

    def _usable_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The loader's batches that hold samples, each counted (data-wait time, skipped samples) as it is
        fetched. Under torch.distributed every rank takes the same turns: the stream ends on every rank when it
        ends on one, and a micro-batch left empty on one rank is dropped (counted) on all."""
        while True:
            fetch_start = time.perf_counter()
            batch = next(batches, None)
            waited = time.perf_counter() - fetch_start
            if self.world_size > 1:  # ranks agree on every micro-batch, or one waits in a collective forever:
                ended, empty_somewhere = dist.reduce_cpu(
                    [float(batch is None), float(batch is not None and is_empty_batch(batch))], "max")
                if ended:
                    return  # a stream ran dry on some rank: every rank ends the epoch here
                if empty_somewhere and not is_empty_batch(batch):
                    batch = dropped_for_rank_sync(batch)  # another rank has no sample: every rank skips, counted
            if batch is None:
                return
            self._throughput.add_batch(batch, waited)
            if is_empty_batch(batch):  # every sample was bad: counted, no step
                self._throughput.check_bad_fraction(self.args.max_bad_sample_fraction)
                continue
            yield batch

    def _maybe_log_save_evaluate(self) -> None:
        if self._async_saver is not None:  # (async_checkpoint) the previous save, once every rank wrote it
            self._async_saver.poll()
        if self.control.should_log and self.state.global_step > self._last_logged_step:
            logs = self._train_losses.compute()
            self._train_losses.reset()
            nonfinite = self._nonfinite.pop_window()
            if nonfinite:
                logs["nonfinite_steps"] = nonfinite
            if self._grad_norm is not None:
                logs["grad_norm"] = float(self._grad_norm)
            logs.update(self._last_lrs or learning_rates(self.optimizer))
            window = self._throughput.over_ranks()  # skipped samples over ranks: every rank checks the same
            self._throughput.check_bad_fraction(self.args.max_bad_sample_fraction, window)
            logs.update(self._throughput.compute(window))
            self._throughput.reset()
            self._last_logged_step = self.state.global_step
            self.store_flos()
            self.log(logs, self._train_start)
        paused = time.perf_counter()
        if self.control.should_evaluate:
            metrics = self._evaluate(None, self._eval_ignore_keys)
            is_best = self._update_best(metrics)
            if self.args.save_strategy == "best":
                self.control.should_save = is_best
        if self.control.should_save:
            self.store_flos()  # (state.total_flos up to date in trainer_state.json)
            self._save_checkpoint()
            self.control = self._event("on_save")
        self._poll_async_evaluations()
        self._throughput.exclude(time.perf_counter() - paused)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add `epoch` (in place) and record transformers' keys in log_history; on_log gets all (see _log_row). A row
        with its own `step` (an async evaluation of an earlier checkpoint) is logged at that step."""
        if "step" not in logs:
            logs["epoch"] = self.state.epoch
        row = self._log_row(logs, start_time)
        self.state.log_history.append({**row, "step": row.get("step", self.state.global_step)})
        self.control = self._event("on_log", logs=logs)
