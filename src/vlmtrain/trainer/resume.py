"""Saving and loading a whole training state (model, optimizer, scheduler, RNG, data position, loop
counters, stateful callbacks) as checkpoint-<step>/. A mixin of TrainerCore, kept apart so each file reads on
its own; the file formats live in checkpoint.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from typing import Any

import torch

from . import checkpoint as ckpt
from .model_files import has_sharded_weights
from .setup import load_model_state
from .sharding import ShardingPlan, keyed_by_name, sharding_of, sharding_plan
from .state import TrainerState

LOOP_STATE = "loop_state"  # loop_state_<rank>.pt: vlmtrain's own position and window state (transformers ignores it)
_RANK_FILE = re.compile(r"^(?:loop_state|rng_state)_(\d+)\.(?:pt|pth)$")


def saved_world_size(path: str) -> int:
    """How many processes wrote the checkpoint ``path``: its per-rank files (loop_state_<r>.pt, else
    rng_state_<r>.pth; transformers' rng_state.pth alone: 1)."""
    ranks = {int(m.group(1)) for m in map(_RANK_FILE.match, os.listdir(path)) if m}
    return max(ranks) + 1 if ranks else 1


def saved_workers(loader_state: dict[str, Any]) -> int:
    """The ``num_workers`` of the StatefulDataLoader that wrote ``loader_state`` (its ``state_dict()``)."""
    snapshot = loader_state.get("_snapshot")
    return 0 if snapshot is None else int(snapshot["_main_snapshot"]["_num_workers"])


class CheckpointMixin:
    """TrainerCore methods that write and read checkpoints (see DESIGN.md's output layout)."""

    def _loop_state(self) -> dict:
        epoch_done = self._steps_in_epoch is not None and self._micro_step == self._steps_in_epoch
        # After an epoch cut short by should_epoch_stop the next epoch starts with a fresh loader.
        stateless = not callable(getattr(self.train_dataloader, "state_dict", None))  # (an overridden loader)
        return {"loader": None if epoch_done or self._epoch_cut or stateless else self.train_dataloader.state_dict(),
                "epoch_index": self._epoch_index + int(epoch_done), "micro_step": 0 if epoch_done else self._micro_step,
                "train_losses": self._train_losses.state_dict(), "last_logged_step": self._last_logged_step,
                **self._throughput.state_dict(), "run_loss": self._run_loss.state_dict(),
                "nonfinite": self._nonfinite.state_dict(),
                "async_eval": self._async_eval.state_dict() if self._async_eval is not None else None}

    _async_saver: Any = None  # train.async_checkpoint: the background writer (the checkpoint_writer part's)

    def _start_checkpoint_writer(self) -> contextlib.AbstractContextManager:
        """(train() begins) train.async_checkpoint's background writer, the checkpoint_writer part's; FSDP's saves
        stay synchronous. The writer publishes each save at a later step end (its poll), the last one before
        train() returns (its wait), and, as the context train() runs in, lets no thread outlive a raise."""
        writer, self._async_saver = self.parts.checkpoint_writer, None
        if not self.args.async_checkpoint or writer is None or sharding_of(self.model, self.parts.sharding):
            return contextlib.nullcontext()
        self._async_saver = writer(self._get_output_dir(None), self.rank, self._rotate_checkpoints,
                                   self.parts.model_files)
        return self._async_saver

    def _save_checkpoint(self) -> str:
        out, step = self._get_output_dir(None), self.state.global_step
        if self.state.best_global_step == step:
            self.state.best_model_checkpoint = os.path.join(out, f"{ckpt.PREFIX}-{step}")
        if self._async_eval is not None:  # queued before the state is taken: a resume evaluates it if unlogged
            self._async_eval.enqueue(step)
        sharding = sharding_of(self.model, self.parts.sharding)
        if self._async_saver is not None:  # (train.async_checkpoint: _start_checkpoint_writer)
            return self._async_saver.save(step, lambda: self._checkpoint_files(sharded=False), self.model,
                                          self.processing_class)
        files = self._checkpoint_files(sharded=sharding is not None)
        if sharding is not None:  # the plan writes the model's (and optimizer's) shards or what it gathers
            path = sharding.save_checkpoint(self.model, self.optimizer, out, step, files, self.processing_class,
                                            self.rank)
        else:
            path = ckpt.write_checkpoint(out, step, files, lambda d: self.save_model(d, _internal_call=True), rank=self.rank)
        if self.rank == 0:
            self._rotate_checkpoints()
        return path

    def _get_output_dir(self, trial: Any) -> str:
        return self.args.output_dir  # (transformers' name, where checkpoints go; a trial is refused by train())

    def _load_callback_state(self) -> None:
        """(transformers' name) The checkpoint's stateful_callbacks into the running callbacks: vlmtrain.Trainer's
        (compat/callback_states.py); the core saves no callback state."""

    def _rotate_checkpoints(self, at_end: bool = False) -> None:
        """Delete the checkpoints beyond save_total_limit; ``at_end`` of training, with a limit of 1 and a best
        checkpoint, every one but the best (transformers' rule: the newest was kept only to resume)."""
        if at_end and not (self.args.save_total_limit == 1 and self.state.best_model_checkpoint is not None):
            return
        waiting = self._async_eval.in_use() if self._async_eval is not None else []  # (async_eval) kept until logged
        ckpt.rotate_checkpoints(self._get_output_dir(None), self.args.save_total_limit,
                                self.state.best_model_checkpoint, keep=waiting, newest=not at_end)

    def _poll_async_evaluations(self, at_end: bool = False) -> None:
        """(async_eval, every rank) At a step end, or ``at_end`` of training: rank 0 logs the evaluations that
        finished and launches the next; where it must wait for one, every rank waits with it (the evaluator's
        poll_in_step)."""
        if self._async_eval_waits is not None:
            self._async_eval_waits.poll_in_step(self.state.global_step, at_end, self._log_async_evaluations)

    def _log_async_evaluations(self, rows: list[dict]) -> None:
        """(async_eval, rank 0) Log each finished evaluation at its checkpoint's step; their checkpoints may
        now be rotated."""
        for row in rows:
            self.log(row)
        if rows:
            self._rotate_checkpoints()

    def _checkpoint_files(self, sharded: bool) -> dict[str, Any]:
        """This rank's files of a checkpoint, no two ranks naming the same one: RNG and loop state per rank;
        rank 0 alone the trainer state, the scheduler and (unless FSDP shards it) the optimizer, which DDP keeps
        identical on every rank."""
        files = {ckpt.rng_state_name(self.rank, self.world_size): ckpt.rng_state(self.world_size),
                 f"{LOOP_STATE}_{self.rank}.pt": self._loop_state()}
        if self.rank == 0:
            files.update({ckpt.STATE_NAME: dataclasses.asdict(self.state),
                          "scheduler.pt": self.lr_scheduler.state_dict(), ckpt.ARGS_NAME: self.args})
            if not sharded:
                files["optimizer.pt"] = self.optimizer.state_dict()
        return files

    def _read_loop_state(self, path: str) -> tuple[dict | None, int]:
        """This rank's loop state in checkpoint ``path`` (None for transformers' checkpoints, which have none), the
        train loader put at its position, and how many processes wrote it. A checkpoint of another number of
        processes, or of data loader workers, than this run's is the ``reposition`` part's (vlmtrain.Trainer's:
        checkpointing/reposition.py)."""
        saved = saved_world_size(path)
        if not os.path.isfile(os.path.join(path, f"{LOOP_STATE}_0.pt")):
            return None, saved
        if saved == self.world_size:
            loop = ckpt.load_torch(os.path.join(path, f"{LOOP_STATE}_{self.rank}.pt"))
            state = loop["loader"] if loop["micro_step"] else None  # (0: saved as its epoch ended: the next one)
            if state is not None and saved_workers(state) == int(getattr(self.train_dataloader, "num_workers", 0)):
                self.train_dataloader.load_state_dict(state)
            elif state is not None:  # (saved with another dataloader_num_workers)
                self.parts.reposition.load_loader_state(self.train_dataloader, state, path)
            return loop, saved
        ranks = range(saved) if self.rank == 0 else [0]  # (rank 0 sums every saved rank's counts)
        states = [ckpt.load_torch(os.path.join(path, f"{LOOP_STATE}_{r}.pt")) for r in ranks]
        return self.parts.reposition.loop_state(states, self.train_dataloader, path, saved, self.rank, self.world_size,
                                                self.args.gradient_accumulation_steps), saved

    def _load_checkpoint(self, path: str) -> None:
        loop, saved_world = self._read_loop_state(path)  # (first: a refusal before any weight is read)
        sharding = sharding_of(self.model, self.parts.sharding)
        sharded, sharded_model = has_sharded_weights(path), sharding is not None
        trainable_only = self.parts.model_files.saves_trainable_only(self.model)  # (LoRA: adapter files, FSDP or not)
        if sharded != sharded_model and not (trainable_only and not sharded):
            raise ckpt.CheckpointError(
                f"{path!r} was written {'with' if sharded else 'without'} train.fsdp; resume it with train.fsdp="
                f"{sharded} under torchrun" + (", or export it (vlmtrain export) to start a new run from its "
                                               "weights." if sharded else "."))
        if sharded:
            sharding.load_sharded(self.model, self.optimizer, path)
        else:  # (LoRA under FSDP: every rank reads the small adapter and heads files and keeps its shards)
            load_model_state(self.model, path, self.parts)
        saved = TrainerState.load_from_json(os.path.join(path, ckpt.STATE_NAME))
        if loop is not None and saved_world != self.world_size:
            self._end_epochs_after(saved.global_step, loop)
        if saved.max_steps != self.state.max_steps:
            warnings.warn(f"Resuming {path!r} with max_steps={self.state.max_steps}, the checkpoint was made with "
                          f"{saved.max_steps}.", stacklevel=3)
        saved.max_steps, saved.num_train_epochs = self.state.max_steps, self.state.num_train_epochs
        # (rank 0 wrote the file: without this every rank would take itself for process zero and log)
        saved.is_world_process_zero = saved.is_local_process_zero = self.rank == 0
        self.state = saved
        self._load_callback_state()
        if not sharded:  # (else the optimizer came with the shards)
            self._load_optimizer_file(path, sharding)
        self.lr_scheduler.load_state_dict(ckpt.load_torch(os.path.join(path, "scheduler.pt")))
        if loop is None:  # transformers' checkpoint: the position follows from global_step
            self._epoch_index, self._micro_step = self.parts.step_position(
                path, f"{LOOP_STATE}_{self.rank}.pt", self.train_dataloader, self.state.global_step,
                self.state.max_steps, self._steps_in_epoch, self.args.gradient_accumulation_steps)
            self._last_logged_step = self.state.global_step
            ckpt.set_rng_state(ckpt.load_rng_state(path, self.rank))
            return
        self._epoch_index, self._micro_step = loop["epoch_index"], loop["micro_step"]
        self._train_losses.load_state_dict(loop["train_losses"])
        if "run_loss" in loop:  # the whole run's mean loss (TrainOutput.train_loss) goes on across resumes
            self._run_loss.load_state_dict(loop["run_loss"])
        self._last_logged_step = loop["last_logged_step"]
        if "nonfinite" in loop:  # steps skipped for NaN/Inf: in a row (max_consecutive_nonfinite_steps), in all
            self._nonfinite.load_state_dict(loop["nonfinite"])
        if self._async_eval is not None:
            self._async_eval.load_state_dict(loop.get("async_eval") or {}, self.state.global_step)
        self._throughput.load_state_dict(loop)
        ckpt.set_rng_state(ckpt.load_rng_state(path, self.rank))

    def _end_epochs_after(self, global_step: int, loop: dict) -> None:
        """(resumed by another number of processes) An epoch-based run's max_steps, and the schedule the Trainer
        built over it, end at num_train_epochs' end in steps of the new size."""
        if self.args.max_steps > 0 or self._steps_in_epoch is None:
            return
        self.state.max_steps = self.parts.reposition.max_steps_after(
            global_step, loop["epoch_index"], loop["micro_step"], self._steps_in_epoch,
            self.args.gradient_accumulation_steps, self.args.num_train_epochs)
        if self.lr_scheduler is self._built_scheduler:  # (a scheduler passed in optimizers= stays as it is)
            self.lr_scheduler = self._built_scheduler = None
            self.create_scheduler(self.state.max_steps)
            self.callback_handler.refs["lr_scheduler"] = self.lr_scheduler

    def _load_optimizer_file(self, path: str, sharding: ShardingPlan | None) -> None:
        """A checkpoint's optimizer.pt: by position (written unsharded) or by parameter name (gathered from FSDP
        shards); ``sharding``: the plan that sharded the model, if any."""
        names = [group.get("name") for group in self.optimizer.param_groups]
        state = ckpt.load_torch(os.path.join(path, "optimizer.pt"))
        if sharding is None and not keyed_by_name(state):  # written and read unsharded
            self.optimizer.load_state_dict(state)
        else:
            sharding_plan(self.parts.sharding).load_optimizer_state(self.model, self.optimizer, state)
        for group, name in zip(self.optimizer.param_groups, names):  # (transformers' groups have no names)
            if name is not None:
                group.setdefault("name", name)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write model.safetensors (+ config.json), the tokenizer/processor files and the arguments
        (training_args.bin, as transformers) to output_dir (rank 0). Under FSDP every rank must call it: the
        shards are gathered first. A checkpoint (``_internal_call``) writes the arguments with its other files."""
        sharding, output_dir = sharding_of(self.model, self.parts.sharding), output_dir or self.args.output_dir
        if sharding is not None:
            sharding.save_full_model(self.model, output_dir, self.processing_class, self.rank)
        elif self.rank == 0:
            self.parts.model_files.save_model_files(self.model, output_dir, self.processing_class)
        if self.rank == 0 and not _internal_call:
            torch.save(self.args, os.path.join(output_dir, ckpt.ARGS_NAME))
