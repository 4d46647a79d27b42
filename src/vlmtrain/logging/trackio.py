"""trackio writer (pip install 'vlmtrain[trackio]'): a local sqlite database per project in trackio's
directory (TRACKIO_DIR, default ~/.cache/huggingface/trackio), where `trackio show` finds it."""

from __future__ import annotations

from typing import Any

from .tracker import TrackerCallback


class TrackioCallback(TrackerCallback):
    """Logs every row's metrics at the row's step to the trackio run `train.run_name` of project
    `train.project`; with train.trackio_space_id (and trackio_bucket_id) trackio also syncs to that Hugging
    Face Space. A resumed run continues the run of the same name (resume="allow")."""

    name = "trackio"
    requires = "trackio"
    hint = "Check TRACKIO_DIR is writable, and train.trackio_space_id (and your Hugging Face login) if set."

    def __init__(self, *args, space_id: str | None = None, bucket_id: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.space_id, self.bucket_id = space_id, bucket_id
        self.run = None

    @classmethod
    def from_args(cls, args: Any) -> TrackioCallback:
        tracker = super().from_args(args)
        tracker.space_id, tracker.bucket_id = args.trackio_space_id, args.trackio_bucket_id
        return tracker

    def start(self, run_id: str | None) -> str:
        import trackio

        self.run = trackio.init(project=self.project, name=run_id or self.run_name, space_id=self.space_id,
                                bucket_id=self.bucket_id, config=self.config,
                                resume="allow" if run_id else "never")
        return self.run.name

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        import trackio

        trackio.finish()  # (also clears trackio's current run)
        self.run = None
