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
from sparktrain.ground.errors import ConfigError


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
    What is logged is a copy on the CPU: ``model`` stays where it is, with the same parameters,
    so logging in the middle of training does not move the model being trained.
    ``options`` go to ``mlflow.pytorch.log_model`` (pickle format unless you say otherwise).
    Pass ``input_example=`` (a few rows of the model's input, a tensor or an array) to record
    the model's signature: ``mlflow.pyfunc.spark_udf`` and model serving need it to turn a
    DataFrame's array column into the model's input.

    Returns:
        On rank 0 (tracking on), the logged model's URI; elsewhere ``None``.
    """
    from sparktrain.strategies.unwrap import plain_module

    plain = plain_module(model)
    found = _run()
    if found is None:
        return None
    import mlflow

    options.setdefault("serialization_format", "pickle")
    example: Any = options.get("input_example")
    if hasattr(example, "detach"):  # MLflow takes numpy, not tensors
        options["input_example"] = example.detach().cpu().numpy()
    logged = cpu_copy(plain) if _is_live(plain, model) else plain  # rebuilt: a CPU copy already
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    with mlflow.start_run(run_id=found[1]):
        info = mlflow.pytorch.log_model(logged, name=name, **options)
    return str(info.model_uri)


def _is_live(plain: Any, model: Any) -> bool:
    """Whether ``plain`` is (part of) the module being trained: it shares a parameter with it."""
    if plain is model:
        return True
    training = {id(p) for p in model.parameters()} if hasattr(model, "parameters") else set()
    return any(id(p) in training for p in plain.parameters())


def cpu_copy(module: Any) -> Any:
    """A copy of ``module`` on the CPU; ``module`` itself, its parameters and buffers untouched.

    Each parameter and buffer is copied straight to the CPU (no second copy on the GPU), then the
    module is deep-copied around them, so the copy holds no tensor of the original.

    Raises:
        ConfigError: The module cannot be deep-copied; names what stopped it and the fix.
    """
    import copy

    import torch

    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        data = tensor.detach().to("cpu", copy=True)
        if isinstance(tensor, torch.nn.Parameter):
            data = torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = data
    try:
        return copy.deepcopy(module, memo)
    except Exception as exc:
        raise ConfigError(
            f"log_model cannot copy the {type(module).__name__} to log it ({type(exc).__name__}: "
            f"{exc}); it copies the model so that the one training stays where it is. Keep what "
            "cannot be copied (process groups, open files) out of the module's attributes."
        ) from exc
