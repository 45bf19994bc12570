"""The rival readers of ``benchmarks/data.py``, each run in its own virtual environment.

Petastorm 0.13.1 imports only with ``pyarrow<15`` (it needs ``pyarrow.filesystem``), and Mosaic
Streaming's ``torchvision`` dependency needs the PyPI (CUDA) build of torch, not the CPU wheel
the project pins (../shared/MACHINE-NOTES.md): so each gets a venv under
``~/.cache/sparktrain-bench/venvs/<rival>``, made on first use::

    python benchmarks/data_rivals.py setup petastorm      # prints {"python": ...} or {"error": ...}
    <that python> benchmarks/data_rivals.py petastorm --parquet DIR --ranks 2 --batch 256 --work W
    <that python> benchmarks/data_rivals.py mosaic --parquet DIR --ranks 2 --batch 256 --work W

The data are those of ``data.py`` (``features`` list<float32> of 784, ``label`` int64).

* petastorm: a local ``SparkSession`` reads the Parquet folder; ``make_spark_converter(df)`` is
  timed (``materialise_s``); then ``--ranks`` processes at once each read one epoch of their
  shard through ``converter.make_torch_dataloader(batch_size, num_epochs=1, cur_shard=r,
  shard_count=ranks)`` (its defaults: a pool of reader threads inside the rank's process).
* mosaic: the rows are written as MDS shards with ``MDSWriter`` (``materialise_s``); then
  ``--ranks`` processes at once (``RANK``/``WORLD_SIZE``/``LOCAL_*`` and a loopback
  ``MASTER_ADDR``/``MASTER_PORT`` set: Streaming starts a gloo group) each read one epoch of
  ``StreamingDataset(local=..., batch_size, shuffle=True)`` through a ``DataLoader`` with no
  workers.

Each rank reports rows, batches, seconds (from building its loader to its last batch), rows per
second and peak RSS (``VmHWM`` of the rank's process, its reader threads included). The last
line printed is one JSON object; a failure prints the same shape with ``error`` set to the
exception's text, never made-up figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from _common import make_venv

VENVS = Path.home() / ".cache" / "sparktrain-bench" / "venvs"
INSTALL = {
    # torch first: petastorm pins setuptools<70, torch wants >=77 (one pip call is refused).
    "petastorm": [
        ["torch==2.13.0"],
        ["petastorm==0.13.1", "pyarrow==14.0.2", "numpy<2", "pandas<2.3", "pyspark>=3.5,<4.1"],
    ],
    "mosaic": [["mosaicml-streaming==0.13.0", "torch==2.13.0", "torchvision==0.28.0", "pyarrow"]],
}
CHECK = {"petastorm": "import petastorm.spark, pyspark, torch", "mosaic": "import streaming, torch"}
FEATURES = 784


def setup(name: str) -> dict[str, Any]:
    """Make (or reuse) the rival's venv; its python, or the exact error."""
    env = dict(os.environ)
    if name == "mosaic":  # the PyPI torch that matches PyPI's torchvision, not the local wheel
        env.update(PIP_CONFIG_FILE="/dev/null", PIP_CONSTRAINT="")
        env.pop("PIP_FIND_LINKS", None)
    return make_venv(VENVS / name, INSTALL[name], CHECK[name], env)


def _memory() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _report(rows: int, batches: int, started: float, rss: float) -> dict[str, Any]:
    seconds = time.perf_counter() - started
    _, peak = _memory()
    return {
        "rows": rows,
        "batches": batches,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "peak_rss_mb": peak,
        "grew_mb": peak - rss,
    }


def _petastorm_rank(converter: Any, rank: int, ranks: int, batch: int, out: Any) -> None:
    try:
        import torch

        rss, _ = _memory()
        started = time.perf_counter()
        rows = batches = 0
        with converter.make_torch_dataloader(
            batch_size=batch, num_epochs=1, cur_shard=rank, shard_count=ranks
        ) as loader:
            for item in loader:
                features = torch.as_tensor(item["features"]).reshape(-1, FEATURES)
                rows, batches = rows + len(features), batches + 1
        out.put((rank, _report(rows, batches, started, rss)))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc().strip().splitlines()[-1]}))


def petastorm(parquet: str, ranks: int, batch: int, work: Path) -> dict[str, Any]:
    """Petastorm's converter over a DataFrame of the rows; its readers on ``ranks`` processes."""
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    try:
        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, f"file://{work}/cache")
        frame = spark.read.parquet(parquet)
        started = time.perf_counter()
        converter = make_spark_converter(frame)
        materialise = time.perf_counter() - started
        try:
            results = _at_once(_petastorm_rank, (converter,), ranks, batch)
        finally:
            converter.delete()
    finally:
        spark.stop()
    return {"materialise_s": materialise, "ranks": results}


def _mosaic_rank(where: tuple[str, int], rank: int, ranks: int, batch: int, out: Any) -> None:
    local, port = where
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank))
        os.environ.update(LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        import torch
        from streaming import StreamingDataset
        from torch.utils.data import DataLoader

        rss, _ = _memory()
        started = time.perf_counter()
        dataset = StreamingDataset(local=local, batch_size=batch, shuffle=True)
        rows = batches = 0
        for item in DataLoader(dataset, batch_size=batch, num_workers=0):
            features = torch.as_tensor(item["features"])
            rows, batches = rows + len(features), batches + 1
        out.put((rank, _report(rows, batches, started, rss)))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc().strip().splitlines()[-1]}))


def mosaic(parquet: str, ranks: int, batch: int, work: Path) -> dict[str, Any]:
    """MDS shards written from the rows; Mosaic's StreamingDataset on ``ranks`` processes."""
    import numpy as np
    import pyarrow.parquet as pq
    from streaming import MDSWriter
    from streaming.base.util import clean_stale_shared_memory

    local = work / "mds"
    shutil.rmtree(local, ignore_errors=True)
    clean_stale_shared_memory()
    started = time.perf_counter()
    columns = {"features": f"ndarray:float32:{FEATURES}", "label": "int64"}
    with MDSWriter(out=str(local), columns=columns) as writer:
        for file in sorted(Path(parquet).glob("*.parquet")):
            for part in pq.ParquetFile(file).iter_batches(batch_size=4096):
                features = part.column(0).flatten().to_numpy().reshape(-1, FEATURES)
                for row, label in zip(features, part.column(1).to_numpy(), strict=True):
                    writer.write({"features": np.ascontiguousarray(row), "label": int(label)})
    materialise = time.perf_counter() - started
    try:
        results = _at_once(_mosaic_rank, ((str(local), _free_port()),), ranks, batch)
    finally:
        clean_stale_shared_memory()
        shutil.rmtree(local, ignore_errors=True)
    return {"materialise_s": materialise, "ranks": results}


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _at_once(target: Any, args: tuple[Any, ...], ranks: int, batch: int) -> list[dict[str, Any]]:
    """Run ``target`` on ``ranks`` processes at once; their reports in rank order."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    procs = [
        context.Process(target=target, args=(*args, r, ranks, batch, out)) for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    try:
        found = dict(out.get(timeout=3600) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [v["error"] for v in found.values() if "error" in v]
    if errors:
        raise RuntimeError(errors[0])
    return [found[r] for r in range(ranks)]


def _versions(name: str) -> dict[str, str]:
    from importlib.metadata import version

    names = {
        "petastorm": ["petastorm", "pyarrow", "pyspark", "torch"],
        "mosaic": ["mosaicml-streaming", "torch"],
    }[name]
    return {n: version(n) for n in names}


def main() -> int:
    """``setup NAME``, or measure NAME (see the module doc); one JSON line at the end."""
    if len(sys.argv) == 3 and sys.argv[1] == "setup":
        print(json.dumps(setup(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rival", choices=["petastorm", "mosaic"])
    parser.add_argument("--parquet", required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"rival": args.rival, "error": None}
    try:
        result["versions"] = _versions(args.rival)
        run = petastorm if args.rival == "petastorm" else mosaic
        result.update(run(args.parquet, args.ranks, args.batch, work))
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[-800:]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
