"""MLflow writer (pip install 'vlmtrain[mlflow]': mlflow-skinny with SQLAlchemy for a sqlite store)."""

from __future__ import annotations

import os
import time

from .tracker import TrackerCallback

_PARAM_BATCH = 100  # MLflow's limit of params per log_batch call
_PARAM_CHARS = 6000  # MLflow's limit of a param value's length


class MLflowCallback(TrackerCallback):
    """Logs every row's metrics at the row's step to an MLflow run (through MlflowClient: no global active
    run is touched). Store: MLFLOW_TRACKING_URI when set, else `sqlite:///<output_dir>/mlflow.db` (browse it
    with `mlflow ui --backend-store-uri sqlite:///<output_dir>/mlflow.db`). Experiment: MLFLOW_EXPERIMENT_NAME,
    else train.project; run name: train.run_name; the TrainingArguments are the run's params. A resumed run
    logs to the same run_id."""

    name = "mlflow"
    requires = "mlflow"
    hint = ("Check MLFLOW_TRACKING_URI (unset, runs go to sqlite:///<output_dir>/mlflow.db) and that the "
            "tracking server is reachable.")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.client = None

    def tracking_uri(self) -> str:
        return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(self.output_dir)}/mlflow.db"

    def start(self, run_id: str | None) -> str:
        from mlflow.tracking import MlflowClient

        uri = self.tracking_uri()
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(uri[len("sqlite:///"):]) or ".", exist_ok=True)
        self.client = MlflowClient(uri)
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        run = self.client.create_run(self._experiment_id(), run_name=self.run_name)
        self._log_params(run.info.run_id)
        return run.info.run_id

    def _experiment_id(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.project
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        # artifacts beside the sqlite store, not in ./mlruns of whatever directory training started in
        artifacts = None if "MLFLOW_TRACKING_URI" in os.environ else os.path.abspath(
            os.path.join(self.output_dir, "mlflow-artifacts"))
        return self.client.create_experiment(name, artifact_location=artifacts)

    def _log_params(self, run_id: str) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:_PARAM_CHARS]) for k, v in sorted(self.config.items())]
        for i in range(0, len(params), _PARAM_BATCH):
            self.client.log_batch(run_id, params=params[i:i + _PARAM_BATCH])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
