"""DataLoader workers against a plain scan: rows per second and the process tree's memory.

The method of issue 37: Parquet of 784 float32 ``features`` plus an int64 ``label`` (50,000 rows
a file, row groups of 10,000), read by one consumer that sums every batch of 256, in a fresh
process per measurement, the readers interleaved over ``--rounds`` rounds (the data in the page
cache: a first untimed pass reads it once). Rows per second are steady ones, from the first batch
to the last; memory is the process tree's peak (the consumer and its workers, sampled by this
process every 100 ms): RSS summed, which counts pages that a forked worker shares with the rank in
both, and PSS summed (each shared page split between its processes), the memory the tree holds.

Readers: a plain ``pyarrow`` ``iter_batches`` into tensors in one process (the limit of one
core); ``sparktrain.data.from_parquet`` iterated in the process (shuffled, the default); and
``ds.loader(num_workers=2)`` with each hand-off: ``processes`` (the default: reused slots),
``threads``, and ``torch`` (torch's own DataLoader workers). Then the readers with a Python
``transform``, and the reader in the process with and without reading ahead (``read_ahead``)
under a light step (a sum) and heavier ones (matrix products).

    python benchmarks/data_workers.py                   # 200,000 and 1,000,000 rows
    python benchmarks/data_workers.py --rows 200000 --rounds 1   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import log

FEATURES = 784
BATCH = 256
FILE_ROWS = 50_000
GROUP_ROWS = 10_000
READERS = ("plain", "in-process", "processes", "threads", "torch")


def generate(folder: Path, rows: int) -> Path:
    """The data, written once per size (kept in ``folder``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    target = folder / f"rows-{rows}"
    if (target / "_done").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    for number, first in enumerate(range(0, rows, FILE_ROWS)):
        count = min(FILE_ROWS, rows - first)
        features = generator.random((count, FEATURES), dtype=np.float32).ravel()
        table = pa.table(
            {
                "features": pa.FixedSizeListArray.from_arrays(pa.array(features), FEATURES),
                "label": np.arange(first, first + count, dtype=np.int64),
            }
        )
        pq.write_table(table, target / f"part-{number:04d}.parquet", row_group_size=GROUP_ROWS)
    (target / "_done").touch()
    return target


CONSUMER = r"""
import json, sys, time
kind, path, python_work = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
step, ahead = sys.argv[4], int(sys.argv[5])  # the rank's work on each batch; read_ahead
import torch
weights = torch.randn(784, int(step)) if step != "sum" else None
def tokenise(batch):  # Python work on every row, as a tokeniser or augmentation in Python does
    batch["n"] = torch.tensor([sum(range(300)) for _ in range(len(batch["label"]))])
    return batch
total, rows, first = 0.0, 0, None
if kind == "plain":
    import glob
    import pyarrow.parquet as pq
    def batches():
        for file in sorted(glob.glob(path + "/*.parquet")):
            handle = pq.ParquetFile(file, pre_buffer=False)
            for batch in handle.iter_batches(batch_size=256, use_threads=False):
                flat = batch.column(0).flatten().to_numpy()
                yield {"features": torch.from_numpy(flat).reshape(len(batch), 784)}
else:
    from sparktrain.data import from_parquet
    ds = from_parquet(
        path, batch_size=256, world_size=1, rank=0, read_ahead=ahead,
        transform=tokenise if python_work else None,
    )
    def batches():
        if kind == "in-process":
            return iter(ds)
        return iter(ds.loader(2, workers=kind))
for batch in batches():
    features = batch["features"]
    total += float(features.sum() if weights is None else (features @ weights).sum())
    if first is None:
        first, first_rows = time.monotonic(), len(features)
    rows += len(features)
seconds = time.monotonic() - first
print(json.dumps({"rows": rows, "rate": (rows - first_rows) / seconds, "checksum": total}))
"""


def _tree(root: int) -> list[int]:
    """``root`` and its descendants, from the kernel's children lists (no scan of /proc)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                todo += [
                    int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                ]
            except OSError:
                continue
    return found


def _memory(pids: list[int]) -> tuple[int, int]:
    rss = pss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        except OSError:
            continue
    return rss, pss


def measure(
    kind: str, path: Path, python_work: bool = False, step: str = "sum", ahead: int = 2
) -> dict[str, Any]:
    """One fresh consumer process reading one epoch; its rate and the tree's peak memory.

    ``step``: the consumer's work on each batch, ``"sum"`` or the width of a matrix product
    (``"1024"``: a product with a 784 x 1,024 matrix); ``ahead``: sparktrain's ``read_ahead``.
    """
    process = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, kind, str(path), str(int(python_work)), step, str(ahead)],
        stdout=subprocess.PIPE,
        text=True,
    )
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss, pss = _memory(_tree(process.pid))
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate(timeout=1800)
    done.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{kind} failed (exit {process.returncode})")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result.update(rss=peak[0], pss=peak[1])
    return result


def table(work: Path, sizes: list[int], rounds: int) -> dict[int, dict[str, dict[str, float]]]:
    """Every reader on every size, interleaved; the median of each, printed as a table."""
    results: dict[int, dict[str, dict[str, float]]] = {}
    for rows in sizes:
        path = generate(work, rows)
        measure("plain", path)  # the data into the page cache: every reader then reads it warm
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in READERS}
        for round_number in range(rounds):
            for kind in READERS:
                found = measure(kind, path)
                if found["rows"] != rows:
                    raise RuntimeError(f"{kind} read {found['rows']} rows, not {rows}")
                runs[kind].append(found)
                log(f"{rows} rows, round {round_number + 1}, {kind}: {found['rate']:,.0f} rows/s")
        results[rows] = {
            kind: {
                "rate": statistics.median(r["rate"] for r in found),
                "rss": statistics.median(r["rss"] for r in found),
                "pss": statistics.median(r["pss"] for r in found),
            }
            for kind, found in runs.items()
        }
    _print(results, sizes, rounds)
    return results


def _print(results: dict[int, dict[str, dict[str, float]]], sizes: list[int], rounds: int) -> None:
    mb = 1 << 20
    labels = {
        "plain": "plain pyarrow iter_batches, one process",
        "in-process": "from_parquet iterated in the process (shuffled)",
        "processes": "ds.loader(num_workers=2), workers='processes'",
        "threads": "ds.loader(num_workers=2), workers='threads'",
        "torch": "ds.loader(num_workers=2), workers='torch'",
    }
    print(
        f"\nDataLoader workers, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs: rows of 784 "
        f"float32 + label, batches of 256 summed by one consumer, median of {rounds} "
        f"interleaved rounds, warm page cache"
    )
    sized = " / ".join(f"{n:,}" for n in sizes)
    print(f"\n| reader | rows/s ({sized}) | x plain scan | peak RSS of the tree, MB | PSS, MB |")
    print("| --- | --- | --- | --- | --- |")
    for kind in READERS:
        rates = " / ".join(f"{results[n][kind]['rate']:,.0f}" for n in sizes)
        ratios = " / ".join(
            f"{results[n][kind]['rate'] / results[n]['plain']['rate']:.2f}" for n in sizes
        )
        rss = " / ".join(f"{results[n][kind]['rss'] / mb:.0f}" for n in sizes)
        pss = " / ".join(f"{results[n][kind]['pss'] / mb:.0f}" for n in sizes)
        print(f"| {labels[kind]} | {rates} | {ratios} | {rss} | {pss} |")
    for n in sizes:
        found = results[n]
        ratio = found["processes"]["rate"] / found["plain"]["rate"]
        single = found["in-process"]["rate"] / found["plain"]["rate"]
        memory = found["processes"]["pss"] / found["in-process"]["pss"]
        print(
            f"\n{n:,} rows: workers='processes' {ratio:.2f}x the plain scan (target >= 1.0, aim "
            f"1.5): {'PASS' if ratio >= 1.0 else 'MISS'}; in-process {single:.2f}x (>= 0.95): "
            f"{'PASS' if single >= 0.95 else 'MISS'}; the tree's PSS {memory:.2f}x the single "
            f"process's (<= 1.5): {'PASS' if memory <= 1.5 else 'MISS'}"
        )


def transform_table(work: Path, rows: int, rounds: int) -> dict[str, float]:
    """The readers again with a Python ``transform`` (the GIL's share): rows/s, the median."""
    path = generate(work, rows)
    kinds = ("in-process", "processes", "threads", "torch")
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            runs[kind].append(measure(kind, path, python_work=True)["rate"])
    rates = {kind: statistics.median(found) for kind, found in runs.items()}
    print(f"\nWith a transform doing Python work on every row ({rows:,} rows):\n")
    print("| reader | rows/s | x in the process |\n| --- | ---: | ---: |")
    for kind, rate in rates.items():
        print(f"| {kind} | {rate:,.0f} | {rate / rates['in-process']:.2f} |")
    return rates


def ahead_table(work: Path, rows: int, rounds: int) -> dict[str, dict[str, float]]:
    """The reader in the process with and without reading ahead, under lighter and heavier steps.

    Each x is against the plain scan with the same step, in the same rounds.
    """
    path = generate(work, rows)
    steps = {"sum": "a sum", "128": "a 784 x 128 matrix product", "1024": "a 784 x 1,024 one"}
    readers = (("plain", 0), ("in-process", 0), ("in-process", 2))
    runs: dict[str, dict[str, list[float]]] = {
        s: {f"{k} {a}": [] for k, a in readers} for s in steps
    }
    for _ in range(rounds):
        for step in steps:
            for kind, ahead in readers:
                found = measure(kind, path, step=step, ahead=ahead)["rate"]
                runs[step][f"{kind} {ahead}"].append(found)
    rates = {s: {k: statistics.median(v) for k, v in found.items()} for s, found in runs.items()}
    print(f"\nReading ahead in the process ({rows:,} rows), x the plain scan with the same step:\n")
    print("| the consumer's work on each batch | plain rows/s | read_ahead=0 | read_ahead=2 |")
    print("| --- | ---: | ---: | ---: |")
    for step, label in steps.items():
        found = rates[step]
        plain = found["plain 0"]
        print(
            f"| {label} | {plain:,.0f} | {found['in-process 0'] / plain:.2f} | "
            f"{found['in-process 2'] / plain:.2f} |"
        )
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="200000,1000000", help="sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median")
    parser.add_argument("--work", default=None, help="where the data is kept")
    args = parser.parse_args(argv)
    work = Path(args.work or Path(tempfile.gettempdir()) / "sparktrain-data-workers")
    sizes = [int(s) for s in args.rows.split(",") if s]
    table(work, sizes, args.rounds)
    if sizes:
        transform_table(work, sizes[0], args.rounds)
        ahead_table(work, sizes[0], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
