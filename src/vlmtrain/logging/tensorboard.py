"""TensorBoard writer: scalars in `<output_dir>/runs/<run_name>` (pip install 'vlmtrain[tensorboard]')."""

from __future__ import annotations

import os

from .tracker import TrackerCallback


class TensorBoardCallback(TrackerCallback):
    """Writes every numeric log value as a scalar (`train/*`, `eval/*`) at the row's step to
    `<output_dir>/runs/<run_name>`. A run resumed from checkpoint-N opens its writer with purge_step N+1:
    TensorBoard hides what the crashed run logged after N, and the resumed run writes those steps again."""

    name = "tensorboard"
    requires = "tensorboard"
    hint = "Check that output_dir is writable."
    skips_logged_steps = False  # purge_step replaces the crashed run's later steps instead

    def __init__(self, output_dir: str, run_name: str | None = None, project: str = "huggingface",
                 config: dict | None = None) -> None:
        super().__init__(output_dir, run_name, project, config)
        self.log_dir = os.path.join(output_dir, "runs", self.run_name)  # (None: output_dir's basename)
        self.writer = None
        self.purge_step: int | None = None  # the step a resumed run purged from
        self._purge_pending = False

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.on_train_end(args, state, control)  # a writer left open by an earlier train() in this process
            self.purge_step = state.global_step + 1 if state.global_step > 0 else None
            self._purge_pending = self.purge_step is not None
        super().on_train_begin(args, state, control, **kwargs)

    def start(self, run_id: str | None) -> str:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.log_dir, purge_step=self.purge_step if self._purge_pending else None)
        self._purge_pending = False  # purge once: a writer reopened by evaluate() after train() keeps every step
        return self.log_dir

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()
        self.writer = None
