"""Asynchronous checkpoints (`train.async_checkpoint`): training goes on while a checkpoint is written.

The save copies everything to CPU at once (the model as a copy whose trainable tensors are CPU clones, the
optimizer, scheduler, RNG and loop state as CPU clones), then one background thread writes and fsyncs the files
into the temporary directory. The thread runs no collective: at each step end (:meth:`AsyncCheckpointer.poll`)
the ranks agree whether every rank's writer is done, and then, as a synchronous save does, whether any failed
(every rank raises) or rank 0 renames the directory into place. So a checkpoint still appears complete or not at
all, and kill -9 at any moment leaves at most a temporary directory that the next start removes. At most one save
is in flight: the next save and the end of training wait for it.

The trainer never imports this module: :class:`AsyncCheckpointer` is vlmtrain.Trainer's ``checkpoint_writer``
part (trainer/parts.py); a Trainer without one, or with a sharded model, writes synchronously.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vlmtrain.trainer import checkpoint as ckpt
from vlmtrain.trainer.distributed import barrier, reduce_cpu


def cpu_snapshot(obj: Any) -> Any:
    """A copy of obj (nested dicts, lists, tuples) in which every tensor is a CPU clone: later in-place updates
    (an optimizer step) do not reach it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cpu_snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(cpu_snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def cpu_model_copy(model: nn.Module) -> nn.Module:
    """A copy of model to write from while the original trains: trainable parameters and buffers are CPU clones
    (tied parameters stay tied), frozen parameters are shared (training does not change them, e.g. a LoRA base)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True)) if p.requires_grad else p
    for b in model.buffers():
        memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(model, memo)


class AsyncCheckpointer:
    """Writes one checkpoint at a time in a background thread; see the module docstring. Every rank makes the
    same calls in the same order (save, poll, wait), as they hold collectives. The context training runs in."""

    def __init__(self, output_dir: str, rank: int, after_publish: Callable[[], None], model_files: Any) -> None:
        """``model_files``: the Trainer's format of the model's files (its ``model_files`` part)."""
        self.output_dir, self.rank, self.after_publish = output_dir, rank, after_publish
        self.model_files = model_files
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._error: Exception | None = None

    @property
    def pending(self) -> bool:
        return self._step is not None

    def save(self, step: int, files: Callable[[], dict[str, Any]], model: nn.Module, processing_class: Any) -> str:
        """Publish the previous save (waiting for it), then copy this rank's ``files()`` ({name: object}) and
        (rank 0) ``model`` to CPU now and write them, with ``processing_class``'s files, in the background.
        Returns the path the checkpoint will have."""
        self.wait()
        snapshot, write_model = {}, None

        def take() -> None:
            nonlocal snapshot, write_model
            snapshot = cpu_snapshot(files())
            if self.rank == 0:
                write_model = functools.partial(self.model_files.save_model_files, cpu_model_copy(model),
                                                processing_class=processing_class)

        tmp = ckpt.start_checkpoint(self.output_dir, step, self.rank, error=ckpt.capture(take))
        self._step, self._error = step, None
        self._thread = threading.Thread(target=self._write, args=(tmp, snapshot, write_model),
                                        name=f"vlmtrain-checkpoint-{step}")
        self._thread.start()
        return os.path.join(self.output_dir, f"{ckpt.PREFIX}-{step}")

    def _write(self, tmp: str, files: dict[str, Any], write_model: Callable[[str], None] | None) -> None:
        self._error = ckpt.capture(lambda: ckpt.write_files(tmp, files, write_model))

    def poll(self) -> str | None:
        """At a step end: if every rank's writer is done, publish the checkpoint (or raise its error on every
        rank) and return its path; else None at once."""
        if not self.pending:
            return None
        busy = self._thread is not None and self._thread.is_alive()
        if reduce_cpu([float(busy)], "max")[0]:
            return None
        return self._publish()

    def wait(self) -> str | None:
        """Wait for the save in flight, then publish it (or raise its error on every rank); every rank returns
        once the checkpoint is visible."""
        if not self.pending:
            return None
        path = self._publish()
        barrier()
        return path

    def abandon(self) -> None:
        """On an error: let the writer finish, publish nothing (no collective: other ranks may be gone). The
        temporary directory is removed when a run next starts in output_dir."""
        if self._thread is not None:
            self._thread.join()
        self._thread = self._step = self._error = None

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, error_type: type | None, *_: Any) -> None:
        """Training that raises lets the writer finish first (:meth:`abandon`): no thread outlives train()."""
        if error_type is not None:
            self.abandon()

    def _publish(self) -> str:
        self._thread.join()
        step, error = self._step, self._error
        self._thread = self._step = self._error = None
        path = ckpt.publish_checkpoint(self.output_dir, step, self.rank, error)
        if self.rank == 0:
            self.after_publish()
        return path
