"""Inside the ranks: log to the launch's run from rank 0; every other rank does nothing.

The run comes from MLflow's variables set by the driver (``MLFLOW_RUN_ID``,
``MLFLOW_TRACKING_URI``). Without them (tracking off, or outside a launch) every call is a no-op,
so the training code is the same with and without tracking.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from sparktrain.contract import env


def _run() -> tuple[Any, str] | None:
    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id or env.contract_rank() != 0:
        return None
    import mlflow

    return mlflow.tracking.MlflowClient(os.environ.get("MLFLOW_TRACKING_URI")), run_id


def log_params(params: Mapping[str, Any], *, batch_size_per_rank: int | None = None) -> None:
    """Log parameters (rank 0 only); with ``batch_size_per_rank``, the effective batch size too."""
    found = _run()
    if found is None:
        return
    client, run_id = found
    values = dict(params)
    if batch_size_per_rank is not None:
        world = env.contract_world_size()
        values["batch_size_per_rank"] = batch_size_per_rank
        values["effective_batch_size"] = batch_size_per_rank * world
    for key, value in values.items():
        client.log_param(run_id, key, value)


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log metrics at ``step`` (rank 0 only: one copy per step, not one per rank)."""
    found = _run()
    if found is None:
        return
    from mlflow.entities import Metric

    client, run_id = found
    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
    client.log_batch(run_id, metrics=batch)


def log_model(model: Any, name: str = "model", **options: Any) -> str | None:
    """Log ``model`` unwrapped, loadable without a process group; call it on every rank.

    Sharded models (FSDP, ZeRO-3) are gathered first, which needs every rank; rank 0 logs.
    ``options`` go to ``mlflow.pytorch.log_model`` (pickle format unless you say otherwise).
    Pass ``input_example=`` (a few rows of the model's input, a tensor or an array) to record
    the model's signature: ``mlflow.pyfunc.spark_udf`` and model serving need it to turn a
    DataFrame's array column into the model's input.

    Returns:
        On rank 0 (tracking on), the logged model's URI; elsewhere ``None``.
    """
    from sparktrain.strategies import plain_module

    plain = plain_module(model)
    found = _run()
    if found is None:
        return None
    import mlflow

    options.setdefault("serialization_format", "pickle")
    example: Any = options.get("input_example")
    if hasattr(example, "detach"):  # MLflow takes numpy, not tensors
        options["input_example"] = example.detach().cpu().numpy()
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with mlflow.start_run(run_id=found[1]):
        info = mlflow.pytorch.log_model(plain.cpu(), name=name, **options)
    return str(info.model_uri)
