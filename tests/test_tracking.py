"""MLflow tracking against a real server on loopback and the default local store."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sparktrain
from sparktrain import TorchDistributor, TrainingFailedError, launch

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def _isolated_tracking_uri(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow.set_tracking_uri writes a module global and MLFLOW_TRACKING_URI: undo both."""
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def tracked_train(steps: int, strategy: str) -> float:
    """Every rank calls the logging API; only rank 0's calls reach MLflow."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = sparktrain.prepare_model(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), strategy
    )
    optimizer = sparktrain.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=0.05), model)
    sparktrain.log_params({"lr": 0.05}, batch_size_per_rank=16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=g)
    y = (x[:, 0] > 0).long()
    for step in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        sparktrain.backward(loss, optimizer)
        optimizer.step()
        sparktrain.log_metrics({"loss": loss.item()}, step=step)
    sparktrain.log_model(model, "model")
    return loss.item()


class _Recording(nn.Sequential):
    """Counts the moves of the module itself: .cpu(), .to() and .cuda() all go through _apply."""

    moves = 0

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.moves += 1
        return super()._apply(fn, recurse)


def train_logging_midway(steps: int) -> dict[str, Any]:
    """A DDP loop that logs its model halfway; what happened to the module being trained."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    inner = _Recording(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    model = sparktrain.prepare_model(inner, "ddp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    params = list(inner.parameters())
    where = [(p.data_ptr(), p.device) for p in params]
    moves, losses, snapshot, uri = inner.moves, [], None, None
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    y = (x[:, 0] > 0).long()
    for step in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == steps // 2:
            uri = sparktrain.log_model(model, "midway")
            snapshot = inner[0].weight.detach().clone()
    return {
        "same_module": model.module is inner,
        "same_params": all(a is b for a, b in zip(inner.parameters(), params, strict=True)),
        "optimizer_params": all(
            a is b for a, b in zip(optimizer.param_groups[0]["params"], params, strict=True)
        ),
        "where": [(p.data_ptr(), p.device) for p in params] == where,
        "moves": inner.moves - moves,
        "losses": losses,
        "snapshot": snapshot,
        "uri": uri,
    }


def test_logging_midway_leaves_the_training_module_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """log_model in the middle of a 2-rank DDP loop logs a CPU copy: the module being trained is
    not moved (no .cpu()/.to() on it), keeps its parameter objects and their storage, and goes
    on training; the logged model holds the weights of that moment."""
    monkeypatch.chdir(tmp_path)
    steps = 12
    result = launch(
        train_logging_midway, (steps,), num_processes=2, use_gpu=False, mlflow=True,
        return_all=True,
    )  # fmt: skip
    rank0 = result.return_values[0]
    assert rank0["moves"] == 0 and rank0["same_module"] and rank0["same_params"]
    assert rank0["optimizer_params"] and rank0["where"]
    assert rank0["losses"][-1] < rank0["losses"][steps // 2] < rank0["losses"][0]
    assert result.return_values[1]["uri"] is None  # rank 1 logs nothing
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = mlflow.pytorch.load_model(rank0["uri"])
    assert type(logged) is _Recording and logged[0].weight.device.type == "cpu"
    assert torch.equal(logged[0].weight, rank0["snapshot"])


def _only_run(client: object, experiment: str = "0") -> object:
    runs = client.search_runs([experiment])  # type: ignore[attr-defined]
    assert len(runs) == 1
    return runs[0]


def _check_run(uri: str, steps: int) -> object:
    client = mlflow.tracking.MlflowClient(uri)
    run = _only_run(client)
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["world_size"] == "2" and params["backend"] in ("local", "spark")
    assert params["strategy"] in ("ddp", "fsdp") and params["effective_batch_size"] == "32"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(steps))  # one copy per step, not two
    assert run.data.tags["sparktrain.outcome"] == "succeeded"
    return run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_one_run_with_metrics_and_a_loadable_model(
    mlflow_server: str, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    experiment = f"test-{strategy}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    launch(tracked_train, (5, strategy), num_processes=2, use_gpu=False, mlflow=True)
    client = mlflow.tracking.MlflowClient(mlflow_server)
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params["strategy"] == strategy
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(5))
    mlflow.set_tracking_uri(mlflow_server)
    logged = mlflow.search_logged_models(experiment_ids=[found.experiment_id], output_format="list")
    model = mlflow.pytorch.load_model(logged[0].model_uri)
    assert type(model) is nn.Sequential  # unwrapped: loads without a process group
    assert model(torch.randn(3, 8)).shape == (3, 2)


def test_default_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    TorchDistributor(2, True, False, mlflow=True).run(tracked_train, 3, "ddp")
    assert (tmp_path / "mlflow.db").exists()
    _check_run(f"sqlite:///{tmp_path / 'mlflow.db'}", 3)


def _fails_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("diverged")


def test_failed_run_records_the_culprit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(TrainingFailedError):
        launch(_fails_on_rank_one, num_processes=2, use_gpu=False, mlflow=True)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = _only_run(mlflow.tracking.MlflowClient(uri))
    assert run.info.status == "FAILED"
    assert run.data.tags["sparktrain.culprit_rank"] == "1"
    assert "ValueError: diverged" in run.data.tags["sparktrain.error"]
    text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/sparktrain/error.txt")
    assert "rank 1" in text and "diverged" in text


def test_unreachable_server_does_not_stop_training(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = launch(tracked_train, (3, "ddp"), num_processes=2, use_gpu=False, mlflow=True).value
    assert loss < 1.0
    messages = [str(w.message) for w in caught if "MLflow tracking is off" in str(w.message)]
    assert len(messages) == 1
    with pytest.raises(sparktrain.ConfigError, match="MLflow tracking at http"):
        launch(
            tracked_train,
            (1, "ddp"),
            num_processes=2,
            use_gpu=False,
            mlflow=True,
            mlflow_strict=True,
        )


def test_nested_under_the_callers_active_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'parent.db'}"
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run() as parent:
        launch(tracked_train, (2, "ddp"), num_processes=2, use_gpu=False)  # automatic
    runs = mlflow.tracking.MlflowClient(uri).search_runs(["0"])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 1 and children[0].data.params["world_size"] == "2"


def test_an_elastic_run_is_one_run_with_its_world_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_elastic import elastic_train, write_rows

    monkeypatch.chdir(tmp_path)
    cluster = sparktrain.LocalCluster(nodes=2)

    def lose_node_1(rank: int, record: dict) -> None:
        if rank == 0 and record.get("step") == 7 and (record.get("metrics") or {})["world"] == 2:
            cluster.kill_node(1)

    logs = tmp_path / "logs"
    logs.mkdir()
    args = (write_rows(tmp_path / "data", rows=80), str(tmp_path / "ckpt"), str(logs), 0.1)
    result = launch(
        elastic_train, args, num_processes=2, backend=cluster, min_processes=1, mlflow=True,
        on_report=lose_node_1,
    )  # fmt: skip
    assert [(r.old_world_size, r.new_world_size) for r in result.rescales] == [(2, 1)]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = _only_run(client)  # one run across the rescale
    assert run.info.status == "FINISHED" and run.data.tags["sparktrain.rescales"] == "1"
    sizes = client.get_metric_history(run.info.run_id, "world_size")
    assert sorted((m.step, m.value) for m in sizes) == [(0, 2.0), (1, 1.0)]
    text = mlflow.artifacts.load_text(f"{run.info.artifact_uri}/sparktrain/rescales.txt")
    assert "lost node 1" in text and "resumed on 1 rank(s) (was 2) from checkpoint step 5" in text
