"""One worker's stream: read its windows of row groups, shuffle them, cut them into batches.

A worker holds at most one row group (the last one read, kept because the next window often
starts inside it) and one window of rows as tensors: memory does not grow with the dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparktrain.data import order
from sparktrain.data.columns import pyarrow, to_tensors
from sparktrain.data.sources import Source, Unit

CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Stream:
    """What one worker reads in one epoch (see :mod:`sparktrain.data.order`).

    Attributes:
        source: The row groups.
        columns: The columns to read.
        epoch, seed, rank, worker, shuffle: The order's keys.
        first, stop: The worker's positions in the epoch's row numbering.
        window: Rows per shuffle window.
        batch_size: Rows per batch; ``None`` yields single rows.
        drop_last: Drop the worker's last, short batch.
        skip: Rows already consumed (resumption).
    """

    source: Source
    columns: tuple[str, ...]
    epoch: int
    seed: int
    rank: int
    worker: int
    shuffle: bool
    first: int
    stop: int
    window: int
    batch_size: int | None
    drop_last: bool
    skip: int = 0


class _Cursor:
    """Reads row groups a chunk at a time, going on where the last read stopped.

    Windows walk through a row group in order, so the open reader is usually at the next row
    wanted; otherwise the group is opened again and read up to it. Only one chunk of rows is
    decoded at a time: a large row group costs no more memory than a small one.
    """

    def __init__(self, source: Source, columns: tuple[str, ...]) -> None:
        self.source = source
        self.columns = columns
        self.unit = -1
        self.position = 0
        self.batches: Iterator[Any] = iter(())
        self.pending: dict[str, Any] | None = None

    def _open(self, index: int) -> None:
        self.unit, self.position, self.pending = index, 0, None
        self.batches = read_unit(self.source, self.source.units[index], self.columns)

    def read(self, piece: order.Piece) -> Iterator[dict[str, Any]]:
        """The rows of ``piece`` as tensors, a chunk at a time."""
        if piece.unit != self.unit or piece.start < self.position:
            self._open(piece.unit)
        where = self.source.units[piece.unit].file
        while self.position < piece.stop:
            if self.pending is None:
                batch = next(self.batches)
                self.pending = to_tensors(batch, where=where, offset=self.position)
                self.pending_start = self.position
            length = _length(self.pending)
            end = self.pending_start + length
            lo, hi = max(piece.start, self.position) - self.pending_start, min(piece.stop, end)
            hi -= self.pending_start
            if hi > lo:
                yield {k: _slice(v, lo, hi) for k, v in self.pending.items()}
            self.position = self.pending_start + hi
            if self.position >= end:
                self.pending = None


def read_unit(
    source: Source, unit: Unit, columns: tuple[str, ...], chunk: int = CHUNK_ROWS
) -> Iterator[Any]:
    """One row group's record batches of ``chunk`` rows (partition values filled in)."""
    import pyarrow.parquet as pq

    pa = pyarrow()
    constants = dict(unit.partition)
    stored = [c for c in columns if c not in constants]
    handle = pq.ParquetFile(unit.file, filesystem=source.filesystem, pre_buffer=False)
    batches = handle.iter_batches(
        batch_size=chunk, row_groups=[unit.row_group], columns=stored, use_threads=False
    )
    for batch in batches:
        table = pa.Table.from_batches([batch])
        for name in columns:
            if name in constants:
                kind = source.schema.field(name).type
                value = pa.array([constants[name]], type=kind)
                table = table.append_column(
                    pa.field(name, kind), value.take(np.zeros(table.num_rows, np.int64))
                )
        yield table.select(list(columns))


def _slice(value: Any, start: int, stop: int | None) -> Any:
    return value[start:stop]


def _concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    import torch

    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for name in parts[0]:
        values = [p[name] for p in parts]
        if isinstance(values[0], torch.Tensor) and all(
            isinstance(v, torch.Tensor) and v.shape[1:] == values[0].shape[1:] for v in values
        ):
            out[name] = torch.cat(values)
        else:  # lists, or lists of numbers whose width changed between groups
            out[name] = [
                row for v in values for row in (list(v) if isinstance(v, torch.Tensor) else v)
            ]
    return out


def _length(batch: dict[str, Any]) -> int:
    return len(next(iter(batch.values())))


def _assemble(chunks: list[dict[str, Any]], perm: np.ndarray | None) -> dict[str, Any]:
    """One window from its chunks, each row written once to its shuffled place."""
    import torch

    if not chunks:
        return {}
    total = sum(_length(c) for c in chunks)
    target = None if perm is None else torch.from_numpy(np.argsort(perm))
    out: dict[str, Any] = {}
    for name in chunks[0]:
        values = [c[name] for c in chunks]
        first = values[0]
        if not all(
            isinstance(v, torch.Tensor)
            and v.shape[1:] == first.shape[1:]
            and v.dtype == first.dtype
            for v in values
        ):
            rows = [row for v in values for row in _rows(v)]
            out[name] = rows if perm is None else [rows[i] for i in perm]
            continue
        if target is None and len(values) == 1:
            out[name] = first
            continue
        window = torch.empty((total, *first.shape[1:]), dtype=first.dtype)
        position = 0
        for value in values:
            rows_here = len(value)
            if target is None:
                window[position : position + rows_here] = value
            else:
                window[target[position : position + rows_here]] = value
            position += rows_here
        out[name] = window
    return out


def _rows(value: Any) -> list[Any]:
    return list(value)


def windows(stream: Stream) -> Iterator[dict[str, Any]]:
    """The worker's rows, a (shuffled) window at a time, from the first row not yet consumed."""
    source = stream.source
    unit_rows = [u.rows for u in source.units]
    units = order.unit_order(
        len(unit_rows), seed=stream.seed, epoch=stream.epoch, shuffle=stream.shuffle
    )
    cursor = _Cursor(source, stream.columns)
    size = stream.stop - stream.first
    start_window, offset = divmod(stream.skip, stream.window)
    for number in range(start_window, -(-size // stream.window)):
        lo = stream.first + number * stream.window
        hi = min(lo + stream.window, stream.stop)
        chunks = [c for p in order.pieces(units, unit_rows, lo, hi) for c in cursor.read(p)]
        perm = None
        if stream.shuffle:
            perm = order.window_permutation(
                hi - lo,
                seed=stream.seed, epoch=stream.epoch, rank=stream.rank, worker=stream.worker,
                window=number,
            )  # fmt: skip
        rows = _assemble(chunks, perm)
        if number == start_window and offset:
            rows = {k: _slice(v, offset, None) for k, v in rows.items()}
        yield rows


def batches(stream: Stream) -> Iterator[dict[str, Any]]:
    """The worker's batches (or rows, without a batch size), from the first not yet consumed."""
    size = stream.batch_size
    carry: dict[str, Any] | None = None
    for rows in windows(stream):
        length = _length(rows)
        if size is None:
            columns = list(rows.items())
            for i in range(length):
                yield {k: v[i] for k, v in columns}
            continue
        position = 0
        if carry is not None:
            need = size - _length(carry)
            head = {k: _slice(v, 0, need) for k, v in rows.items()}
            carry = _concat([carry, head])
            position = min(need, length)
            if _length(carry) < size:
                continue
            yield carry
            carry = None
        while position + size <= length:
            yield {k: _slice(v, position, position + size) for k, v in rows.items()}
            position += size
        if position < length:  # a copy: the window itself can then be freed
            carry = {k: _copy(_slice(v, position, None)) for k, v in rows.items()}
    if carry is not None and not stream.drop_last:
        yield carry


def _copy(value: Any) -> Any:
    import torch

    return value.clone() if isinstance(value, torch.Tensor) else list(value)
