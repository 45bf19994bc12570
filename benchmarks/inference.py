"""Inference benchmark: rows per second scored over a Spark DataFrame, five ways, one run.

One run starts ``local-cluster[2,1,1024]`` (two executors of one core and 1 GB each; the JVMs
keep their full JIT, as on a cluster), generates ``--rows`` rows of 784 float32 ``features``
(``array<float>``, Parquet, reused between runs) and, for each model, scores every row with:

* (a) the limit: the model's forward pass over batches of the same size in one process with
  one thread (an executor's core), times the number of executors;
* (b) ``sparktrain.spark.TorchModel.transform`` (``task="raw"``: the logits as
  ``array<float>``, the output every path gives); and, for information, (b') the same model
  with ``task="classification"`` (prediction, rawPrediction and probability vectors);
* (c) ``pyspark.ml.functions.predict_batch_udf`` with the same batch size;
* (d) ``mlflow.pyfunc.spark_udf`` on the model logged with an input example (its signature);
* (e) a plain ``pandas_udf`` that unpickles the model for every Arrow batch;
* (f) for information: Spark's transfer alone, an Arrow UDF that reads the column and returns
  nulls, the most any Python UDF can reach on this machine;
* (n) the no-Spark limit: EXECUTORS plain processes, pyarrow reading their share of the row
  groups, the model running on one thread each;
* the files path (rows never pass through the JVM): (g) ``sparktrain.spark.predict`` as a
  DataFrame to the ``noop`` sink and (h) the same DataFrame written by Spark's Parquet writer;
  ``sparktrain.inference.score`` writing Parquet parts itself, (i) on local processes (no Spark)
  and (j) on Spark's executors, timed by ``ScoreResult.scoring_seconds``: the longest rank's
  time from its first read to its last write (as (n) leaves out its warm pool's start; the
  whole call's rate, the ranks' start included, is printed after the table).

The models: the seeds' MLP (784-512-256-10) and a 6-layer transformer encoder (the 784 values
as 16 tokens of 49, width 64, 4 heads, feed-forward 256, mean-pooled to 10 logits; about 25
times the MLP's arithmetic per row). Every path is timed as a full pass
(``write.format("noop")``) after one pass that warms the JVMs' JIT and the Python workers; with
``--repeat`` the paths are interleaved and the median is shown. Before timing, each path's
output on the first rows is checked against the model's own ((i), (j): the rows written).
Targets (PASS/MISS): (b) >= 0.7 x (a) and (b) >= 1.5 x the best of (c) and (d); the files
path >= 0.8 x (n) and >= 2 x (c), as a DataFrame to ``noop`` (g) and as files (j). Last, the
largest peak RSS of Spark's Python workers over the run (with ``--paths b``: what scoring
holds, whatever the data's size).

    python benchmarks/inference.py                         # 1,000,000 rows: ~25 min here
    python benchmarks/inference.py --rows 100000 --models mlp      # a smoke test
    python benchmarks/inference.py --rows 9600000 --models mlp --paths b   # 30 GB, by hand
    python benchmarks/inference.py --gpu                   # on a GPU machine (not run here)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch
from _common import (
    BENCH_TAG_VAR,
    fmt,
    leftover_processes,
    load_average,
    log,
    ratio,
    stop_strays,
    tagged_processes,
    version_of,
)
from spark_launch import shutdown_gateway
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_mlp import make_model

FEATURES = 784
NO_SPARK = "(n) no Spark: processes read+run"
SCORED = "(i) score() -> Parquet, no Spark"
SCORED_SPARK = "(j) score(backend='spark') -> Parquet"
RANK_PEAKS: list[float] = []  # (i), (j): the largest peak RSS of a rank, each call, in MB
WHOLE_CALLS: dict[str, list[float]] = {}  # (i), (j): rows/s of the whole call, ranks' start too
GPU_USE: dict[str, list[float]] = {}  # with --gpu: each path's mean GPU utilisation, each run
EXECUTORS = 2  # Spark's executors, (n)'s processes and score()'s ranks (--ranks)
FILE_ROWS = 50_000


class Encoder(nn.Module):
    """A 6-layer transformer encoder over the 784 values as 16 tokens of 49."""

    def __init__(self, tokens: int = 16, width: int = 49, d: int = 64, layers: int = 6) -> None:
        super().__init__()
        self.tokens, self.width = tokens, width
        self.embed = nn.Linear(width, d)
        self.position = nn.Parameter(torch.zeros(tokens, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(len(x), self.tokens, self.width)) + self.position
        return self.head(self.encoder(h).mean(dim=1))


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"mlp": make_model().eval(), "transformer": Encoder().eval()}


def generate(folder: Path, rows: int) -> Path:
    """``rows`` rows of ``id`` and 784 float32 ``features`` as Parquet (kept for later runs)."""
    import pyarrow.parquet as pq

    path = folder / f"features-{rows}"
    if (path / "_DONE").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    started = time.monotonic()
    for first in range(0, rows, FILE_ROWS):
        count = min(FILE_ROWS, rows - first)
        values = rng.standard_normal(count * FEATURES, dtype=np.float32)
        offsets = pa.array(np.arange(0, count * FEATURES + 1, FEATURES, dtype=np.int32))
        table = pa.table(
            {
                "id": pa.array(np.arange(first, first + count, dtype=np.int64)),
                "features": pa.ListArray.from_arrays(offsets, pa.array(values)),
            }
        )
        pq.write_table(
            table, path / f"part-{first // FILE_ROWS:05d}.parquet", row_group_size=10_000
        )
    (path / "_DONE").touch()
    log(f"generated {rows:,} rows in {time.monotonic() - started:.0f}s at {path}")
    return path


def start_spark(gpu: bool, folder: Path) -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (
        SparkSession.builder.master(f"local-cluster[{EXECUTORS},1,1024]")
        .appName("sparktrain-bench-inference")
        .config("spark.executor.memory", "1g")  # all of a 1024 MB worker: less GC in the JVMs
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
        .config(f"spark.executorEnv.{BENCH_TAG_VAR}", os.environ[BENCH_TAG_VAR])
    )
    if gpu:  # each executor one GPU (the machine's first ones), one task per GPU
        script = folder / "gpus.sh"
        script.write_text(
            '#!/bin/sh\nprintf \'{"name": "gpu", "addresses": ["%s"]}\' '
            '"$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, - '
            '| sed \'s/,/","/g\')"\n'
        )
        script.chmod(0o755)
        for key, value in {
            "spark.worker.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.amount": "1",
            "spark.executor.resource.gpu.discoveryScript": str(script),
            "spark.task.resource.gpu.amount": "1",
        }.items():
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    deadline = time.monotonic() + 60
    while status.size() < EXECUTORS + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
        status = spark.sparkContext._jsc.sc().getExecutorMemoryStatus()
    return spark


def limit(model: nn.Module, data: Path, batch: int, gpu: bool) -> float:
    """(a): rows per second of the forward pass alone, one thread, times the executors."""
    import pyarrow.parquet as pq

    table = pq.read_table(next(data.glob("*.parquet")), columns=["features"])
    column = table.column("features").combine_chunks()
    x = torch.from_numpy(column.flatten().to_numpy().copy()).reshape(len(column), FEATURES)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device = torch.device("cuda" if gpu else "cpu")
    model = model.to(device)
    try:
        with torch.inference_mode():
            model(x[:batch].to(device))
            started = time.perf_counter()
            for first in range(0, len(x), batch):
                out = model(x[first : first + batch].to(device))
            if gpu:
                out.cpu()
            seconds = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
        model.cpu()
    return len(x) / seconds * EXECUTORS


def _plain_worker(
    payload: bytes, pieces: list[tuple[str, int]], batch: int, device: str = "cpu"
) -> tuple[float, ...]:
    """(n), in one process: read row groups with pyarrow, run the model; rows, start, end."""
    import cloudpickle
    import pyarrow.parquet as pq

    torch.set_num_threads(1)
    model = cloudpickle.loads(payload).to(device)
    rows, started, out = 0, time.time(), None
    with torch.inference_mode():
        for file, group in pieces:
            handle = pq.ParquetFile(file)
            for chunk in handle.iter_batches(batch, row_groups=[group], columns=["features"]):
                column = chunk.column(0)
                x = torch.from_numpy(column.flatten().to_numpy()).reshape(len(column), FEATURES)
                out = model(x.to(device))
                rows += len(column)
        if out is not None:
            out.cpu()  # on a GPU: wait for the last forward pass
    return rows, started, time.time()


def plain_processes(model: nn.Module, data: Path, batch: int, gpu: bool = False) -> float:
    """(n): rows/s of EXECUTORS plain processes (no Spark), each reading its share of the row
    groups with pyarrow and running the model on one thread; from the first start to the last
    end."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import cloudpickle
    import pyarrow.parquet as pq

    pieces = [
        (str(f), g)
        for f in sorted(data.glob("*.parquet"))
        for g in range(pq.ParquetFile(f).metadata.num_row_groups)
    ]
    payload = cloudpickle.dumps(model)
    context = multiprocessing.get_context("spawn")
    count = torch.cuda.device_count() if gpu else 0
    devices = [f"cuda:{i % count}" if gpu else "cpu" for i in range(EXECUTORS)]
    with ProcessPoolExecutor(EXECUTORS, mp_context=context) as pool:
        first = [pieces[:1]] * EXECUTORS  # warm: imports, CUDA, the first forward pass
        list(pool.map(_plain_worker, [payload] * EXECUTORS, first, [batch] * EXECUTORS, devices))
        shares = [pieces[i::EXECUTORS] for i in range(EXECUTORS)]
        done = list(
            pool.map(_plain_worker, [payload] * EXECUTORS, shares, [batch] * EXECUTORS, devices)
        )
    rows = sum(d[0] for d in done)
    return rows / (max(d[2] for d in done) - min(d[1] for d in done))


def score_files(
    model: nn.Module,
    data: Path,
    batch: int,
    out: Path,
    *,
    backend: str = "local",
    gpu: bool = False,
    autocast: str | None = None,
) -> float:
    """(i), (j): rows/s of ``sparktrain.inference.score`` on EXECUTORS ranks (local processes,
    or Spark's executors), each rank writing its parts as Parquet itself.

    Timed by ``ScoreResult.scoring_seconds`` (the longest rank's time scoring); the whole
    call's rate (the ranks' start included) is kept in ``WHOLE_CALLS`` and printed after the
    table.
    """
    from sparktrain.inference import score

    result = score(
        str(data), model, output=str(out), input_cols="features", keep_cols=["id"],
        batch_size=batch, num_processes=EXECUTORS, overwrite=True, progress=False,
        backend=backend, use_gpu=gpu, autocast=autocast,
    )  # fmt: skip
    RANK_PEAKS.append(result.peak_rss / 1e6)
    WHOLE_CALLS.setdefault(backend, []).append(result.rows / result.seconds)
    check_written(out, data, model, half=autocast is not None)
    return result.rows / result.scoring_seconds


def check_written(out: Path, data: Path, model: nn.Module, half: bool = False) -> None:
    """The parts written hold the model's outputs for the first ids, each once (``half``: to
    bf16's or fp16's precision)."""
    import pyarrow.dataset as pads

    first = pads.field("id") < 200
    written = pads.dataset(str(out), format="parquet").to_table(filter=first).sort_by("id")
    inputs = pads.dataset(str(data), format="parquet").to_table(filter=first).sort_by("id")
    assert written["id"].to_pylist() == list(range(200)), f"{out}: ids not each written once"
    x = torch.tensor(np.array(inputs["features"].to_pylist()), dtype=torch.float32)
    with torch.inference_mode():
        expected = model.cpu()(x)
    got = torch.tensor(np.array(written["prediction"].to_pylist()), dtype=torch.float32)
    close = {"atol": 0.1, "rtol": 0.05} if half else {"atol": 1e-4}
    assert torch.allclose(got, expected, **close), f"{out}: predictions differ"  # type: ignore[arg-type]


def paths(
    spark: Any, model: nn.Module, batch: int, gpu: bool, work: Path
) -> dict[str, Callable[[Any], Any]]:
    """Each path: a function of the DataFrame that returns it with the prediction column."""
    import cloudpickle
    import mlflow
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sparktrain.spark import TorchModel, predict

    payload = cloudpickle.dumps(model)
    ours = TorchModel(model, task="raw", inferenceBatchSize=batch, useGpu=gpu or None)
    classes = TorchModel(model, task="classification", inferenceBatchSize=batch)

    def make_predict_fn() -> Callable[[np.ndarray], np.ndarray]:
        import cloudpickle
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() and gpu else "cpu")
        loaded = cloudpickle.loads(payload).to(device).eval()

        def predict(x: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return loaded(torch.from_numpy(x).to(device)).cpu().numpy()

        return predict

    batch_udf = predict_batch_udf(
        make_predict_fn, return_type=T.ArrayType(T.FloatType()), batch_size=batch,
        input_tensor_shapes=[[FEATURES]],
    )  # fmt: skip
    mlflow.set_tracking_uri(f"sqlite:///{work / 'mlflow.db'}")
    example = np.zeros((2, FEATURES), dtype=np.float32)
    with mlflow.start_run():
        info = mlflow.pytorch.log_model(
            model, name="model", serialization_format="pickle", input_example=example
        )
    pyfunc = mlflow.pyfunc.spark_udf(
        spark, info.model_uri, result_type="array<float>", env_manager="local"
    )

    @F.pandas_udf(T.ArrayType(T.FloatType()))
    def per_batch(features: pd.Series) -> pd.Series:
        import cloudpickle
        import torch

        loaded = cloudpickle.loads(payload).eval()
        with torch.inference_mode():
            out = loaded(torch.from_numpy(np.stack(features.to_numpy()))).numpy()
        return pd.Series(list(out))

    def transfer(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        for array in batches:
            yield pa.nulls(len(array), pa.float32())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        only_transfer = F.arrow_udf(transfer, "float", F.ArrowUDFType.SCALAR_ITER)

    def files_path(df: Any) -> Any:
        return predict(df, model, input_cols="features", keep_cols=["id"], batch_size=batch)

    return {
        "(g) predict, files path -> noop": files_path,
        "(h) predict, files path -> Parquet": files_path,
        "(b) TorchModel.transform": ours.transform,
        "(b') transform, classification": classes.transform,
        "(c) predict_batch_udf": lambda df: df.withColumn("prediction", batch_udf("features")),
        "(d) mlflow spark_udf": lambda df: df.withColumn("prediction", pyfunc("features")),
        "(e) pandas_udf, load per batch": lambda df: df.withColumn(
            "prediction", per_batch("features")
        ),
        "(f) transfer alone": lambda df: df.withColumn("prediction", only_transfer("features")),
    }


def check(name: str, scored: Any, model: nn.Module, first: Any) -> None:
    """The path's predictions on the first rows equal the model's own, matched by id."""
    rows = scored.orderBy("id").collect()
    inputs = first.orderBy("id").collect()
    assert [r.id for r in rows] == [r.id for r in inputs], f"{name}: other rows"
    x = torch.tensor(np.array([r.features for r in inputs]), dtype=torch.float32)
    with torch.inference_mode():
        expected = model.cpu()(x)
    value = rows[0].prediction
    if hasattr(value, "toArray") or isinstance(value, float):  # (b'): the class index
        got = torch.tensor([r.prediction for r in rows])
        assert torch.equal(got, expected.argmax(dim=1).float()), name
    else:
        got = torch.tensor(np.array([r.prediction for r in rows]), dtype=torch.float32)
        assert torch.allclose(got, expected, atol=1e-4), f"{name}: predictions differ"


class GpuUse:
    """Mean GPU utilisation (percent, every GPU) while the block runs, from ``nvidia-smi``."""

    def __init__(self, on: bool) -> None:
        self.on, self.samples = on, []  # type: ignore[var-annotated]
        self.stop = threading.Event()

    def _sample(self) -> None:
        import subprocess

        while not self.stop.wait(0.5):
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                text = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=5, check=True,
                ).stdout  # fmt: skip
                values = [float(v) for v in text.split()]
                self.samples.append(sum(values) / len(values))

    def __enter__(self) -> GpuUse:
        if self.on:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def timed(df: Any, parquet: str | None = None) -> float:
    """Seconds for a full pass: to Spark's noop sink, or written as Parquet to ``parquet``."""
    started = time.perf_counter()
    if parquet is None:
        df.select("prediction").write.format("noop").mode("overwrite").save()
    else:
        df.write.mode("overwrite").parquet(parquet)
    return time.perf_counter() - started


def run_model(
    spark: Any, name: str, model: nn.Module, args: argparse.Namespace, *, data: Path, work: Path
) -> dict[str, float]:
    log(f"{name}: (a) the limit")
    results = {"(a) limit: forward x executors": limit(model, data, args.batch, args.gpu)}
    wanted = set(args.paths.split(","))
    clock = timers(model, data, args, work, wanted)
    if spark is not None:
        df = spark.read.parquet(str(data))
        every = paths(spark, model, args.batch, args.gpu, work)
        ways = {way: make for way, make in every.items() if way[1 : way.index(")")] in wanted}
        if args.gpu:
            ways.pop("(d) mlflow spark_udf", None)  # its pyfunc loads on the CPU
        first = df.where("id < 200")  # Parquet statistics: only the first row group is read
        for way, make in ways.items():
            if "(f)" not in way:
                check(way, make(first), model, first)
        log(f"{name}: warm-up pass")
        timed(every["(f) transfer alone"](df))
        for way, make in ways.items():
            parquet = str(work / "out") if "-> Parquet" in way else None
            clock[way] = functools.partial(spark_rate, make, df, args.rows, parquet)
    return results | interleaved(name, clock, args)


def interleaved(
    name: str, clock: dict[str, Callable[[], float]], args: argparse.Namespace
) -> dict[str, float]:
    """Each path's median rows/s over ``--repeat`` rounds, every path in turn in each round."""
    rates: dict[str, list[float]] = {way: [] for way in clock}
    for attempt in range(args.repeat):
        for way, rate in clock.items():
            with GpuUse(args.gpu) as gpu:
                value = rate()
            rates[way].append(value)
            use = f", GPU utilisation {gpu.mean:.0f} %" if gpu.mean is not None else ""
            took = f"{args.rows / value:.1f}s, {value:,.0f} rows/s{use}"
            log(f"{name} {way} run {attempt + 1}: {took}")
            if gpu.mean is not None:
                GPU_USE.setdefault(way, []).append(gpu.mean)
    return {way: statistics.median(values) for way, values in rates.items()}


def spark_rate(make: Callable[[Any], Any], df: Any, rows: int, parquet: str | None) -> float:
    """Rows/s of one full pass of a DataFrame path (to ``noop``, or to Parquet)."""
    return rows / timed(make(df), parquet)


def timers(
    model: nn.Module, data: Path, args: argparse.Namespace, work: Path, wanted: set[str]
) -> dict[str, Callable[[], float]]:
    """The paths that take no DataFrame: each a function that runs it once, giving rows/s."""
    out: dict[str, Callable[[], float]] = {}
    if "n" in wanted:
        out[NO_SPARK] = lambda: plain_processes(model, data, args.batch, args.gpu)
    if "i" in wanted:
        out[SCORED] = lambda: score_files(model, data, args.batch, work / "scored", gpu=args.gpu)
    if "i" in wanted and args.autocast:
        out[f"{SCORED} {args.autocast}"] = lambda: score_files(
            model, data, args.batch, work / "scored-half", gpu=args.gpu, autocast=args.autocast
        )
    if "j" in wanted and not args.no_spark:
        out[SCORED_SPARK] = lambda: score_files(
            model, data, args.batch, work / "scored-spark", backend="spark"
        )
    return out


def workers_peak_mb() -> float:
    """The largest peak RSS (VmHWM) among Spark's Python workers of this run, in MB."""
    peak = 0
    for pid, command in tagged_processes().items():
        if "pyspark.daemon" in command or "pyspark.worker" in command:
            with contextlib.suppress(OSError, ValueError):
                status = Path(f"/proc/{pid}/status").read_text()
                line = next(x for x in status.splitlines() if x.startswith("VmHWM:"))
                peak = max(peak, int(line.split()[1]))
    return peak / 1024


def report(tables: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    cluster = f"executors (local-cluster[{EXECUTORS},1,1024])"
    where = "ranks, no Spark" if args.no_spark else cluster
    print(
        f"\ninference over {args.rows:,} rows of 784 float32, {EXECUTORS} "
        f"{where}{' with GPUs' if args.gpu else ''}, batches of {args.batch}; rows/s"
        f" (median of {args.repeat}); pyspark {version_of('pyspark')}, torch "
        f"{version_of('torch')}, mlflow {version_of('mlflow')}; load {load_average()}"
    )
    for name, table in tables.items():
        top = table["(a) limit: forward x executors"]
        print(f"\n  {name:<12} {'path':<39} {'rows/s':>10} {'/ (a)':>7}")
        for way, value in table.items():
            print(f"  {'':<12} {way:<39} {value:>10,.0f} {fmt(ratio(value, top)):>7}")
        ours = table.get("(b) TorchModel.transform")
        best = max(table.get("(c) predict_batch_udf", 0), table.get("(d) mlflow spark_udf", 0))
        plain, batch_udf = table.get(NO_SPARK), table.get("(c) predict_batch_udf")
        noop = table.get("(g) predict, files path -> noop")
        parquet = table.get("(h) predict, files path -> Parquet")
        files = table.get(SCORED_SPARK)
        for label, value, target in (
            ("(g)/(n): files path, noop", ratio(noop, plain), 0.8),
            ("(g)/(c)", ratio(noop, batch_udf), 2.0),
            ("(j)/(n): files path, Parquet", ratio(files, plain), 0.8),
            ("(j)/(c)", ratio(files, batch_udf), 2.0),
            ("(h)/(n): Spark's Parquet writer", ratio(parquet, plain), None),
            ("(h)/(c)", ratio(parquet, batch_udf), None),
            (
                "(i)/(n): score(), no Spark",
                ratio(table.get("(i) score() -> Parquet, no Spark"), plain),
                None,
            ),
            ("(b)/(a)", ratio(ours, top), 0.7),
            ("(b)/best of (c),(d)", ratio(ours, best or None), 1.5),
            ("(f)/(a): the transfer's ceiling", ratio(table.get("(f) transfer alone"), top), None),
        ):
            if value is None and args.no_spark:
                continue  # a Spark path, not run
            verdict = "" if target is None else ("PASS" if value and value >= target else "MISS")
            goal = "" if target is None else f">= {target}"
            print(f"  {'':<12} {label:<39} {fmt(value):>10} {goal:>7} {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1024, help="rows per forward pass")
    parser.add_argument("--repeat", type=int, default=1, help="passes per path; the median")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--gpu", action="store_true", help="one GPU per executor and rank")
    parser.add_argument(
        "--no-spark", action="store_true", help="start no Spark: only (a), (n) and (i)"
    )
    parser.add_argument(
        "--ranks", type=int, default=None,
        help="executors, (n)'s processes and score()'s ranks (2; with --gpu, the GPUs seen)",
    )  # fmt: skip
    parser.add_argument("--autocast", choices=("bf16", "fp16"), help="add (i) in half precision")
    parser.add_argument("--data", default=None, help="folder for the data (kept between runs)")
    parser.add_argument(
        "--paths", default="a,n,g,h,i,j,b,b',c,d,e,f", help="paths to time, e.g. n,g,c"
    )
    args = parser.parse_args(argv)
    global EXECUTORS  # noqa: PLW0603 (one setting for every path, read by the workers too)
    EXECUTORS = args.ranks or (torch.cuda.device_count() if args.gpu else 0) or EXECUTORS
    os.environ.setdefault(BENCH_TAG_VAR, uuid.uuid4().hex)
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    warnings.filterwarnings("ignore", category=FutureWarning)  # pyspark on pandas 3
    folder = Path(args.data or Path(tempfile.gettempdir()) / "sparktrain-bench-inference")
    data = generate(folder, args.rows)
    chosen = {k: v for k, v in models().items() if k in args.models.split(",")}
    tables = {}
    with tempfile.TemporaryDirectory() as scratch:
        spark = None if args.no_spark else start_spark(args.gpu, Path(scratch))
        try:
            for name, model in chosen.items():
                tables[name] = run_model(spark, name, model, args, data=data, work=Path(scratch))
            peak = workers_peak_mb()
        finally:
            import sparktrain

            sparktrain.shutdown_warm()  # the fork server score() started
            if spark is not None:
                spark.stop()
                shutdown_gateway()  # the driver JVM, which spark.stop() leaves running
    report(tables, args)
    if not args.no_spark:
        print(f"\npeak RSS of a Spark Python worker over every path: {peak:,.0f} MB")
    for way, uses in GPU_USE.items():
        print(f"mean GPU utilisation, {way}: " + " ".join(f"{u:.0f} %" for u in uses))
    if RANK_PEAKS:
        print(f"peak RSS of a rank of score() (i), (j): {max(RANK_PEAKS):,.0f} MB")
    for backend, rates in WHOLE_CALLS.items():
        print(
            f"score(backend={backend!r}), the whole call (the ranks' start included), rows/s: "
            + " ".join(f"{r:,.0f}" for r in rates)
        )
    strays, _ = leftover_processes(10.0, exclude=frozenset({os.getpid()}))
    # (n)'s process pool starts Python's resource tracker, which ends with this process.
    strays = {p: c for p, c in strays.items() if "multiprocessing.resource_tracker" not in c}
    print(f"\nleftover processes after the session stopped: {len(strays)}")
    for pid, command in strays.items():
        print(f"  {pid}: {command[:160]}")
    if strays:
        stop_strays(strays)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
