"""What GRPO's ranks share and what its checkpoints hold beyond a Trainer's.

Ranks: each process rolls out its own slice of a generation batch; the rewards (and the completion lengths the
logs report) are gathered over the processes before the group-relative advantages, as TRL gathers them (a group,
or ``scale_rewards: batch``'s batch, may span processes), and each process keeps its slice of the advantages.

Checkpoints: ``grpo_rollout_<rank>.pt`` holds each process's rollout state: the micro-step count (where the next
generation falls), the buffered generation batch that the next micro-steps take their slices of (its completions,
advantages and the log-probs of the policy that sampled it: a resume inside a buffer, ``num_iterations`` or
``steps_per_generation`` > gradient accumulation, trains on exactly those; regenerating them would sample from the
moved policy), the logging window's rollout metrics, the skipped reward calls and the completions table. The
prompt sampler's position is the train loader's (Trainer's checkpoint), its permutation the epoch's
(grpo_rollout.GroupSampler); the generator's randomness is torch's RNG, restored with the Trainer's RNG state."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch

from ..evaluation.gather import all_gather_padded
from ..trainer import checkpoint as ckpt
from ..trainer.resume import saved_world_size

ROLLOUT_STATE = "grpo_rollout"  # grpo_rollout_<rank>.pt in checkpoint-<step>/


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's rows of ``tensor`` (the same shape on each: a slice of the generation batch) in rank
    order, on CPU (through the gloo metrics group); in one process the tensor itself."""
    return torch.cat(all_gather_padded(tensor.detach().cpu()))


class RolloutCheckpoints:
    """GRPOTrainer's checkpoint part beyond the Trainer's: :meth:`rollout_state_dict` written per rank, read back
    by :meth:`load_rollout_state_dict` when a run resumes; and the prompt sampler told each epoch."""

    def rollout_state_dict(self) -> dict[str, Any]:
        """This process's rollout state (module docstring), on CPU."""
        buffer = None if self._buffer is None else [{k: v.detach().cpu() for k, v in b.items()}
                                                    for b in self._buffer]
        return {"micro": self._micro, "buffer": buffer, "metrics": dict(self._rollout_metrics),
                "skipped": dict(self._skipped), "table": list(self._table)}

    def load_rollout_state_dict(self, state: dict[str, Any]) -> None:
        self._micro = state["micro"]
        self._buffer = None if state["buffer"] is None else [{k: v.to(self.device) for k, v in b.items()}
                                                             for b in state["buffer"]]
        self._rollout_metrics = defaultdict(list, state["metrics"])
        self._skipped, self._table = dict(state["skipped"]), list(state["table"])

    def _checkpoint_files(self, sharded: bool) -> dict[str, Any]:
        return {**super()._checkpoint_files(sharded), f"{ROLLOUT_STATE}_{self.rank}.pt": self.rollout_state_dict()}

    def _load_checkpoint(self, path: str) -> None:
        saved = saved_world_size(path)
        if saved != self.world_size:  # (before any weight is read)
            raise ckpt.CheckpointError(f"{path} was written by {saved} process(es): a GRPO run resumes with the "
                                       f"number of processes that wrote it (this run has {self.world_size}), its "
                                       "rollouts being per process.")
        super()._load_checkpoint(path)
        state = os.path.join(path, f"{ROLLOUT_STATE}_{self.rank}.pt")
        if os.path.isfile(state):  # (else a checkpoint without one: the next micro-step generates)
            self.load_rollout_state_dict(ckpt.load_torch(state))

    def _set_data_epoch(self, loader: Any) -> None:
        super()._set_data_epoch(loader)
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self._epoch_index)
