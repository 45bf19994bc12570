"""A Spark ML pipeline that trains the seeds' MLP on 2 ranks, evaluates it, saves and reloads it.

Run it with ``python examples/spark_ml_pipeline.py`` (needs ``pip install 'sparktrain[spark]'``
and Java 17). It starts a local Spark session, makes a synthetic classification DataFrame (784
numeric columns around one of 10 class centres), and then, as any Spark ML user would:

1. assembles the columns into a vector with ``VectorAssembler``;
2. fits ``TorchEstimator`` (the 784-512-256-10 MLP, cross-entropy, 2 ranks as Spark barrier
   tasks) inside a ``Pipeline``, holding out a tenth of the rows for validation with early
   stopping: every rank's logs stream to this terminal;
3. scores held-out rows with the fitted ``PipelineModel`` and a Spark evaluator;
4. saves the pipeline, loads it back and checks the predictions are the same;
5. scores a DataFrame of ``array<float>`` features with ``sparktrain.spark.predict``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np


def make_rows(rows: int, seed: int) -> Any:
    """A pandas frame of 784 features around one of 10 class centres, and the class as label."""
    import pandas as pd

    centres = np.random.default_rng(0).normal(scale=0.12, size=(10, 784)).astype(np.float32)
    generator = np.random.default_rng(seed)
    label = generator.integers(0, 10, rows)
    x = centres[label] + generator.standard_normal((rows, 784), dtype=np.float32)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(784)])
    frame["label"] = label.astype(float)
    return frame


def make_mlp() -> Any:
    """The seeds' MLP."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def local_session() -> Any:
    """A local Spark session whose Python workers use this interpreter."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    return (
        SparkSession.builder.master("local[2]")
        .appName("sparktrain-spark-ml")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )


def main(argv: list[str] | None = None, spark: Any = None) -> dict[str, float]:
    """Run the example; ``spark``: a session to use instead of a new local one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096, help="training rows")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.sql import functions as F

    from sparktrain.spark import TorchEstimator, predict

    own = spark is None
    spark = spark or local_session()
    try:
        train = spark.createDataFrame(make_rows(args.rows, 1))
        test = spark.createDataFrame(make_rows(1024, 2))
        assembler = VectorAssembler(inputCols=[f"f{i}" for i in range(784)], outputCol="features")
        estimator = TorchEstimator(
            model=make_mlp(),
            loss="cross_entropy",
            optimizer="adam",
            learningRate=1e-3,
            epochs=args.epochs,
            batchSize=64,
            numProcesses=2,
            useGpu=False,
            validation=0.1,  # a tenth of the rows, split by seed, evaluated every epoch
            metrics=["accuracy"],
            earlyStoppingPatience=2,  # stop when val_loss stalls; keep the best epoch's weights
        )
        started = time.perf_counter()
        model = Pipeline(stages=[assembler, estimator]).fit(train)
        seconds = time.perf_counter() - started
        scored = model.transform(test)
        accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(scored)
        print(f"fitted in {seconds:.1f}s; held-out accuracy {accuracy:.3f} (chance 0.1)")
        history = model.stages[-1].getHistory()
        print(f"validation accuracy per epoch: {[round(v, 3) for v in history['val_accuracy']]}")

        with tempfile.TemporaryDirectory() as folder:
            model.write().save(f"{folder}/pipeline")
            loaded = PipelineModel.load(f"{folder}/pipeline")
            ours = [r.prediction for r in model.transform(test).select("prediction").collect()]
            again = [r.prediction for r in loaded.transform(test).select("prediction").collect()]
        same = float(ours == again)
        print(f"saved, loaded: the same predictions: {bool(same)}")

        arrays = model.stages[0].transform(test).select("label", F.col("features").alias("vector"))
        torch_model = model.stages[-1].torch_model
        scores = predict(arrays, torch_model, input_cols="vector", output_col="logits")
        first = scores.select("label", "logits").first()
        print(f"predict: label {first.label:.0f}, logits argmax {int(np.argmax(first.logits))}")
        return {"accuracy": accuracy, "same": same, "epochs": len(history["val_accuracy"])}
    finally:
        if own:
            spark.stop()


if __name__ == "__main__":
    main()
