"""TorchEstimator's loop for real jobs, on the real local-cluster: validation and metrics, early
stopping, checkpoints that resume (a rank killed, the driver lost), Lightning, CrossValidator."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from torch import nn

from conftest import ROOT

pytestmark = pytest.mark.spark
pyspark = pytest.importorskip("pyspark")

from pyspark.ml.functions import array_to_vector, vector_to_array  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from sparktrain.spark import TorchEstimator  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _blobs(spark: Any, rows: int, seed: int = 0) -> Any:
    """Three classes of 4 features around their centres; ``is_val`` marks a quarter of the rows."""
    import pandas as pd

    g = np.random.default_rng(seed)
    label = g.integers(0, 3, rows)
    centres = np.array([[2, 0, 0, 0], [0, 2, 0, 0], [0, 0, 2, 0]], dtype=np.float32)
    x = centres[label] + g.standard_normal((rows, 4)).astype(np.float32)
    frame = pd.DataFrame({"x": list(x), "label": label.astype(float)})
    frame["is_val"] = np.arange(rows) % 4 == 0
    return spark.createDataFrame(frame).withColumn("features", array_to_vector("x")).drop("x")


def _local_rows(df: Any) -> tuple[torch.Tensor, torch.Tensor]:
    rows = df.select(vector_to_array("features").alias("f"), "label").collect()
    x = torch.tensor([r["f"] for r in rows], dtype=torch.float32)
    return x, torch.tensor([r["label"] for r in rows]).long()


def test_validation_metrics_equal_a_local_evaluation_of_the_returned_model(spark: Any) -> None:
    df = _blobs(spark, 600)
    estimator = TorchEstimator(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
        loss="cross_entropy", learningRate=0.05, epochs=3, batchSize=32, numProcesses=2,
        validation="is_val", metrics=["accuracy", "f1"], useGpu=False,
    )  # fmt: skip
    model = estimator.fit(df)
    last = model.history[-1]
    assert [r["epoch"] for r in model.history] == [0.0, 1.0, 2.0]
    assert set(last) == {"epoch", "loss", "accuracy", "f1", "val_loss", "val_accuracy", "val_f1"}
    x, y = _local_rows(df.filter("is_val"))
    with torch.no_grad():
        out = model.torch_model(x)
    assert last["val_loss"] == pytest.approx(float(nn.functional.cross_entropy(out, y)), rel=1e-5)
    assert last["val_accuracy"] == pytest.approx(float((out.argmax(1) == y).float().mean()))
    assert last["val_accuracy"] > 0.7  # learnt: chance is 1/3
    assert model.getHistory()["val_loss"] == [r["val_loss"] for r in model.history]


class _Ascent:
    """An epoch schedule: the learning rate as given for two epochs, then negated (the val loss
    climbs from epoch 2 on, so epoch 1 stays the best)."""

    def __call__(self, optimizer: Any) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 1.0 if e < 2 else -1.0)


def test_early_stopping_stops_at_the_expected_epoch_with_the_best_weights(spark: Any) -> None:
    df = _blobs(spark, 400).withColumn(
        "target", (vector_to_array("features")[0] * 2).cast("double")
    )
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 1), loss="mse", labelCol="target", epochs=10,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.02), batchSize=50, numProcesses=2,
        validation="is_val", lrSchedule=_Ascent(), earlyStoppingPatience=2, useGpu=False,
        shuffle=False,
    )  # fmt: skip
    model = estimator.fit(df)
    losses = [r["val_loss"] for r in model.history]
    assert len(losses) == 4, losses  # best at epoch 1, then 2 epochs without improvement
    assert losses[1] < losses[0] and losses[1] < losses[2] < losses[3]
    val = df.filter("is_val").select(vector_to_array("features").alias("f"), "target").collect()
    x = torch.tensor([r["f"] for r in val])
    with torch.no_grad():
        out = model.torch_model(x).squeeze(1)
    local = float(nn.functional.mse_loss(out, torch.tensor([r["target"] for r in val])))
    assert local == pytest.approx(losses[1], rel=1e-5)  # the best epoch's weights came back


class _Seen:
    """A callback that records (rank, epoch) in a folder and, once, kills rank 1 at an epoch."""

    def __init__(self, folder: Path, kill_at: int | None = None, hold_at: int | None = None):
        self.folder, self.kill_at, self.hold_at = str(folder), kill_at, hold_at

    def __call__(self, epoch: int, record: dict[str, float]) -> None:
        rank = int(os.environ["RANK"])
        Path(self.folder, f"r{rank}-e{epoch}-{time.monotonic_ns()}").touch()
        killed = Path(self.folder, "killed")
        if epoch == self.kill_at and rank == 1 and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if epoch == self.hold_at and rank == 0:
            Path(self.folder, "holding").touch()
            time.sleep(120)  # the driver is killed meanwhile


def _seen(folder: Path, rank: int, epoch: int) -> int:
    return len(list(folder.glob(f"r{rank}-e{epoch}-*")))


def test_a_rank_killed_mid_fit_resumes_from_the_last_checkpoint(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    df = _blobs(spark, 300)
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 3), loss="cross_entropy", epochs=3, batchSize=32,
        numProcesses=2, useGpu=False, callbacks=[_Seen(tmp_path, kill_at=1)], max_restarts=1,
    )  # fmt: skip
    model = estimator.fit(df)
    assert [r["epoch"] for r in model.history] == [0.0, 1.0, 2.0]  # each epoch once
    assert (tmp_path / "killed").exists()
    assert _seen(tmp_path, 0, 0) == 1  # epoch 0 was not trained again
    assert _seen(tmp_path, 0, 2) == 1
    assert "resumed from checkpoint" in capfd.readouterr().out


_DRIVER = """
import sys
sys.path[:0] = [{src!r}, {tests!r}]
import cloudpickle
from pyspark.sql import SparkSession
from torch import nn
import test_spark_fit as t
from sparktrain.spark import TorchEstimator
cloudpickle.register_pickle_by_value(t)
spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").getOrCreate())
df = spark.read.parquet({rows!r})
TorchEstimator(model=lambda: nn.Linear(4, 3), loss="cross_entropy", epochs=4, batchSize=32,
               numProcesses=2, localMode=True, useGpu=False, store={store!r}, runId="lost",
               callbacks=[t._Seen({seen!r}, hold_at=1)]).fit(df)
"""


def test_a_fit_that_loses_its_driver_resumes_with_the_same_run_id(
    spark: Any, tmp_path: Path
) -> None:
    rows, store, seen = str(tmp_path / "rows"), str(tmp_path / "store"), tmp_path / "seen"
    seen.mkdir()
    _blobs(spark, 200).write.parquet(rows)
    script = _DRIVER.format(
        src=str(ROOT / "src"),
        tests=str(Path(__file__).parent),
        rows=rows,
        store=store,
        seen=str(seen),
    )
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                              start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (seen / "holding").exists():
            assert driver.poll() is None and time.monotonic() < deadline, "the driver ended"
            time.sleep(0.5)
        driver.kill()  # the driver dies in the middle of epoch 1's end
        driver.wait(30)
    finally:
        os.killpg(driver.pid, signal.SIGKILL) if driver.poll() is None else None
    model = TorchEstimator(
        model=lambda: nn.Linear(4, 3), loss="cross_entropy", epochs=4, batchSize=32,
        numProcesses=2, localMode=True, useGpu=False, store=store, runId="lost",
        callbacks=[_Seen(seen)],
    ).fit(spark.read.parquet(rows))  # fmt: skip
    assert [r["epoch"] for r in model.history] == [0.0, 1.0, 2.0, 3.0]
    assert _seen(seen, 0, 0) == 1  # epoch 0 came from the checkpoint
    assert _seen(seen, 0, 3) == 1
    assert (Path(store) / "lost").is_dir()  # a named run keeps its checkpoints


class _KillMidEpoch:
    """A transformation that kills rank 1 at its ``at``-th batch, once (the reader runs it)."""

    def __init__(self, folder: Path, at: int) -> None:
        self.folder, self.at = str(folder), at

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        rank = int(os.environ["RANK"])
        count = Path(self.folder, f"batches-{rank}-{os.getpid()}")
        with open(count, "a") as handle:
            handle.write(".")
        killed = Path(self.folder, "killed")
        if rank == 1 and count.stat().st_size == self.at and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


def test_a_checkpoint_every_n_steps_resumes_inside_the_epoch(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    df = _blobs(spark, 320)  # 160 rows per rank: 10 batches of 16
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 3), loss="cross_entropy", epochs=2, batchSize=16,
        numProcesses=2, localMode=True, useGpu=False, checkpointEvery=4, shuffle=False,
        transformationFn=_KillMidEpoch(tmp_path, at=17), max_restarts=1,
    )  # fmt: skip
    model = estimator.fit(df)
    assert [r["epoch"] for r in model.history] == [0.0, 1.0]
    assert (tmp_path / "killed").exists()
    out = capfd.readouterr().out
    resumed = re.search(r"\[rank 0\] resumed from checkpoint step (\d+): epoch (\d)", out)
    assert resumed, out[-3000:]
    step, epoch = int(resumed.group(1)), int(resumed.group(2))
    assert step % 4 == 0 and step % 10 and step < 17  # inside an epoch: the reader reads ahead
    assert epoch == step // 10
    after = out.rsplit("resumed from checkpoint", 1)[1]
    assert after.count("] epoch 1 loss") == 2 and "(10 batches)" in after  # the epoch's batches


def test_a_nan_loss_names_the_rank_and_the_epoch(spark: Any) -> None:
    from sparktrain import TrainingFailedError

    df = _blobs(spark, 200).withColumn("label", F.lit(float("nan")))
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 1), loss="mse", epochs=2, batchSize=32, numProcesses=2,
        localMode=True, useGpu=False,
    )  # fmt: skip
    with pytest.raises(TrainingFailedError) as failed:
        estimator.fit(df)
    assert "the loss is nan at epoch 0, batch 0" in str(failed.value)
    assert "rank 0" in str(failed.value) or "rank 1" in str(failed.value)


class _Weighted(nn.Module):
    """Two outputs: the class logits and a regression of the first feature."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.value = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(x), self.value(x)


def test_several_outputs_with_loss_weights_and_sample_weights(spark: Any) -> None:
    df = (
        _blobs(spark, 300)
        .withColumn("first", vector_to_array("features")[0].cast("double"))
        .withColumn("w", F.when(F.col("label") == 0, 0.0).otherwise(1.0))
    )
    estimator = TorchEstimator(
        model=_Weighted, loss=["cross_entropy", "mse"], labelCols=["label", "first"],
        lossWeights=[1.0, 0.5], weightCol="w", metrics=["accuracy"], learningRate=0.05,
        epochs=4, batchSize=32, numProcesses=2, localMode=True, useGpu=False, validation=0.2,
    )  # fmt: skip
    model = estimator.fit(df)
    last = model.history[-1]
    assert {"label_accuracy", "first_accuracy", "val_label_accuracy"} <= set(last)
    x, y = _local_rows(df.filter("label != 0"))
    with torch.no_grad():
        classes = model.torch_model(x)[0].argmax(1)
    assert (classes == y).float().mean() > 0.8  # trained on the weighted rows
    assert model.getTask() == "raw"


def test_a_named_run_goes_on_at_another_world_size(spark: Any, tmp_path: Path) -> None:
    """A checkpoint saved by 2 ranks resumes on 1 (an elastic run's restart at another size)."""
    df = _blobs(spark, 200)
    first = TorchEstimator(
        model=lambda: nn.Linear(4, 3), loss="cross_entropy", epochs=2, batchSize=32,
        numProcesses=2, localMode=True, useGpu=False, store=str(tmp_path), runId="resized",
        validation="is_val", earlyStoppingPatience=5,
    )  # fmt: skip
    before = first.fit(df)
    after = first.copy({first.numProcesses: 1, first.epochs: 3}).fit(df)
    assert [r["epoch"] for r in after.history] == [0.0, 1.0, 2.0]
    assert list(after.history[:2]) == list(before.history)  # the first two came from the checkpoint
    again = first.copy({first.epochs: 3}).fit(df)  # finished: returns at once, same model
    assert again.history == after.history
    for a, b in zip(again.torch_model.parameters(), after.torch_model.parameters(), strict=True):
        assert torch.equal(a, b)


try:
    import lightning.pytorch as pl
except ImportError:  # the lightning extra; the test below is skipped without it
    pl = None


if pl is not None:

    class _Classifier(pl.LightningModule):
        """A LightningModule as Horovod's Lightning estimator takes it: dict batches."""

        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss = nn.functional.cross_entropy(self(batch["features"]), batch["label"].long())
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: dict[str, torch.Tensor], index: int) -> None:
            out = self(batch["features"])
            self.log("val_loss", nn.functional.cross_entropy(out, batch["label"].long()))
            self.log("val_acc", (out.argmax(1) == batch["label"].long()).float().mean())

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 2)]


@pytest.mark.skipif(pl is None, reason="needs lightning (the dev extras)")
def test_a_lightning_module_fits_and_transforms(spark: Any) -> None:
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator

    df = _blobs(spark, 400)
    estimator = TorchEstimator(
        model=_Classifier(), epochs=4, batchSize=32, numProcesses=2, validation="is_val",
        task="classification", useGpu=False, earlyStoppingPatience=3, monitor="val_acc",
    )  # fmt: skip
    model = estimator.fit(df)
    assert isinstance(model.torch_model, pl.LightningModule)
    history = model.getHistory()
    assert set(history) == {"loss", "train_loss", "val_loss", "val_acc"}
    assert history["val_loss"][-1] < history["val_loss"][0]
    x, y = _local_rows(df.filter("is_val"))
    with torch.no_grad():
        accuracy = float((model.torch_model(x).argmax(1) == y).float().mean())
    assert accuracy == pytest.approx(max(history["val_acc"]), abs=1e-5)  # the best epoch's
    scored = model.transform(df.filter("is_val"))
    assert MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored) > 0.7


def test_cross_validator_over_a_grid_with_early_stopping(spark: Any) -> None:
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    df = _blobs(spark, 300).drop("is_val")
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 3), loss="cross_entropy", epochs=30, batchSize=32,
        localMode=True, useGpu=False, validation=0.25, earlyStoppingPatience=2, minDelta=0.01,
    )  # fmt: skip
    grid = ParamGridBuilder().addGrid(estimator.learningRate, [1e-4, 0.1]).build()
    search = CrossValidator(
        estimator=estimator, estimatorParamMaps=grid, numFolds=2, seed=5,
        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
    )  # fmt: skip
    best = search.fit(df)
    assert best.avgMetrics[1] > best.avgMetrics[0] and best.avgMetrics[1] > 0.7
    assert len(best.bestModel.history) < 30  # stopped early


def test_the_loop_params_save_and_load(spark: Any, tmp_path: Path) -> None:
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 3), loss=["cross_entropy"], validation=0.2,
        metrics={"acc": "accuracy"}, callbacks=[_Seen(tmp_path)], lrSchedule=_Ascent(),
        earlyStoppingPatience=3, monitor="val_acc", labelCols=["label"], lossWeights=[2.0],
        weightCol="w", runId="saved", checkpointEvery=5, backwardPassesPerStep=2,
    )  # fmt: skip
    estimator.write().save(str(tmp_path / "estimator"))
    loaded = TorchEstimator.load(str(tmp_path / "estimator"))
    for name in ("validation", "earlyStoppingPatience", "monitor", "labelCols", "lossWeights",
                 "runId", "checkpointEvery", "backwardPassesPerStep", "weightCol"):  # fmt: skip
        assert loaded.getOrDefault(name) == estimator.getOrDefault(name), name
    assert isinstance(loaded.getOrDefault("lrSchedule"), _Ascent)
    assert list(loaded.getOrDefault("metrics")) == ["acc"]
    loaded.check_fit()


def test_the_folders_of_unnamed_fits_whose_caller_died_are_removed(
    spark: Any, tmp_path: Path
) -> None:
    from sparktrain.spark import fitdata

    dead = tmp_path / "fit-0123456789ab"
    dead.mkdir()
    subprocess.run(  # a caller that wrote its owner file, then died
        [sys.executable, "-c", "import sys; from sparktrain.data.cache import write_owner; "
         "write_owner(sys.argv[1])", str(dead)], check=True, env={**os.environ,
         "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    (tmp_path / "named").mkdir()
    estimator = TorchEstimator(model=lambda: nn.Linear(4, 3), loss="mse", store=str(tmp_path))
    folder = fitdata.run_folder(estimator, _blobs(spark, 10), None)
    assert folder.temporary and Path(folder.path).is_dir()
    assert not dead.exists() and (tmp_path / "named").is_dir()
    folder.remove()
    assert not Path(folder.path).exists()
