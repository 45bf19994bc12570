"""Spark ML and batch inference on the real local-cluster: TorchEstimator, TorchModel, predict."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from torch import nn

from conftest import EXAMPLES
from sparktrain import ConfigError

pytestmark = pytest.mark.spark
pyspark = pytest.importorskip("pyspark")

from pyspark.ml import Pipeline, PipelineModel  # noqa: E402
from pyspark.ml.evaluation import MulticlassClassificationEvaluator  # noqa: E402
from pyspark.ml.feature import VectorAssembler  # noqa: E402
from pyspark.ml.functions import vector_to_array  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from sparktrain.spark import TorchEstimator, TorchModel, inference, predict  # noqa: E402

# Executors have neither tests/ nor examples/ on their path: ship these by value, as a
# notebook's classes are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
sys.path.insert(0, str(EXAMPLES))
import train_mlp  # noqa: E402

cloudpickle.register_pickle_by_value(train_mlp)

FEATURES = [f"f{i}" for i in range(784)]


def classification_rows(rows: int, seed: int) -> Any:
    """A pandas frame: 784 features around one of 10 class centres, and the class as label."""
    import pandas as pd

    centres = np.random.default_rng(0).normal(scale=0.12, size=(10, 784)).astype(np.float32)
    g = np.random.default_rng(seed)
    label = g.integers(0, 10, rows)
    x = centres[label] + g.standard_normal((rows, 784), dtype=np.float32)
    frame = pd.DataFrame(x, columns=FEATURES)
    frame["label"] = label.astype(float)
    return frame


@pytest.fixture(scope="module")
def fitted(spark: Any) -> Iterator[tuple[Any, Any, Any]]:
    """The seeds' MLP fitted in a Pipeline on 2 executors: (pipeline model, train, held-out)."""
    train = spark.createDataFrame(classification_rows(4096, 1))
    test = spark.createDataFrame(classification_rows(1024, 2))
    estimator = TorchEstimator(
        model=train_mlp.make_model(), loss="cross_entropy", epochs=2, batchSize=64,
        numProcesses=2, learningRate=1e-3, useGpu=False,
    )  # fmt: skip
    pipeline = Pipeline(
        stages=[VectorAssembler(inputCols=FEATURES, outputCol="features"), estimator]
    )
    yield pipeline.fit(train), train, test


def test_pipeline_fits_the_seeds_mlp_far_above_chance(fitted: tuple[Any, Any, Any]) -> None:
    model, _, test = fitted
    scored = model.transform(test)
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
    assert accuracy > 0.8  # chance is 0.1
    torch_stage = model.stages[-1]
    assert isinstance(torch_stage, TorchModel)
    assert scored.columns[-3:] == ["prediction", "rawPrediction", "probability"]
    losses = [epoch["loss"] for epoch in torch_stage.history]
    assert len(losses) == 2 and losses[1] < losses[0]
    # the predictions are the trained module's own, computed here for comparison
    rows = scored.select("features", "rawPrediction", "probability", "prediction").collect()
    x = torch.tensor(np.array([r.features.toArray() for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        logits = torch_stage.torch_model(x)
    raw = torch.tensor(np.array([r.rawPrediction.toArray() for r in rows]), dtype=torch.float32)
    assert torch.allclose(raw, logits, atol=1e-4)
    probability = np.array([r.probability.toArray() for r in rows])
    assert np.allclose(probability.sum(axis=1), 1.0, atol=1e-5)
    assert [r.prediction for r in rows] == logits.argmax(dim=1).double().tolist()


def test_saved_and_loaded_pipeline_predicts_the_same(
    fitted: tuple[Any, Any, Any], tmp_path: Path
) -> None:
    model, _, test = fitted
    model.write().save(str(tmp_path / "pipeline"))
    loaded = PipelineModel.load(str(tmp_path / "pipeline"))
    assert loaded.stages[-1].uid == model.stages[-1].uid
    assert loaded.stages[-1].getTask() == "classification"

    def raw(m: Any) -> Any:
        ordered = m.transform(test.withColumn("id", F.monotonically_increasing_id()))
        return np.array(
            [r[0].toArray() for r in ordered.orderBy("id").select("rawPrediction").collect()]
        )

    assert np.array_equal(raw(model), raw(loaded))
    with pytest.raises(Exception, match="already exists"):
        model.write().save(str(tmp_path / "pipeline"))
    model.stages[-1].write().overwrite().save(str(tmp_path / "stage"))
    model.stages[-1].write().overwrite().save(str(tmp_path / "stage"))  # overwrite works
    again = TorchModel.load(str(tmp_path / "stage"))
    assert again.history == model.stages[-1].history


def test_transform_with_more_partitions_than_executors(fitted: tuple[Any, Any, Any]) -> None:
    model, _, test = fitted
    stage = model.stages[-1]
    spread = model.stages[0].transform(test).repartition(7)
    assert spread.rdd.getNumPartitions() == 7  # two executors
    rows = stage.transform(spread).select("features", "prediction").collect()
    assert len(rows) == 1024
    x = torch.tensor(np.array([r.features.toArray() for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        expected = stage.torch_model(x).argmax(dim=1).double().tolist()
    assert [r.prediction for r in rows] == expected


def test_vectors_read_back_from_parquet_are_scored(
    fitted: tuple[Any, Any, Any], tmp_path: Path
) -> None:
    """Spark 4.3's columnar UDF input fails on ML vectors read from Parquet; transform does not."""
    model, _, test = fitted
    assembled = (
        model.stages[0]
        .transform(test)
        .select(F.monotonically_increasing_id().alias("id"), "features", "label")
    )  # few columns: Spark reads them as columnar batches
    assembled.write.parquet(str(tmp_path / "assembled"))
    stored = assembled.sparkSession.read.parquet(str(tmp_path / "assembled"))
    stage = model.stages[-1]

    def predictions(frame: Any) -> list[float]:
        return [r.prediction for r in stage.transform(frame).orderBy("id").collect()]

    assert predictions(stored) == predictions(assembled)


class CountedLoads(nn.Module):
    """A model that appends its process id to a file each time it is unpickled (loaded)."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.log = log
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        with open(state["log"], "a") as out:
            out.write(f"{os.getpid()}\n")


def _arrays(spark: Any, rows: int, partitions: int) -> Any:
    columns = [F.rand(i).cast("float") for i in range(4)]
    return spark.range(0, rows, 1, partitions).select("id", F.array(*columns).alias("features"))


def test_the_model_is_loaded_once_per_python_worker(spark: Any, tmp_path: Path) -> None:
    log = tmp_path / "loads.txt"
    model = TorchModel(CountedLoads(str(log)), task="raw")
    df = _arrays(spark, 4000, 8)
    for _ in range(2):  # two jobs of 8 tasks each, on 2 executors
        assert model.transform(df).count() == 4000 and len(model.transform(df).collect()) == 4000
    loads = log.read_text().split()
    assert len(loads) == len(set(loads)), f"a worker loaded the model twice: {loads}"
    assert 1 <= len(loads) <= 4  # far fewer loads than the 16 tasks


def test_a_null_or_uneven_row_is_named(spark: Any) -> None:
    model = nn.Linear(3, 2)
    rows = [(i, None if i == 3 else [1.0, 2.0, 3.0]) for i in range(6)]
    df = spark.createDataFrame(rows, "id long, features array<float>").coalesce(1)
    with pytest.raises(Exception, match=r"column 'features' is null at row 3 of partition 0"):
        predict(df, model, input_cols="features").collect()
    rows = [(i, [1.0, 2.0] if i == 4 else [1.0, 2.0, 3.0]) for i in range(6)]
    df = spark.createDataFrame(rows, "id long, features array<float>").coalesce(1)
    with pytest.raises(Exception, match=r"'features' has 2 values at row 4 of partition 0"):
        predict(df, model, input_cols="features").collect()
    rows = [(i, [1.0, None, 3.0] if i == 5 else [1.0, 2.0, 3.0]) for i in range(6)]
    df = spark.createDataFrame(rows, "id long, features array<float>").coalesce(1)
    with pytest.raises(Exception, match=r"null inside the array at row 5 of partition 0"):
        predict(df, model, input_cols="features").collect()


class TwoInputs(nn.Module):
    """Several inputs in, a dict of a scalar and an array out (a struct column)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"total": a.sum(dim=1) + b, "doubled": a * 2}


@pytest.mark.parametrize("arrow_udf", [True, False], ids=["arrow_udf", "mapInArrow"])
def test_predict_any_model_scalars_arrays_structs(
    spark: Any, arrow_udf: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(inference, "ARROW_UDF", arrow_udf)
    df = _arrays(spark, 50, 3).withColumn("b", F.col("id").cast("double"))
    out = predict(df, TwoInputs(), input_cols=["features", "b"], output_col="o", batch_size=7)
    assert out.schema["o"].dataType.simpleString() == "struct<total:float,doubled:array<float>>"
    for row in out.collect():
        assert row.o.total == pytest.approx(sum(row.features) + row.id, rel=1e-5)
        assert row.o.doubled == pytest.approx([2 * v for v in row.features])
    linear = nn.Linear(4, 1)  # one value per row: a scalar column
    scalar = predict(df, linear, input_cols="features")
    assert scalar.schema["prediction"].dataType.simpleString() == "float"
    row = scalar.first()
    with torch.no_grad():
        expected = linear(torch.tensor([row.features])).item()
    assert row.prediction == pytest.approx(expected, rel=1e-5)


def test_predict_an_mlflow_model_uri(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with mlflow.start_run():
        uri = mlflow.pytorch.log_model(model, name="m", serialization_format="pickle").model_uri
    rows = predict(_arrays(spark, 20, 2), uri, input_cols="features").collect()
    x = torch.tensor([r.features for r in rows])
    with torch.no_grad():
        assert torch.allclose(torch.tensor([r.prediction for r in rows]), model(x), atol=1e-6)


def test_spark_udf_on_the_logged_model_matches_transform(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fit with tracking logs through sparktrain.log_model; MLflow's spark_udf can score it."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    df = _arrays(spark, 300, 2).withColumn("label", (F.col("id") % 3).cast("double"))
    estimator = TorchEstimator(
        model=nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)),
        loss="cross_entropy", numProcesses=2, mlflow=True, localMode=True, useGpu=False,
        epochs=2, validation=0.3, metrics=["accuracy"],
    )  # fmt: skip
    model = estimator.fit(df)
    assert model.mlflow_model_uri is not None
    score = mlflow.pyfunc.spark_udf(
        spark, model.mlflow_model_uri, result_type="array<float>", env_manager="local"
    )
    both = model.transform(df).withColumn("mlflow", score("features"))
    rows = both.select(
        vector_to_array("rawPrediction").alias("ours"), "mlflow", "prediction"
    ).collect()
    ours, theirs = np.array([r.ours for r in rows]), np.array([r.mlflow for r in rows])
    assert np.allclose(ours, theirs, atol=1e-5)
    assert [r.prediction for r in rows] == theirs.argmax(axis=1).astype(float).tolist()
    run_id = mlflow.models.get_model_info(model.mlflow_model_uri).run_id
    run = mlflow.tracking.MlflowClient().get_run(run_id)
    assert run.data.params["loss"] == "cross_entropy" and "loss" in run.data.metrics
    for name, values in model.getHistory().items():  # every epoch's record, once, in MLflow
        logged = mlflow.tracking.MlflowClient().get_metric_history(run_id, name)
        assert [m.value for m in sorted(logged, key=lambda m: m.step)] == pytest.approx(values)
    assert set(model.getHistory()) == {"loss", "accuracy", "val_loss", "val_accuracy"}


def test_regression_in_local_mode_and_a_training_function(spark: Any) -> None:
    """task from the loss (mse: regression), ranks on the driver, and trainFn's full control."""
    from pyspark.ml.evaluation import RegressionEvaluator

    df = _arrays(spark, 400, 2).withColumn(
        "label", F.expr("features[0] * 2 - features[1] + 0.5").cast("double")
    )
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 1), loss="mse", optimizer="sgd", learningRate=0.2,
        epochs=20, batchSize=32, localMode=True, numProcesses=2, probabilityCol="x", useGpu=False,
    )  # fmt: skip
    model = estimator.fit(df)
    assert model.getTask() == "regression"
    scored = model.transform(df)
    assert scored.columns[-1] == "prediction" and "x" not in scored.columns
    assert RegressionEvaluator(metricName="rmse").evaluate(scored) < 0.1

    def train(context: Any) -> Any:
        import sparktrain

        model = sparktrain.prepare_model(context.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
        for _ in range(context.epochs):
            for batch in context.data:
                (x,) = context.features(batch)
                loss = nn.functional.mse_loss(model(x).squeeze(1), batch["label"].float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        return model

    custom = estimator.copy({estimator.trainFn: train, estimator.epochs: 15}).fit(df)
    assert RegressionEvaluator(metricName="rmse").evaluate(custom.transform(df)) < 0.1


def test_bad_arguments_are_named_before_anything_runs(spark: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"no param or run option 'epoch' \(did you mean 'epochs'"
    ):
        TorchEstimator(epoch=3)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="unknown loss 'crossentropy'"):
        TorchEstimator(loss="crossentropy")
    with pytest.raises(ConfigError, match="unknown task"):
        TorchModel(nn.Linear(2, 2), task="classify")
    df = _arrays(spark, 10, 1).withColumn("label", F.lit(1.0)).withColumn("name", F.lit("a"))
    with pytest.raises(ConfigError, match="needs model="):
        TorchEstimator(loss="mse").fit(df)
    with pytest.raises(ConfigError, match=r"column 'name' is string"):
        TorchEstimator(model=nn.Linear(1, 1), loss="mse", featuresCol="name").fit(df)
    with pytest.raises(ConfigError, match=r"\['missing'\] not in the DataFrame"):
        TorchEstimator(model=nn.Linear(1, 1), loss="mse", labelCol="missing").fit(df)
    with pytest.raises(ConfigError, match="numProcesses=0 must be a positive"):
        TorchEstimator(model=nn.Linear(4, 1), loss="mse", numProcesses=0).fit(df)
    with pytest.raises(ConfigError, match="'features' is already a column"):
        predict(df, nn.Linear(4, 2), input_cols="features", output_col="features")
    with pytest.raises(ConfigError, match="one logit per class"):
        TorchModel(nn.Linear(4, 1), task="classification").transform(df)
    with pytest.raises(ConfigError, match="one result per input row"):
        predict(df, lambda x: x.sum(), input_cols="features")


def test_a_gpu_asked_for_without_cuda_names_the_tasks_gpu(spark: Any) -> None:
    """The fixture's executors give each task a (fake) GPU; torch here has no CUDA."""
    df = _arrays(spark, 10, 2)
    with pytest.raises(Exception, match=r"given GPU [01], but torch in the executor's Python"):
        predict(df, nn.Linear(4, 2), input_cols="features", use_gpu=True).collect()
    assert predict(df, nn.Linear(4, 2), input_cols="features").count() == 10  # None: the CPU


def test_cross_validator_fits_copies_of_the_estimator(spark: Any) -> None:
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    df = _arrays(spark, 200, 2).withColumn("label", (F.col("features")[0] > 0.5).cast("double"))
    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 1), loss="bce_with_logits", epochs=8, batchSize=16,
        localMode=True, useGpu=False,
    )  # fmt: skip
    grid = ParamGridBuilder().addGrid(estimator.learningRate, [1e-4, 0.05]).build()
    from pyspark.ml.evaluation import BinaryClassificationEvaluator

    search = CrossValidator(
        estimator=estimator, estimatorParamMaps=grid, evaluator=BinaryClassificationEvaluator(),
        numFolds=2, seed=3,
    )  # fmt: skip
    best = search.fit(df)
    assert best.avgMetrics[1] > best.avgMetrics[0]  # the larger rate learns in 8 epochs
    assert best.bestModel.getTask() == "binary"
    assert {r.prediction for r in best.transform(df).select("prediction").collect()} <= {0.0, 1.0}


def test_the_spark_ml_example(spark: Any) -> None:
    import spark_ml_pipeline

    result = spark_ml_pipeline.main(["--rows", "2048", "--epochs", "1"], spark=spark)
    assert result["accuracy"] > 0.5 and result["same"] == 1.0  # chance: 0.1
    assert result["epochs"] == 1
