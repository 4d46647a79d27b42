"""Weights & Biases writer (pip install 'vlmtrain[wandb]'): files under `<output_dir>/wandb/` (WANDB_DIR wins)."""

from __future__ import annotations

import os
import uuid

from .tracker import TrackerCallback

STEP_KEY = "train/global_step"


class WandbCallback(TrackerCallback):
    """Logs every row with its step as the `train/global_step` value, the x-axis of every metric
    (define_metric): wandb's own `_step` only counts rows, so a late row (an evaluation of checkpoint-N logged
    while training is past N) is kept at step N instead of being refused. Project: WANDB_PROJECT, else
    train.project; run name: train.run_name. WANDB_MODE=offline writes the run locally (`wandb sync` uploads
    it). A resumed run continues the same run id (resume="allow")."""

    name = "wandb"
    requires = "wandb"
    hint = ("Log in with `wandb login` (or set WANDB_API_KEY), or set WANDB_MODE=offline to write the run under "
            "output_dir/wandb and upload it later with `wandb sync`.")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.run = None

    def start(self, run_id: str | None) -> str:
        import wandb

        directory = os.environ.get("WANDB_DIR") or self.output_dir
        os.makedirs(directory, exist_ok=True)
        # create_new: a run the user opened with wandb.init() stays as it is
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or self.project, name=self.run_name,
                              id=run_id or uuid.uuid4().hex[:12], resume="allow", dir=directory,
                              config=self.config, reinit="create_new")
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        return self.run.id

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({STEP_KEY: step, **metrics})

    def finish(self) -> None:
        self.run.finish()
        self.run = None
