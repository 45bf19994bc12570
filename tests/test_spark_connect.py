"""The same calls through a Spark Connect session (a Connect server on loopback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

CLIENT = """
import sys
from pyspark.sql import SparkSession
from sparktrain import TorchDistributor, TrainingFailedError

def train():
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print("all_reduce gave", t.item())
    return dist.get_rank(), t.item()

def total(dataset):
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    mine = torch.tensor([sum(int(b["id"].sum()) for b in dataset)])
    dist.all_reduce(mine)
    return int(mine)

def fail():
    import os
    if os.environ["RANK"] == "1":
        raise KeyError("no such column")

if __name__ == "__main__":
    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    print("RESULT", TorchDistributor(2, False, False).run(train))
    from sparktrain.data import from_dataframe
    dataset = from_dataframe(spark.range(0, 30, 1, 2), batch_size=4)
    print("DATA", dataset.source.rows, TorchDistributor(2, False, False).run(total, dataset))
    try:
        TorchDistributor(2, False, False).run(fail)
    except TrainingFailedError as error:
        print("FAILED", error.culprit.rank, error.culprit.exc_type, error.victims)
    spark.stop()
"""


def run_client(code: str, server: str, folder: Path) -> str:
    """Run ``code`` as a Connect client of ``server`` in its own process; its output."""
    client = folder / "client.py"
    client.write_text(code)
    done = subprocess.run(
        [sys.executable, str(client), server],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_connect_session(connect_server: str, tmp_path: Path) -> None:
    out = run_client(CLIENT, connect_server, tmp_path)
    assert "RESULT (0, 2.0)" in out
    assert "DATA 30 435" in out  # Spark wrote the rows; the ranks read them all
    assert "[rank 1 127.0.0.1] all_reduce gave 2.0" in out
    assert "FAILED 1 KeyError (0,)" in out or "FAILED 1 KeyError ()" in out


ML_CLIENT = """
import sys
import tempfile
import numpy as np
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession, functions as F
from sparktrain.spark import TorchEstimator, predict

if __name__ == "__main__":
    spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
    df = spark.range(0, 400, 1, 2).select(
        "id", F.rand(1).alias("a"), F.rand(2).alias("b")
    ).withColumn("label", (F.col("a") > F.col("b")).cast("double"))
    estimator = TorchEstimator(
        model=torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)),
        loss="cross_entropy", epochs=20, batchSize=32, learningRate=0.01, numProcesses=2,
        useGpu=False,
    )
    assembler = VectorAssembler(inputCols=["a", "b"], outputCol="features")
    model = Pipeline(stages=[assembler, estimator]).fit(df)
    scored = model.transform(df)
    right = scored.filter(F.col("prediction") == F.col("label")).count()
    print("ACCURACY", right / 400)
    path = tempfile.mkdtemp() + "/model"
    model.stages[-1].write().save(path)
    loaded = type(model.stages[-1]).load(path)
    features = assembler.transform(df).orderBy("id")
    same = [r.prediction for r in loaded.transform(features).collect()] == [
        r.prediction for r in model.stages[-1].transform(features).collect()
    ]
    print("RELOADED", same)
    arrays = df.select("id", F.array("a", "b").alias("x"))
    rows = predict(arrays, torch.nn.Linear(2, 1), input_cols="x").collect()
    print("PREDICT", len(rows), type(rows[0].prediction).__name__)
    spark.stop()
"""


def test_spark_ml_on_connect(connect_server: str, tmp_path: Path) -> None:
    """TorchEstimator in a Pipeline, TorchModel persistence and predict on Spark Connect."""
    out = run_client(ML_CLIENT, connect_server, tmp_path)
    accuracy = float(out.split("ACCURACY ")[1].split()[0])
    assert accuracy > 0.8  # chance: 0.5
    assert "RELOADED True" in out
    assert "PREDICT 400 float" in out
