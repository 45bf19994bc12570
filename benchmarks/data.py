"""Data benchmark: rows per second per rank delivered as tensors, and peak memory per rank.

One run generates Parquet data (rows of 784 float32 ``features`` as ``list<float32>`` plus an
int64 ``label``; files of about 128 MB, row groups of about 32 MB, the layout sparktrain's
DataFrame cache writes) and reads one epoch of it on 2 ranks at once, batches of 256, with:

* (a) ``bare``: a bare pyarrow scan into tensors (``ParquetFile.iter_batches`` with
  ``pre_buffer=False``, rank r reading row groups r, r+2, ...): the limit;
* (b) ``sparktrain``: ``sparktrain.data.from_parquet`` with its defaults (shuffled), and again
  with ``shuffle=False``;
* (c) ``petastorm``: Petastorm's ``make_spark_converter`` and ``make_torch_dataloader``;
* (d) ``mosaic``: Mosaic Streaming's ``StreamingDataset`` over MDS shards written from the rows;
* (e) ``old``: sparktrain's previous ``train_on_dataframe`` (commit ``OLD_COMMIT``, checked out
  in a temporary git worktree), on the first ``--old-rows`` rows only: it converts rows with
  Python loops and holds about 15 times its share in memory.

(a) and (b) run ``--repeat`` times, interleaved, and the median run is shown. (a), (b) and (e)
run inside ranks started by ``sparktrain.launch``/``TorchDistributor`` (2
processes); (c) and (d) run in their own virtual environments (``benchmarks/data_rivals.py``:
Petastorm needs pyarrow 14, Mosaic pulls a torchvision that replaces the CPU torch), 2 reader
processes at once. Seconds count from the rank's first read to its last batch; peak RSS is the
rank's high-water mark (``VmHWM``), and "grew" is that minus its RSS before the first read.

Then:

* the time to materialise a DataFrame (``spark.read.parquet`` of the data) as Parquet:
  ``sparktrain.data.materialise`` against Petastorm's ``make_spark_converter``;
* (a) and (b) at each of ``--sizes`` GB (default 1 and 8): peak RSS per rank must not grow
  with the data (within 20 %);
* DataLoader workers (``benchmarks/data_workers.py``, the method of issue 37, one consumer):
  ``ds.loader(num_workers=2)`` with each hand-off against a plain single-process scan, at
  ``--workers-rows`` rows (targets: the default workers >= 1.0x the plain scan, the reader in
  the process >= 0.95x, the process tree's PSS with workers <= 1.5x the single process's).

A reader's rows per second per rank is every rank's rows over the slowest rank's seconds,
divided by the ranks (so a reader that gives one rank fewer rows gains nothing from it).
Targets (printed with PASS/MISS): (b) >= 0.8 x (a); (b) >= 2 x (c) and >= 1 x (d); (b)'s peak
RSS at the largest size within 20 % of the smallest; sparktrain's materialisation time <=
Petastorm's.

    python benchmarks/data.py                      # 1,000,000 rows, then 1 and 8 GB: ~15 min
    python benchmarks/data.py --rows 50000 --sizes 0.2 --skip-rivals --repeat 1   # a smoke test
    python benchmarks/data.py --only-sizes --sizes 30 --keep   # by hand: more than the memory
    python benchmarks/data.py --only-workers       # only the DataLoader workers' table
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import data_workers
from _common import fmt, log, ratio

FEATURES = 784
BATCH = 256
ROW_BYTES = FEATURES * 4 + 8
FILE_ROWS = 128 * 1024 * 1024 // ROW_BYTES
GROUP_ROWS = 32 * 1024 * 1024 // ROW_BYTES
OLD_COMMIT = "4cabe90"
HERE = Path(__file__).resolve().parent


def generate(folder: Path, rows: int) -> None:
    """Write ``rows`` random rows as Parquet files under ``folder`` (skipped if already there)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    marker = folder / "_rows"
    if marker.exists() and int(marker.read_text()) == rows:
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    generator = np.random.default_rng(0)
    started = time.monotonic()
    for number, first in enumerate(range(0, rows, FILE_ROWS)):
        count = min(FILE_ROWS, rows - first)
        values = pa.array(generator.random(count * FEATURES, dtype=np.float32))
        offsets = pa.array(np.arange(0, count * FEATURES + 1, FEATURES, dtype=np.int32))
        table = pa.table({"features": pa.ListArray.from_arrays(offsets, values),
                          "label": np.arange(first, first + count, dtype=np.int64)})  # fmt: skip
        pq.write_table(table, folder / f"part-{number:05d}.parquet", row_group_size=GROUP_ROWS)
    marker.write_text(str(rows))
    log(f"generated {rows:,} rows in {folder} in {time.monotonic() - started:.0f} s")


def _memory() -> tuple[float, float]:
    """This process's RSS and its high-water mark, in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def read_epoch(kind: str, path: str) -> dict[str, Any]:
    """Inside a rank: read one epoch of ``path`` as tensors; rows, seconds and memory."""
    import torch

    start_rss, _ = _memory()
    started = time.perf_counter()
    rows = batches = 0
    if kind == "bare":
        import pyarrow.parquet as pq

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        files = sorted(p for p in Path(path).glob("*.parquet"))
        groups = [(f, g) for f in files for g in range(pq.ParquetFile(f).num_row_groups)]
        for file, group in groups[rank::world]:
            handle = pq.ParquetFile(file, pre_buffer=False)
            for batch in handle.iter_batches(batch_size=BATCH, row_groups=[group]):
                values = batch.column(0).flatten().to_numpy()
                features = torch.from_numpy(values).reshape(-1, FEATURES)
                label = torch.from_numpy(batch.column(1).to_numpy())
                rows, batches = rows + len(label), batches + 1
                assert features.shape[0] == len(label)
    else:
        from sparktrain.data import from_parquet

        for batch in from_parquet(path, batch_size=BATCH, shuffle=kind == "sparktrain"):
            assert batch["features"].shape[1] == FEATURES
            rows, batches = rows + len(batch["label"]), batches + 1
    seconds = time.perf_counter() - started
    _, peak = _memory()
    return {"rows": rows, "batches": batches, "seconds": seconds, "rows_per_s": rows / seconds,
            "peak_rss_mb": peak, "grew_mb": peak - start_rss}  # fmt: skip


def ours(kind: str, path: Path) -> list[dict[str, Any]]:
    """(a) or (b) on 2 ranks started by sparktrain.launch."""
    import sparktrain

    result = sparktrain.launch(read_epoch, (kind, str(path)), num_processes=2, return_all=True)
    return [result.return_values[r] for r in sorted(result.return_values)]


OLD_SCRIPT = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[3])
from pyspark.sql import SparkSession
from sparktrain import TorchDistributor
from data import _memory

def main():
    import torch
    from sparktrain.data import rank_dataloader
    start_rss, _ = _memory()
    started = time.perf_counter()
    rows = batches = 0
    for features, label in rank_dataloader(256):
        rows, batches = rows + len(label), batches + 1
    seconds = time.perf_counter() - started
    _, peak = _memory()
    return {"rows": rows, "batches": batches, "seconds": seconds, "rows_per_s": rows / seconds,
            "peak_rss_mb": peak, "grew_mb": peak - start_rss}

spark = (SparkSession.builder.master("local[2]").config("spark.driver.memory", "8g")
         .config("spark.driver.host", "127.0.0.1").getOrCreate())
df = spark.read.parquet(sys.argv[1]).orderBy("label").limit(int(sys.argv[2]))
from sparktrain import launch
result = launch(main, num_processes=2, dataframe=df, return_all=True)
print(json.dumps([result.return_values[r] for r in sorted(result.return_values)]))
spark.stop()
"""


def old(path: Path, rows: int, work: Path) -> list[dict[str, Any]] | str:
    """(e): the previous train_on_dataframe, from a git worktree of ``OLD_COMMIT``."""
    tree = work / "old-worktree"
    repo = HERE.parent
    try:
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree),
                        OLD_COMMIT], check=True, capture_output=True)  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        done = subprocess.run(
            [sys.executable, "-c", OLD_SCRIPT, str(path), str(rows), str(HERE)],
            env=env, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"
        return list(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                       check=False, capture_output=True)  # fmt: skip


def rival(name: str, path: Path, work: Path) -> dict[str, Any]:
    """(c) or (d) through ``data_rivals.py`` in the rival's own virtual environment."""
    script = str(HERE / "data_rivals.py")
    setup = subprocess.run([sys.executable, script, "setup", name], capture_output=True,
                           text=True, check=False)  # fmt: skip
    try:
        found = json.loads(setup.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"setup failed: {setup.stderr.strip()[-500:]}"}
    if found.get("error"):
        return {"error": found["error"]}
    done = subprocess.run(
        [found["python"], script, name, "--parquet", str(path), "--ranks", "2", "--batch",
         str(BATCH), "--work", str(work / name)],
        capture_output=True, text=True, timeout=3600, check=False,
    )  # fmt: skip
    try:
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        return {"error": done.stderr.strip()[-500:] or "no output"}


def materialise_ours(path: Path, work: Path) -> float:
    """Seconds for sparktrain to have Spark write ``spark.read.parquet(path)`` to its cache."""
    from pyspark.sql import SparkSession

    from sparktrain import data

    builder = SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
    spark = builder.config("spark.driver.memory", "4g").getOrCreate()
    try:
        frame = spark.read.parquet(str(path))
        started = time.perf_counter()
        folder = data.materialise(frame, cache_dir=str(work / "cache"))
        seconds = time.perf_counter() - started
        data.delete_cache(folder)
        return seconds
    finally:
        spark.stop()


def _rate(ranks: list[dict[str, Any]]) -> float:
    """Every rank's rows over the slowest rank's seconds, per rank (a rank that got fewer rows,
    as Petastorm's may, does not make the reader look faster)."""
    return sum(r["rows"] for r in ranks) / max(r["seconds"] for r in ranks) / len(ranks)


def _median(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run whose rate is the median of ``runs`` (each run: every rank's record)."""
    ordered = sorted(runs, key=_rate)
    rates = ", ".join(f"{_rate(r):,.0f}" for r in runs)
    log(f"rates of the {len(runs)} runs: {rates}")
    return ordered[len(ordered) // 2]


def _line(label: str, ranks: list[dict[str, Any]] | str | None) -> float | None:
    if not isinstance(ranks, list):
        print(f"  {label:<44} error: {ranks}")
        return None
    rate = _rate(ranks)
    cells = "  ".join(
        f"r{i}: {r['rows']:>9,} rows {r['rows_per_s']:>9,.0f}/s peak {r['peak_rss_mb']:>6,.0f} MB "
        f"grew {r['grew_mb']:>6,.0f}" for i, r in enumerate(ranks)
    )  # fmt: skip
    print(f"  {label:<44} {rate:>9,.0f} rows/s a rank   {cells}")
    return rate


def _verdict(name: str, value: float | None, target: str, ok: bool) -> None:
    print(f"  {name:<44} {fmt(value):>8}  target {target:<8} {'PASS' if ok else 'MISS'}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the main table")
    parser.add_argument("--repeat", type=int, default=3, help="runs of (a) and (b); the median")
    parser.add_argument("--old-rows", type=int, default=50_000, help="rows (e) reads")
    parser.add_argument("--sizes", default="1,8", help="GB sizes for the memory table")
    parser.add_argument("--work", default=None, help="folder for the data (default: a temp one)")
    parser.add_argument("--skip-rivals", action="store_true", help="leave out (c) and (d)")
    parser.add_argument("--only-sizes", action="store_true", help="only the memory table")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    parser.add_argument("--workers-rows", default="200000,1000000", help="sizes, workers' table")
    parser.add_argument("--workers-rounds", type=int, default=3, help="rounds, workers' table")
    parser.add_argument("--only-workers", action="store_true", help="only the workers' table")
    args = parser.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="sparktrain-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        # The workers' table first, while this process has not loaded torch: a library page
        # mapped by this process too would count half to it in a consumer's PSS, and the
        # workers' tree (three sharers) would look larger against the single process (1.50x
        # against 1.41x standalone, 2026-11-28).
        if not args.only_sizes:
            sizes = [int(s) for s in args.workers_rows.split(",") if s]
            data_workers.table(work / "workers", sizes, args.workers_rounds)
            data_workers.transform_table(work / "workers", sizes[0], args.workers_rounds)
        if not (args.only_sizes or args.only_workers):
            main_table(work, args)
        if not args.only_workers:
            size_table(work, [float(s) for s in args.sizes.split(",") if s])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def main_table(work: Path, args: argparse.Namespace) -> None:
    """The five readers on the same ``--rows`` rows, then the targets."""
    path = work / f"rows-{args.rows}"
    generate(path, args.rows)
    mb = args.rows * ROW_BYTES / 1e6
    print(f"\n{args.rows:,} rows ({mb:,.0f} MB), 2 ranks at once, batches of {BATCH}:")
    runs: dict[str, list[list[dict[str, Any]]]] = {"bare": [], "sparktrain": [], "inorder": []}
    for _ in range(args.repeat):  # interleaved, so that a noisy moment hits every reader
        for kind, found in runs.items():
            found.append(ours(kind, path))
    bare = _line("(a) bare pyarrow scan into tensors", _median(runs["bare"]))
    mine = _line("(b) sparktrain.data.from_parquet", _median(runs["sparktrain"]))
    _line("(b) ... with shuffle=False", _median(runs["inorder"]))
    peta: dict[str, Any] = {"error": "skipped (--skip-rivals)"}
    mosaic: dict[str, Any] = {"error": "skipped (--skip-rivals)"}
    if not args.skip_rivals:
        peta, mosaic = rival("petastorm", path, work), rival("mosaic", path, work)
    c = _line("(c) petastorm make_spark_converter", peta.get("ranks") or peta.get("error"))
    d = _line("(d) mosaic StreamingDataset (MDS)", mosaic.get("ranks") or mosaic.get("error"))
    e = _line(
        f"(e) old train_on_dataframe ({args.old_rows:,} rows)", old(path, args.old_rows, work)
    )
    ours_s = materialise_ours(path, work)
    print(f"\nmaterialise a DataFrame of the same rows: sparktrain {ours_s:.1f} s, "
          f"petastorm {fmt(peta.get('materialise_s'))} s; MDS written in "
          f"{fmt(mosaic.get('materialise_s'))} s")  # fmt: skip
    print("\ntargets:")
    _verdict("(b) / (a)", ratio(mine, bare), ">= 0.8", (ratio(mine, bare) or 0) >= 0.8)
    _verdict("(b) / (c)", ratio(mine, c), ">= 2", (ratio(mine, c) or 0) >= 2)
    _verdict("(b) / (d)", ratio(mine, d), ">= 1", (ratio(mine, d) or 0) >= 1)
    _verdict("(b) / (e)", ratio(mine, e), "(info)", True)
    peta_s = peta.get("materialise_s")
    _verdict("materialise petastorm / sparktrain", ratio(peta_s, ours_s), ">= 1",
             (ratio(peta_s, ours_s) or 0) >= 1)  # fmt: skip
    shutil.rmtree(path, ignore_errors=True) if not args.keep else None


def size_table(work: Path, sizes: list[float]) -> None:
    """(a) and (b) at each size: does a rank's memory grow with the data?"""
    if not sizes:
        return
    print(f"\nmemory per rank by data size (2 ranks, batches of {BATCH}):")
    peaks: list[float] = []
    for size in sizes:
        rows = int(size * 1e9 / ROW_BYTES)
        path = work / f"rows-{rows}"
        started = time.monotonic()
        generate(path, rows)
        _line(f"(a) {size:g} GB", ours("bare", path))
        wall = time.monotonic()
        ranks = ours("sparktrain", path)
        _line(f"(b) {size:g} GB (epoch {time.monotonic() - wall:.0f} s)", ranks)
        peaks.append(max(r["peak_rss_mb"] for r in ranks))
        log(f"{size:g} GB done in {time.monotonic() - started:.0f} s")
        shutil.rmtree(path, ignore_errors=True)
    if len(peaks) > 1:
        growth = peaks[-1] / peaks[0]
        _verdict(f"(b) peak RSS {sizes[-1]:g} GB / {sizes[0]:g} GB", growth, "<= 1.2",
                 growth <= 1.2)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
