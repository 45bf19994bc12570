"""Arrow tables: split rows among ranks, pad shares to one length, write and read shares.

Used by the driver (local mode) and by Spark tasks; needs pyarrow (the ``spark`` extra).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sparktrain.errors import ConfigError


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ImportError as exc:  # pragma: no cover - the spark extra brings it
        raise ConfigError(
            "training on a DataFrame needs pyarrow: pip install 'sparktrain[spark]'"
        ) from exc
    return pyarrow


def concat(batches: Iterable[Any], schema: Any = None) -> Any:
    """One table from record batches (an empty table of ``schema`` when there are none)."""
    pa = _pyarrow()
    batches = list(batches)
    if not batches:
        return pa.Table.from_batches([], schema=schema) if schema is not None else pa.table({})
    return pa.Table.from_batches(batches)


def split(table: Any, parts: int) -> list[Any]:
    """``parts`` contiguous slices of ``table`` whose lengths differ by at most one."""
    rows = table.num_rows
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [table.slice(bounds[i], bounds[i + 1] - bounds[i]) for i in range(parts)]


def pad(table: Any, rows: int, *, rank: int) -> Any:
    """``table`` lengthened to ``rows`` by repeating its rows from the start."""
    if table.num_rows == rows:
        return table
    if table.num_rows == 0:
        raise ConfigError(
            f"rank {rank} received no rows of the DataFrame while others received up to {rows}; "
            "the DataFrame needs at least as many rows as there are ranks."
        )
    return table.take([i % table.num_rows for i in range(rows)])


def write(table: Any, path: str) -> None:
    """Write ``table`` as an Arrow IPC file."""
    pa = _pyarrow()
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def read(path: str) -> Any:
    """Read an Arrow IPC file written by :func:`write` (memory-mapped)."""
    pa = _pyarrow()
    return pa.ipc.open_file(pa.memory_map(path, "r")).read_all()


def write_shares(
    tables: Sequence[Any], target_rows: int, paths: Sequence[str], first_rank: int
) -> None:
    """Pad each rank's table to ``target_rows`` and write it to its path."""
    for offset, (table, path) in enumerate(zip(tables, paths, strict=True)):
        write(pad(table, target_rows, rank=first_rank + offset), path)
