"""MLflow: through its client (no global active run, so the runs of a grid in one process
keep apart), to any tracking URI, by default an SQLite store beside the run folders."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedstale.server_app.tracking.base import Opening, Tracker

PARAMS_PER_BATCH = 100  # MLflow's limits on one log_batch
METRICS_PER_BATCH = 1000
PARAM_CHARS = 6000  # MLflow's limit on one parameter's value


class MlflowTracker(Tracker):
    name = "mlflow"
    package = "mlflow"

    def open(self, opening: Opening) -> str:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        runs = opening.folder.parent  # the default store beside the run folders
        uri = opening.uri or f"sqlite:///{runs / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        if opening.resume_id:
            self.run_id = opening.resume_id
            self.client.update_run(self.run_id, status="RUNNING")
            return self.run_id
        found = self.client.get_experiment_by_name(opening.experiment)
        files = artifacts_beside(uri)
        experiment = (
            found.experiment_id
            if found
            else self.client.create_experiment(opening.experiment, artifact_location=files)
        )
        run = self.client.create_run(
            experiment,
            start_time=int(opening.started * 1000),  # not when this thread got to it
            run_name=opening.name,
            tags=dict(opening.tags),
        )
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in sorted(opening.config.items())]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            batch = params[start : start + PARAMS_PER_BATCH]
            self.client.log_batch(
                self.run_id,
                params=batch,
                tags=[RunTag("folder", str(opening.folder))] if start == 0 else [],
            )
        return self.run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.log_many([(step, values)])

    def log_many(self, entries: Sequence[tuple[int, Mapping[str, float]]]) -> None:
        """Every waiting step in requests of at most METRICS_PER_BATCH metrics."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for step, values in entries for k, v in values.items()]
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + METRICS_PER_BATCH])

    def upload(self, folder: Path, files: Sequence[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def artifacts_beside(uri: str) -> str | None:
    """Where a new experiment keeps its files: beside an SQLite store (MLflow's own default
    is ./mlruns under the current folder), or where a tracking server says (None)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix) :]).parent / "mlartifacts").as_uri()
