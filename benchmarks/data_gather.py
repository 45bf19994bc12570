"""The shuffled gather: torch ``index_select`` out of a window buffer, or Arrow's ``take``.

A shuffled window of ``shuffle_buffer`` rows (2,048 by default) arrives as decoded chunks of 256
rows. sparktrain copies the chunks into a reused window buffer of tensors and gathers each batch
with ``index_select`` (two copies). The alternative is to gather inside Arrow: ``take`` the
batch's rows from the window's chunks and turn the result into tensors (no window buffer). Both
are timed here in one process, interleaved, on rows of 784 float32 plus an int64 label, batches
of 256, one thread (as a DataLoader worker runs).

    python benchmarks/data_gather.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

WINDOW, CHUNK, BATCH, FEATURES = 2048, 256, 256, 784


def _tensors(table: Any) -> dict[str, Any]:
    import pyarrow as pa
    import torch

    x = table.column("x")
    x = x.combine_chunks() if isinstance(x, pa.ChunkedArray) else x
    values = x.values.to_numpy(zero_copy_only=False).reshape(-1, FEATURES)
    return {"x": torch.from_numpy(values), "y": torch.from_numpy(table.column("y").to_numpy())}


def readers(chunks: list[Any], rng: np.random.Generator) -> dict[str, Callable[[], float]]:
    """The three ways to gather one window's batches (each returns a checksum)."""
    import pyarrow as pa
    import torch

    buffer = {"x": torch.empty(WINDOW, FEATURES), "y": torch.empty(WINDOW, dtype=torch.int64)}

    def index_select() -> float:  # sparktrain's: chunks into the window buffer, then gather
        start = 0
        for chunk in chunks:
            for name, value in _tensors(chunk).items():
                buffer[name][start : start + len(value)] = value
            start += chunk.num_rows
        order = torch.from_numpy(rng.permutation(WINDOW))
        total = 0.0
        for first in range(0, WINDOW, BATCH):
            picked = order[first : first + BATCH]
            batch = {k: v.index_select(0, picked) for k, v in buffer.items()}
            total += float(batch["x"][0, 0])
        return total

    def take(combine: bool) -> Callable[[], float]:
        def run() -> float:
            window = pa.concat_tables(chunks)
            window = window.combine_chunks() if combine else window
            order = rng.permutation(WINDOW)
            total = 0.0
            for first in range(0, WINDOW, BATCH):
                batch = _tensors(window.take(order[first : first + BATCH]))
                total += float(batch["x"][0, 0])
            return total

        return run

    return {
        "torch index_select from a window buffer (sparktrain's)": index_select,
        "Arrow take from the window's chunks": take(False),
        "Arrow take after combine_chunks": take(True),
    }


def main(argv: list[str] | None = None) -> int:
    """Print rows/s of each, the median of ``--rounds`` interleaved rounds."""
    import pyarrow as pa
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--windows", type=int, default=100, help="windows a round")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    chunks = [
        pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(
                    pa.array(rng.random(CHUNK * FEATURES, dtype=np.float32)), FEATURES
                ),
                "y": pa.array(np.arange(CHUNK)),
            }
        )
        for _ in range(WINDOW // CHUNK)
    ]
    ways = readers(chunks, rng)
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, run in ways.items():
            began = time.perf_counter()
            for _ in range(args.windows):
                run()
            rates[name].append(args.windows * WINDOW / (time.perf_counter() - began))
    base = statistics.median(rates[next(iter(ways))])
    print(f"\nwindows of {WINDOW} rows of {FEATURES} float32, batches of {BATCH}, one thread, "
          f"median of {args.rounds} interleaved rounds\n")  # fmt: skip
    print("| gather | rows/s | x index_select |\n| --- | ---: | ---: |")
    for name, found in rates.items():
        rate = statistics.median(found)
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
