"""The driver's side: create the run once, log the launch and its outcome.

Tracking is on with ``mlflow=True``, or automatically when the caller has an active MLflow run
(MLflow already imported and a run open). The tracking URI is ``MLFLOW_TRACKING_URI`` (or
whatever the caller set) and, when none is set, a SQLite store ``mlflow.db`` in the working
directory, which ``mlflow ui --backend-store-uri sqlite:///mlflow.db`` opens. A server that
cannot be reached turns tracking off with one warning (training goes on), unless
``mlflow_strict=True``. The ranks get the run through MLflow's own variables
(``MLFLOW_TRACKING_URI``, ``MLFLOW_RUN_ID``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sparktrain.ground.errors import ConfigError, TrainingFailedError
from sparktrain.launchplan.layout import LaunchPlan
from sparktrain.launchplan.options import RunOptions

#: While the driver probes the server: fail fast instead of MLflow's minutes of retries.
_PROBE_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def mlflow_module() -> Any:
    """MLflow, or a :class:`ConfigError` with the install hint."""
    try:
        import mlflow
    except ImportError:
        raise ConfigError("mlflow=True needs MLflow: pip install 'sparktrain[mlflow]'") from None
    return mlflow


@dataclass
class ChildRun:
    """Where this thread's next launch logs: under ``parent``, named, with ``params``.

    ``sparktrain.tune`` uses it to make each trial a child run of the search's run, also from
    worker threads, which MLflow's (thread-local) active run does not reach. ``run_id`` is filled
    in when the launch creates the run.
    """

    parent: str
    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    run_id: str | None = None


_linked = threading.local()


@contextlib.contextmanager
def child_of(child: ChildRun) -> Iterator[ChildRun]:
    """Launches of this thread inside the block track to ``child``'s run (tracking on)."""
    _linked.child = child
    try:
        yield child
    finally:
        _linked.child = None


def _caller_has_active_run() -> bool:
    mlflow = sys.modules.get("mlflow")
    return mlflow is not None and mlflow.active_run() is not None


def tracking_uri(mlflow: Any) -> str:
    """The tracking URI: the caller's, or ``./mlflow.db``."""
    if os.environ.get("MLFLOW_TRACKING_URI") or mlflow.is_tracking_uri_set():
        return str(mlflow.get_tracking_uri())
    return f"sqlite:///{os.path.abspath('mlflow.db')}"


@dataclass
class DriverRun:
    """The MLflow run of one launch, as the driver holds it."""

    mlflow: Any
    uri: str
    run_id: str
    started: float

    def rank_env(self) -> dict[str, str]:
        """The variables that hand the run to the ranks."""
        return {"MLFLOW_TRACKING_URI": self.uri, "MLFLOW_RUN_ID": self.run_id}

    def _client(self) -> Any:
        return self.mlflow.tracking.MlflowClient(self.uri)

    def attempt_started(self, plan: LaunchPlan, number: int) -> None:
        """Log the attempt's ``world_size`` at MLflow step ``number``: one run, every size."""
        try:
            self._client().log_metric(self.run_id, "world_size", plan.world_size, step=number)
        except Exception as exc:  # the server went away: the run goes on, as begin() decides
            warnings.warn(
                f"sparktrain: could not log world_size to MLflow ({type(exc).__name__}: {exc})",
                stacklevel=2,
            )

    def succeeded(self, attempts: int, rescales: Sequence[Any] = ()) -> None:
        """Log the outcome (and an elastic run's rescales) and close the run as FINISHED."""
        client = self._client()
        client.log_metric(self.run_id, "duration_s", time.time() - self.started)
        client.set_tag(self.run_id, "sparktrain.outcome", "succeeded")
        client.set_tag(self.run_id, "sparktrain.attempts", str(attempts))
        if rescales:
            client.set_tag(self.run_id, "sparktrain.rescales", str(len(rescales)))
            lines = "\n".join(r.describe() for r in rescales)
            client.log_text(self.run_id, lines + "\n", "sparktrain/rescales.txt")
        client.set_terminated(self.run_id, "FINISHED")

    def failed(self, error: BaseException) -> None:
        """Log the culprit and its error (tag and artifact) and close the run as FAILED."""
        client = self._client()
        client.log_metric(self.run_id, "duration_s", time.time() - self.started)
        client.set_tag(self.run_id, "sparktrain.outcome", type(error).__name__)
        cause = getattr(error, "cause", None)
        if isinstance(cause, str):
            client.set_tag(self.run_id, "sparktrain.cause", cause)
        if isinstance(error, TrainingFailedError):
            client.set_tag(self.run_id, "sparktrain.attempts", str(error.attempts))
            if error.culprit is not None:
                client.set_tag(self.run_id, "sparktrain.culprit_rank", str(error.culprit.rank))
                client.set_tag(self.run_id, "sparktrain.culprit_host", error.culprit.host)
                client.set_tag(self.run_id, "sparktrain.error", error.culprit.summary()[:4000])
        text = str(error) or "".join(traceback.format_exception_only(type(error), error))
        client.log_text(self.run_id, text, "sparktrain/error.txt")
        client.set_terminated(
            self.run_id, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        )


def begin(
    plan: LaunchPlan, options: RunOptions, backend: str, *, enabled: bool | None, strict: bool
) -> DriverRun | None:
    """Create the launch's run and log its parameters, or return ``None`` (tracking off)."""
    child: ChildRun | None = getattr(_linked, "child", None)
    if enabled is False or (enabled is None and not _caller_has_active_run() and not child):
        return None
    mlflow = mlflow_module()
    uri = tracking_uri(mlflow)
    saved = {k: os.environ.get(k) for k in _PROBE_ENV}
    os.environ.update(_PROBE_ENV)
    try:
        client = mlflow.tracking.MlflowClient(uri)
        parent = client.get_run(child.parent) if child else mlflow.active_run()
        experiment = parent.info.experiment_id if parent else experiment_id(client)
        tags = {"mlflow.parentRunId": parent.info.run_id} if parent else {}
        name = child.name if child else f"sparktrain-{backend}"
        run = client.create_run(experiment, tags=tags, run_name=name)
        params = {
            "world_size": plan.world_size,
            "processes_per_node": plan.procs_per_node,
            "nodes": plan.nodes,
            "backend": backend,
            "device": plan.device,
            "dist_backend": plan.dist_backend,
            "max_restarts": options.recovery.max_restarts,
            "hang_timeout": options.limits.hang_timeout,
        }
        params.update(child.params if child else {})
        for key, value in params.items():
            client.log_param(run.info.run_id, key, value)
        if child:
            child.run_id = run.info.run_id
    except Exception as exc:
        if strict:
            raise ConfigError(f"MLflow tracking at {uri} failed: {exc}") from exc
        warnings.warn(
            f"sparktrain: MLflow tracking is off for this run: {uri} could not be used "
            f"({type(exc).__name__}: {str(exc)[:300]}). Training goes on; pass "
            "mlflow_strict=True to stop instead.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return DriverRun(mlflow=mlflow, uri=uri, run_id=run.info.run_id, started=time.time())


def experiment_id(client: Any) -> str:
    """The experiment named by MLflow's variables (default ``0``)."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return str(os.environ.get("MLFLOW_EXPERIMENT_ID") or "0")
    found = client.get_experiment_by_name(name)
    return str(found.experiment_id if found else client.create_experiment(name))
