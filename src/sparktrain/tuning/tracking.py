"""A search in MLflow: one run for the search, one child run per trial (its launch's run)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sparktrain.driver import tracking as driver
from sparktrain.tuning.results import TrialRecord, TuneResult


@dataclass
class SearchRun:
    """The search's MLflow run; trials' launches nest under it."""

    client: Any
    run_id: str
    metric: str

    @classmethod
    def begin(
        cls, enabled: bool | None, name: str, *, num_trials: int, metric: str, mode: str,
        scheduler: Any,
    ) -> SearchRun | None:  # fmt: skip
        """Open the search's run (nested under the caller's active run), or ``None``."""
        mlflow = sys.modules.get("mlflow")
        active = mlflow is not None and mlflow.active_run() is not None
        if enabled is False or (enabled is None and not active):
            return None
        mlflow = driver.mlflow_module()
        client = mlflow.tracking.MlflowClient(driver.tracking_uri(mlflow))
        parent = mlflow.active_run()
        experiment = parent.info.experiment_id if parent else driver.experiment_id(client)
        tags = {"mlflow.parentRunId": parent.info.run_id} if parent else {}
        run = client.create_run(experiment, tags=tags, run_name=name)
        scheduler_name = (
            str(scheduler) if scheduler is None or isinstance(scheduler, str)
            else type(scheduler).__name__
        )  # fmt: skip
        params = {"num_trials": num_trials, "metric": metric, "mode": mode,
                  "scheduler": scheduler_name}  # fmt: skip
        for key, value in params.items():
            client.log_param(run.info.run_id, key, value)
        return cls(client, run.info.run_id, metric)

    @contextlib.contextmanager
    def child(self, number: int, config: dict[str, Any]) -> Iterator[driver.ChildRun]:
        """Launches in the block create the trial's child run, with ``config`` as params."""
        with driver.child_of(driver.ChildRun(self.run_id, f"trial-{number}", config)) as child:
            yield child

    def trial_done(self, record: TrialRecord, run_id: str | None) -> None:
        """Log the trial's outcome on its run."""
        if run_id is None:
            return
        self.client.set_tag(run_id, "sparktrain.trial_state", record.state)
        if record.value is not None:
            self.client.log_metric(run_id, self.metric, record.value)

    def end(self, result: TuneResult | None, error: BaseException | None) -> None:
        """Log the best trial and close the search's run."""
        if result is not None and result.best is not None:
            best = result.best
            self.client.log_metric(self.run_id, f"best_{self.metric}", best.value)
            self.client.set_tag(self.run_id, "sparktrain.best_trial", str(best.number))
            for key, value in best.config.items():
                self.client.log_param(self.run_id, f"best.{key}", value)
        status = "FINISHED" if error is None else (
            "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        )  # fmt: skip
        self.client.set_terminated(self.run_id, status)
