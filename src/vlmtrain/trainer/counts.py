"""The loop's counting hooks: the start of a train() call, and where transformers' counts plug in (each
micro-batch's FLOP estimate and input tokens, the row state.log_history keeps of a log call, a train() call's
speed metrics). Here they count nothing but time; vlmtrain.Trainer overrides them with transformers' counts
(vlmtrain/compat/counts.py). A mixin of TrainerCore, kept apart so each file reads on its own."""

from __future__ import annotations

import time
from typing import Any


class CountsMixin:
    """TrainerCore's counting hooks, with plain defaults."""

    def _begin_session(self, restarted: bool = False) -> float:
        """Just before on_train_begin: this train() call's start (time, step, tokens seen); with ``restarted`` (a
        resume was asked for and no checkpoint exists) callbacks' ``on_restart_without_checkpoint()`` (not a
        transformers event: transformers' callbacks never see it). Returns the start time."""
        if restarted:
            for cb in self.callback_handler.every_callback:
                getattr(cb, "on_restart_without_checkpoint", lambda: None)()
        self._train_start = time.time()
        self._initial_global_step, self._initial_tokens_seen = self.state.global_step, self.state.num_input_tokens_seen
        return self._train_start

    def _count_batch(self, batch: Any) -> None:
        """Called on each micro-batch before its forward: nothing is counted here."""

    def store_flos(self) -> None:
        """Add the FLOPs counted since the last call to ``state.total_flos``: none are counted here."""

    def _log_row(self, logs: dict[str, Any], start_time: float | None) -> dict[str, Any]:
        """What state.log_history keeps of a log call: all of it here."""
        return logs

    def _train_speed_metrics(self, start: float, steps: int) -> dict[str, float]:
        """A train() call's speed metrics: its runtime here."""
        return {"train_runtime": round(time.time() - start, 4)}
