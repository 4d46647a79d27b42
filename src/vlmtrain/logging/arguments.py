"""The logging layer's arguments: the progress bar and the trackers report_to starts (writers.py, trackers.py).
:class:`LoggingArguments` is a base of vlmtrain.TrainingArguments (vlmtrain/compat/arguments.py, which also reads
report_to's names as transformers writes them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoggingArguments:
    """The arguments of the progress bar and the trackers (train.report_to, run_name, project, trackio_*)."""

    report_to: None | str | list[str] = "none"
    """Trackers besides metrics.jsonl (always written), as transformers names them: none, tensorboard, wandb,
    mlflow, trackio, a list of them, or all (every installed one). Each needs its extra (pip install
    -e '.[wandb]'); one that is missing or cannot start is a warning, and training goes on with the rest.
    A resumed run continues the same tracker run. The docs page Evaluation and tracking says where each one writes."""
    run_name: str | None = None
    """Name of the run in metrics writers and trackers; None: output_dir's basename."""
    project: str = "huggingface"
    """The tracker project the run goes to: wandb's project, MLflow's experiment, trackio's project (the
    WANDB_PROJECT and MLFLOW_EXPERIMENT_NAME environment variables win when set)."""
    trackio_space_id: str | None = None
    """trackio: also sync the run to this Hugging Face Space (e.g. 'user/space'); None: local only."""
    trackio_bucket_id: str | None = None
    """trackio: the Hugging Face Bucket a trackio_space_id Space stores its data in; None: trackio's default."""
    disable_tqdm: bool | None = False
    """Hide progress bars (None: false)."""

    def _resolve_logging(self) -> None:
        """Unset values -> what the loggers read (idempotent)."""
        self.disable_tqdm = bool(self.disable_tqdm)
