"""How close each reader's shuffled order is to a uniform random permutation.

The data: ``--rows`` rows numbered in storage order, in files of 50,000 rows and row groups of
``--group`` rows (the layout of issue 37: 1,000,000 rows, groups of 10,000). Each reader's order
of one epoch on one rank is taken, and two statistics of it are printed, each 1.00 for a uniform
random permutation (its expectation) and near 0 for the storage order:

* **neighbours**: the mean distance, in the output, between two rows adjacent in storage, over
  ``(N + 1) / 3``, what a uniform permutation gives. Low: rows stored together arrive together.
* **batch spread**: the mean number of distinct row groups in a batch of 256 rows, over what a
  uniform permutation gives (``G * (1 - (1 - 1/G) ** 256)`` for ``G`` groups). Low: a batch
  holds few groups, so a table stored sorted (by label, by time) gives one-sided batches.

Readers:

* sparktrain ``from_parquet`` (the real reader over a Parquet file of the ids): the default
  ``shuffle_buffer`` (2,048 rows) and a larger one;
* Petastorm 0.13.1's ``make_torch_dataloader`` algorithm: row groups in a random order
  (``shuffle_row_groups=True``), each group's rows added to its ``RandomShufflingBuffer`` with
  ``min_after_retrieve = capacity - 1``, as ``petastorm.pytorch.DataLoader`` does; its default
  ``shuffling_queue_capacity=0`` (no row shuffle) and 2,048 and 65,536 rows. Petastorm's own
  ``shuffling_buffer.py`` is run, loaded from its wheel (the package itself needs pyarrow<15);
* Mosaic Streaming 0.13.0's default ``py1e`` shuffle on one node (``num_canonical_nodes=1``,
  ``shuffle_block_size`` = 4,000,000, its defaults there) over shards of 10,000 samples, run
  from its wheel's ``streaming/base/shuffle`` modules.

    python benchmarks/shuffle_quality.py               # prints the table
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

BATCH = 256
WHEELS = {"petastorm": "petastorm==0.13.1", "mosaic": "mosaicml-streaming==0.13.0"}


def unpack(name: str, work: Path) -> Path:
    """The rival's wheel, downloaded without dependencies and unzipped under ``work``."""
    target = work / name
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEELS[name], "-d", target],
        check=True,
    )
    wheel = next(target.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(target)], check=True)
    return target


def load(path: Path, name: str) -> types.ModuleType:
    """The module file ``path`` as ``name`` (its parent packages made empty ones)."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:depth]), types.ModuleType(".".join(parts[:depth])))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def ours(rows: int, group: int, work: Path, window: int) -> np.ndarray:
    """sparktrain's order of one epoch (the real reader, over the ids)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sparktrain.data import from_parquet

    folder = work / "ids"
    if not folder.exists():
        folder.mkdir()
        for number, first in enumerate(range(0, rows, 50_000)):
            ids = pa.table({"id": np.arange(first, min(rows, first + 50_000))})
            pq.write_table(ids, folder / f"part-{number:04d}.parquet", row_group_size=group)
    dataset = from_parquet(folder, batch_size=BATCH, world_size=1, rank=0, shuffle_buffer=window)
    return np.concatenate([batch["id"].numpy() for batch in dataset])


def petastorm(rows: int, group: int, capacity: int, rival: Path, seed: int = 0) -> np.ndarray:
    """Petastorm's order: shuffled row groups through its ``RandomShufflingBuffer``."""
    buffers = load(rival / "petastorm/reader_impl/shuffling_buffer.py", "petastorm_buffers")
    np.random.seed(seed)  # the buffer draws from numpy's global generator
    groups = np.random.permutation(-(-rows // group))
    if capacity == 0:
        return np.concatenate([np.arange(g * group, min(rows, (g + 1) * group)) for g in groups])
    buffer = buffers.RandomShufflingBuffer(capacity, capacity - 1, extra_capacity=100_000_000)
    out: list[int] = []
    for g in groups:
        buffer.add_many(list(range(g * group, min(rows, (g + 1) * group))))
        while buffer.can_retrieve():
            out.append(buffer.retrieve())
    buffer.finish()
    while buffer.can_retrieve():
        out.append(buffer.retrieve())
    return np.array(out)


def mosaic(rows: int, group: int, rival: Path) -> np.ndarray:
    """Mosaic Streaming's default order on one node (``py1e``)."""
    base = rival / "streaming/base/shuffle"
    load(base / "py1s.py", "streaming.base.shuffle.py1s")
    py1e = load(base / "py1e.py", "streaming.base.shuffle.py1e")
    sizes = np.array([min(group, rows - first) for first in range(0, rows, group)], np.int64)
    return np.asarray(py1e.get_shuffle_py1e(sizes, 1, 9176, 0, 4_000_000))


def statistics(order: np.ndarray, rows: int, group: int) -> tuple[float, float]:
    """(neighbours, batch spread), each over a uniform permutation's expectation."""
    assert np.array_equal(np.sort(order), np.arange(rows)), "not a permutation of the rows"
    position = np.empty(rows, np.int64)
    position[order] = np.arange(rows)
    neighbours = np.abs(np.diff(position)).mean() / ((rows + 1) / 3)
    groups = -(-rows // group)
    whole = rows // BATCH * BATCH
    per_batch = np.sort((order[:whole] // group).reshape(-1, BATCH), axis=1)
    distinct = (np.diff(per_batch, axis=1) != 0).sum(axis=1) + 1
    uniform = groups * (1 - (1 - 1 / groups) ** BATCH)
    return float(neighbours), float(distinct.mean() / uniform)


def main(argv: list[str] | None = None) -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--group", type=int, default=10_000, help="rows a row group")
    args = parser.parse_args(argv)
    rows, group = args.rows, args.group
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        peta, mos = unpack("petastorm", work), unpack("mosaic", work)
        uniform = np.random.default_rng(1).permutation(rows)
        readers = [
            ("a uniform random permutation (numpy)", uniform),
            ("sparktrain from_parquet, shuffle_buffer=2048 (default)",
             ours(rows, group, work, 2048)),
            ("sparktrain from_parquet, shuffle_buffer=65536", ours(rows, group, work, 65536)),
            ("Petastorm make_torch_dataloader, shuffling_queue_capacity=0 (default)",
             petastorm(rows, group, 0, peta)),
            ("Petastorm, shuffling_queue_capacity=2048", petastorm(rows, group, 2048, peta)),
            ("Petastorm, shuffling_queue_capacity=65536", petastorm(rows, group, 65536, peta)),
            ("Mosaic Streaming py1e (default), one node", mosaic(rows, group, mos)),
        ]  # fmt: skip
        print(f"\n{rows:,} rows in row groups of {group:,}, batches of {BATCH}; "
              "1.00 = a uniform permutation\n")  # fmt: skip
        print("| order | neighbours | batch spread |\n| --- | ---: | ---: |")
        for label, order in readers:
            near, spread = statistics(order, rows, group)
            print(f"| {label} | {near:.3f} | {spread:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
