"""Sharded models (train.fsdp): what the trainer asks of the layer that shards a model's parameters, gradients
and optimizer state over the ranks, without importing it. That layer (FSDP2 with DCP checkpoints) gives a
:class:`ShardingPlan` as the Trainer's ``sharding`` part (parts.py; vlmtrain.Trainer's: vlmtrain/parallel/fsdp.py).
The trainer calls it only for a model the plan sharded (:func:`sharding_of`) or when train.fsdp asks to shard one
(:func:`sharding_plan`); a single process and DDP never reach it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ConfigError


class ShardingPlan(Protocol):
    """How model and optimizer state is sharded, saved, loaded and gathered. A method given a sharded model is
    a collective: every rank calls it."""

    def is_sharded(self, model: nn.Module) -> bool:
        """Whether ``model`` is sharded (by this plan)."""

    def shard_model(self, model: nn.Module, bf16: bool = False) -> nn.Module:
        """Shard ``model`` in place over the default process group (``bf16``: bfloat16 compute)."""

    def reshard(self, model: nn.Module) -> None:
        """Every unit of the sharded ``model`` back to its shards (after evaluation: before an optimizer is built)."""

    def save_checkpoint(self, model: nn.Module, optimizer: torch.optim.Optimizer, output_dir: str, step: int,
                        files: dict[str, Any], processing_class: Any, rank: int) -> str:
        """output_dir/checkpoint-<step> of the sharded ``model`` with ``files`` (this rank's, as
        checkpoint.write_checkpoint takes them; the optimizer is the plan's to save); returns its path."""

    def load_sharded(self, model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
        """Model and optimizer state from the shards that ``save_checkpoint`` wrote (`dcp/`)."""

    def load_model_state(self, model: nn.Module, directory: str) -> None:
        """A checkpoint's model weights (shards or files) into the sharded ``model``."""

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any]) -> None:
        """An optimizer state keyed by parameter name, or by position into a sharded model's optimizer."""

    def save_full_model(self, model: nn.Module, directory: str, processing_class: Any, rank: int) -> None:
        """The sharded model gathered and written as an unsharded one's files (rank 0 writes)."""

    def eval_in_step(self, batches: Iterator[Any], skipped: Counter, run_stand_in: Callable[[Any], Any]
                     ) -> Iterator[Any]:
        """This rank's share of an eval set (``batches``) to run with the sharded model, in step with the other
        ranks (all-bad batches counted in ``skipped``; ``run_stand_in(batch)`` runs one whose results are dropped
        while another rank still evaluates)."""


def sharding_of(model: nn.Module, plan: ShardingPlan | None) -> ShardingPlan | None:
    """``plan`` if it sharded ``model``; None for a model that is not sharded (or no plan)."""
    return plan if plan is not None and plan.is_sharded(model) else None


def sharding_plan(plan: ShardingPlan | None) -> ShardingPlan:
    """The plan train.fsdp shards with (ConfigError when the Trainer has none)."""
    if plan is None:
        raise ConfigError("train.fsdp and FSDP checkpoints need the trainer part 'sharding' (vlmtrain.Trainer's "
                          "FSDP plan, vlmtrain/parallel/fsdp.py), which the trainer core lacks: use vlmtrain.Trainer.")
    return plan


def keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict names its parameters (gathered from FSDP shards) rather than numbering
    them (``optimizer.state_dict()``)."""
    return any(isinstance(p, str) for g in optimizer_state.get("param_groups", []) for p in g["params"])
