"""``sparktrain.tune``: distributed trials, early stopping, failures, MLflow, resuming."""

from __future__ import annotations

import _thread
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import sparktrain
from sparktrain import ConfigError
from sparktrain.tuning import choice, loguniform, uniform


def _fit(config: dict[str, Any]) -> float:
    """A 2-rank DDP regression; reports the loss every epoch, like the seeds' loops."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    x = torch.linspace(-1, 1, 64).unsqueeze(1)
    y = 3 * x + 0.5
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    marker = config.get("marker")
    if marker and dist.get_rank() == 0:
        Path(marker, f"started-{os.getpid()}").touch()
    loss = torch.tensor(0.0)
    for epoch in range(1, config["epochs"] + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(config.get("pause", 0.06))  # slower than report coalescing: every epoch
        sparktrain.report(step=epoch, loss=loss.item())
    if config.get("fail") and dist.get_rank() == 1:
        raise ValueError("trial failed on rank 1")
    return float(loss.item())


def test_search_prunes_weak_trials_and_finds_a_good_one() -> None:
    result = sparktrain.tune(
        _fit,
        {"lr": loguniform(1e-3, 1.0), "epochs": 9},
        num_trials=8,
        metric="loss",
        num_processes_per_trial=2,
        seed=0,
    )
    assert len(result.trials) == 8
    early = [t for t in result.trials if t.state == "pruned" and (t.step or 9) < 9]
    assert len(early) >= 3, result.table()  # at least a third stopped before their end
    assert result.best is not None and result.best.state == "complete"
    values = [t.value for t in result.trials if t.value is not None and not math.isnan(t.value)]
    assert result.best.value < sorted(values)[len(values) // 2]  # beats the median
    assert result.best_config == {"lr": result.best.config["lr"], "epochs": 9}
    assert "trial" in result.table().splitlines()[0]


def _slow_to_stop(config: dict[str, Any]) -> float:
    """Reports on after SIGTERM, as ranks on a slow backend do while they are being stopped."""
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for step in range(1, 40):
        time.sleep(0.08)  # slower than report coalescing
        sparktrain.report(step=step, score=config["x"] * step)
    return config["x"] * 40


def test_a_pruned_trial_stays_pruned_while_its_ranks_stop() -> None:
    import optuna

    class AtStep3(optuna.pruners.BasePruner):  # a rung judged once: later steps are not pruned
        def prune(self, study: Any, trial: Any) -> bool:
            return trial.last_step == 3

    result = sparktrain.tune(
        _slow_to_stop,
        {"x": uniform(0.0, 1.0)},
        num_trials=1,
        metric="score",
        mode="max",
        num_processes_per_trial=2,
        scheduler=AtStep3(),
        stop_grace=1.0,
        seed=0,
    )
    (trial,) = result.trials
    assert (trial.state, trial.step) == ("pruned", 3), result.table()


def test_a_failing_trial_is_recorded_and_the_search_goes_on() -> None:
    result = sparktrain.tune(
        _fit,
        {"lr": uniform(0.1, 0.5), "fail": [True, False], "epochs": 2, "pause": 0.0},
        num_trials=4,
        metric="loss",
        num_processes_per_trial=2,
        scheduler=None,
        seed=1,
    )
    failed = [t for t in result.trials if t.state == "failed"]
    complete = [t for t in result.trials if t.state == "complete"]
    assert len(failed) + len(complete) == 4
    assert all(t.config["fail"] for t in failed) and not any(t.config["fail"] for t in complete)
    assert failed and "rank 1" in (failed[0].error or "")


def test_concurrent_trials_with_median_stopping() -> None:
    result = sparktrain.tune(
        _fit,
        {"lr": choice([0.001, 0.3, 0.6, 0.002]), "epochs": 4},
        num_trials=4,
        metric="loss",
        max_concurrent_trials=2,
        scheduler="median",
        seed=0,
    )
    assert len(result.trials) == 4
    assert result.best is not None and result.best.config["lr"] >= 0.3


def test_interrupted_search_resumes(tmp_path: Path) -> None:
    storage = str(tmp_path / "study.db")
    marker = tmp_path / "markers"
    marker.mkdir()
    space = {"lr": loguniform(1e-2, 1.0), "epochs": 20, "marker": str(marker)}

    def interrupt_at_third_trial() -> None:
        while len(list(marker.iterdir())) < 3:
            time.sleep(0.05)
        time.sleep(0.3)  # mid-trial
        _thread.interrupt_main()

    watcher = threading.Thread(target=interrupt_at_third_trial, daemon=True)
    watcher.start()
    with pytest.raises(KeyboardInterrupt):
        sparktrain.tune(
            _fit, space, num_trials=5, metric="loss", storage=storage, scheduler=None, seed=0
        )
    watcher.join()
    result = sparktrain.tune(
        _fit, space, num_trials=5, metric="loss", storage=storage, scheduler=None, seed=0
    )
    interrupted = [t for t in result.trials if t.state == "interrupted"]
    finished = [t for t in result.trials if t.state != "interrupted"]
    assert len(interrupted) == 1 and len(finished) == 5
    assert [t.number for t in finished[:2]] == [0, 1]  # kept from the first session
    retried = [t for t in finished if t.config["lr"] == interrupted[0].config["lr"]]
    assert retried and retried[0].number > interrupted[0].number


def test_each_trial_is_an_mlflow_child_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import _tracking_service

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(_tracking_service.utils, "_tracking_uri", None)
    result = sparktrain.tune(
        _fit,
        {"lr": uniform(0.1, 0.5), "epochs": 2, "pause": 0.0},
        num_trials=2,
        metric="loss",
        scheduler=None,
        mlflow=True,
        study_name="mlflow-search",
    )
    client = mlflow.tracking.MlflowClient(uri)
    runs = client.search_runs(["0"])
    parent = next(r for r in runs if r.info.run_name == "mlflow-search")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["trial-0", "trial-1"]
    for child in children:
        number = int(child.info.run_name.split("-")[1])
        trial = next(t for t in result.trials if t.number == number)
        assert float(child.data.params["lr"]) == pytest.approx(trial.config["lr"])
        assert child.data.metrics["loss"] == pytest.approx(trial.value)
        assert child.data.tags["sparktrain.trial_state"] == "complete"
        assert child.data.params["hang_timeout"] == "600.0"  # trials are watched by default
    assert parent.data.metrics["best_loss"] == pytest.approx(result.best_value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_trials": 0}, "num_trials=0"),
        ({"mode": "minimize"}, "mode='minimize'"),
        ({"scheduler": "bogus"}, "scheduler='bogus'"),
        ({"storage": "study.txt"}, "storage='study.txt'"),
        ({"search_space": {}}, "search_space"),
        ({"search_space": {"lr": 0.1}}, "only constants"),
    ],
)
def test_bad_input_names_the_value(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"search_space": {"lr": uniform(0.1, 0.2)}, "num_trials": 1}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        sparktrain.tune(_fit, args.pop("search_space"), metric="loss", **args)


def test_space_helpers_check_their_bounds() -> None:
    with pytest.raises(ConfigError, match="low > 0"):
        loguniform(0, 1)
    with pytest.raises(ConfigError, match="low < high"):
        uniform(2, 1)
    with pytest.raises(ConfigError, match="non-empty list"):
        choice([])


@pytest.mark.spark
def test_trials_on_spark(spark: object) -> None:
    import cloudpickle
    import optuna

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result = sparktrain.tune(
        _fit,
        {"lr": choice([0.05, 0.4]), "epochs": 3},
        num_trials=2,
        metric="loss",
        num_processes_per_trial=2,
        scheduler=None,
        sampler=optuna.samplers.GridSampler({"lr": [0.05, 0.4]}),
        backend="spark",
    )
    assert [t.state for t in result.trials] == ["complete", "complete"]
    assert result.best_config is not None and result.best_config["lr"] == 0.4


def test_missing_optuna_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'sparktrain\[tune\]'"):
        sparktrain.tune(_fit, {"lr": uniform(0.1, 0.2)}, num_trials=1, metric="loss")
