"""Spark ML rows of ``stress.py``: fits and transforms back to back, at once, callers killed.

On one ``local-cluster[2,1,1024]`` session (two executor JVMs):

* ``TorchEstimator.fit`` (2 ranks as barrier tasks, 2 epochs over 400 rows) back to back; a run
  is right when it trained two epochs and ``timeout=60`` did not stop it;
* ``TorchModel.transform`` of 20,000 rows in 8 partitions back to back; right when the sum of
  its predictions is the model's own, computed here; a transform still running after 60 s is
  a hang (its job is cancelled);
* a fit and a transform from two threads at once;

and, each on its own ``local[2]`` session in a child process, the caller SIGKILLed at a random
moment of a fit (4-14 s in: the JVM's start, the data cache's write or training): a trial is
right when nothing it started (JVM, Python workers, fork servers, ranks) is alive 20 s later.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _common import BENCH_TAG_VAR, log, stop_strays, tagged_processes
from stress_table import RUN_TIMEOUT, Row

TRAIN_ROWS = 400
SCORE_ROWS = 20_000

KILLED_CALLER = """
import os, sys
os.environ["PYSPARK_PYTHON"] = sys.executable
from pyspark.sql import SparkSession, functions as F
from torch import nn
from sparktrain.spark import TorchEstimator

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
features = F.array(*[F.rand(i).cast("float") for i in range(4)])
df = spark.range(0, 4000, 1, 2).select(features.alias("features"), F.rand(9).alias("label"))
TorchEstimator(model=nn.Linear(4, 1), loss="mse", epochs=200, numProcesses=2, useGpu=False).fit(df)
"""


def _frames(spark: Any) -> tuple[Any, Any]:
    from pyspark.sql import functions as F

    features = F.array(*[F.rand(i).cast("float") for i in range(4)]).alias("features")
    train = spark.range(0, TRAIN_ROWS, 1, 2).select(features)
    train = train.withColumn("label", (F.col("features")[0] > F.col("features")[1]).cast("double"))
    score = spark.range(0, SCORE_ROWS, 1, 8).select("id", features)
    return train.cache(), score.cache()


def _fit(train: Any) -> tuple[str, Any]:
    from torch import nn

    from sparktrain import TrainingTimeoutError
    from sparktrain.spark import TorchEstimator

    estimator = TorchEstimator(
        model=lambda: nn.Linear(4, 2), loss="cross_entropy", epochs=2, batchSize=32,
        numProcesses=2, useGpu=False, timeout=RUN_TIMEOUT, log_ranks=[],
    )  # fmt: skip
    try:
        model = estimator.fit(train)
    except TrainingTimeoutError:
        return "hang", None
    except Exception as error:
        return f"failure: {type(error).__name__}: {str(error).splitlines()[0][:160]}", None
    return ("ok" if len(model.history) == 2 else f"failure: history {model.history}"), model


def _expected(model: Any, score: Any) -> float:
    import torch

    rows = score.orderBy("id").collect()
    with torch.no_grad():
        logits = model.torch_model(torch.tensor([r.features for r in rows]))
    return float(logits.argmax(dim=1).sum())


def _transform(spark: Any, model: Any, score: Any, expected: float) -> str:
    from pyspark.sql import functions as F

    group, found = uuid.uuid4().hex, []

    def run() -> None:
        spark.sparkContext.setJobGroup(group, "stress transform", interruptOnCancel=True)
        try:
            found.append(model.transform(score).agg(F.sum("prediction")).first()[0])
        except Exception as error:
            found.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(RUN_TIMEOUT)
    if thread.is_alive():
        spark.sparkContext.cancelJobGroup(group)
        return "hang"
    if isinstance(found[0], Exception):
        return f"failure: {type(found[0]).__name__}: {str(found[0]).splitlines()[0][:160]}"
    return "ok" if found[0] == expected else f"failure: sum {found[0]} != {expected}"


def _timed(row: Row, action: Any) -> None:
    started = time.monotonic()
    result = action()
    row.add(result, time.monotonic() - started)
    if result != "ok":
        log(f"{row.label}: run {len(row.durations)}: {result}")


def rows(count: int) -> list[Row]:
    """The three Spark ML rows, ``count`` fits each (3 x ``count`` transforms)."""
    from spark_launch import shutdown_gateway, start_session, stop_session

    log("starting local-cluster[2,1,1024] for the Spark ML rows")
    spark, _, _ = start_session()
    try:
        train, score = _frames(spark)
        result, model = _fit(train)  # warm-up: the executors' first import of torch
        if model is None:
            raise RuntimeError(f"the warm-up fit failed: {result}")
        expected = _expected(model, score)
        fits = Row("TorchEstimator.fit on Spark")
        transforms = Row("TorchModel.transform, 8 partitions")
        both = Row("fit and transform from 2 threads at once")
        log(f"{fits.label}: {count} runs")
        for _ in range(count):
            _timed(fits, lambda: _fit(train)[0])
        log(f"{transforms.label}: {3 * count} runs")
        for _ in range(3 * count):
            _timed(transforms, lambda: _transform(spark, model, score, expected))
        log(f"{both.label}: {count} runs")
        for _ in range(count):
            other = threading.Thread(target=_timed, args=(both, lambda: _fit(train)[0]))
            other.start()
            _timed(both, lambda: _transform(spark, model, score, expected))
            other.join()
        for row in (fits, transforms, both):
            log(f"done:{row.line()}")
        return [fits, transforms, both]
    finally:
        stop_session(spark)
        shutdown_gateway()


def _ours() -> set[int]:
    """This process and its descendants (its own idle fork servers are not a caller's)."""
    import psutil

    me = psutil.Process()
    return {me.pid, *(child.pid for child in me.children(recursive=True))}


def kill_rows(count: int) -> list[Row]:
    """``count`` callers SIGKILLed during a fit; what each left alive after 20 s."""
    row = Row("caller SIGKILLed during fit: nothing left")
    log(f"{row.label}: {count} trials")
    with tempfile.TemporaryDirectory(prefix="stress-sparkml-") as folder:
        script = Path(folder, "caller.py")
        script.write_text(KILLED_CALLER)
        for trial in range(count):
            caller = subprocess.Popen(
                [sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            time.sleep(random.uniform(4.0, 14.0))
            caller.kill()
            caller.wait()
            killed = time.monotonic()
            left = tagged_processes(frozenset(_ours()))
            while left and time.monotonic() - killed < 20.0:
                time.sleep(0.2)
                left = tagged_processes(frozenset(_ours()))
            result = "ok" if not left else f"failure: {len(left)} alive: {sorted(left.values())}"
            row.add(result, time.monotonic() - killed)
            if left:
                log(f"trial {trial}: {result[:300]}")
                stop_strays(left)
    log(f"done:{row.line()}")
    return [row]


if __name__ == "__main__":  # a quick look: python benchmarks/stress_sparkml.py
    os.environ.setdefault(BENCH_TAG_VAR, uuid.uuid4().hex)
    for measured in rows(3) + kill_rows(2):
        print(measured.line())
