"""One worker's stream: read its windows of row groups, shuffle them, cut them into batches.

A worker holds at most one row group (the last one read, kept because the next window often
starts inside it), one window of rows as tensors and, reading ahead, a few decoded chunks:
memory does not grow with the dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparktrain.data import order
from sparktrain.data.blocks import Buffers, View, concat, rows_in, shuffled
from sparktrain.data.columns import pyarrow, to_tensors
from sparktrain.data.remainder import Runs
from sparktrain.data.sources import Source, Unit
from sparktrain.data.threads import ThreadWorkers

CHUNK_ROWS = 1024  # decoded rows at a time: 3 MB of 784 float32 rows stays in the L3 cache


@dataclass(frozen=True)
class Stream:
    """What one worker reads in one epoch (see :mod:`sparktrain.data.order`).

    Attributes:
        source: The row groups.
        columns: The columns to read.
        epoch, seed, rank, worker, shuffle: The order's keys.
        first, stop: The worker's positions in the epoch's row numbering; with ``runs``, the
            entries of ``runs`` it reads (``0 .. len(runs)``).
        window: Rows per shuffle window.
        batch_size: Rows per batch; ``None`` yields single rows.
        drop_last: Drop the worker's last, short batch.
        skip: Rows already consumed (resumption).
        runs: The epoch positions the worker reads, in order, when the epoch was resumed at
            another world size (:mod:`sparktrain.data.remainder`); ``None``: ``first .. stop``.
        leg: Which of the epoch's legs this is (a key of the windows' shuffle).
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
    runs: Runs | None = field(default=None, compare=False)
    leg: int = 0


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
            length = rows_in(self.pending)
            end = self.pending_start + length
            lo, hi = max(piece.start, self.position) - self.pending_start, min(piece.stop, end)
            hi -= self.pending_start
            if hi > lo:
                yield {k: _slice(v, lo, hi) for k, v in self.pending.items()}
            self.position = self.pending_start + hi
            if self.position >= end:
                self.pending = None


def read_unit(
    source: Source, unit: Unit, columns: tuple[str, ...], chunk: int | None = None
) -> Iterator[Any]:
    """One unit's record batches of ``chunk`` rows, read by the source's format.

    Partition values are filled in.
    """
    pa = pyarrow()
    constants = dict(unit.partition)
    stored = [c for c in columns if c not in constants]
    rows = chunk or CHUNK_ROWS
    batches = source.format.read(source.filesystem, unit.file, unit.row_group, stored, rows)
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


def _windows(stream: Stream) -> Iterator[tuple[int, int, int]]:
    """Each window from the first unconsumed one: its number, and its first and end position."""
    size = stream.stop - stream.first
    for number in range(stream.skip // stream.window, -(-size // stream.window)):
        lo = stream.first + number * stream.window
        yield number, lo, min(lo + stream.window, stream.stop)


def _decoded(stream: Stream) -> Iterator[dict[str, Any]]:
    """Every window's rows, decoded a chunk at a time, in the order they are read."""
    unit_rows = [u.rows for u in stream.source.units]
    units = order.unit_order(
        len(unit_rows), seed=stream.seed, epoch=stream.epoch, shuffle=stream.shuffle
    )
    cursor = _Cursor(stream.source, stream.columns)
    for _, lo, hi in _windows(stream):
        if stream.runs is None:
            pieces = order.pieces(units, unit_rows, lo, hi)
        else:  # a slice of what earlier legs of the epoch left
            pieces = order.spans(units, unit_rows, stream.runs.take(lo, hi).pairs())
        for piece in pieces:
            yield from cursor.read(piece)


def _next(chunks: Iterator[dict[str, Any]], rows: int) -> Iterator[dict[str, Any]]:
    """The chunks of the next ``rows`` rows: one window's (no chunk straddles two)."""
    while rows > 0:
        chunk = next(chunks)
        rows -= rows_in(chunk)
        yield chunk


def windows(stream: Stream, *, ahead: int = 0) -> Iterator[View]:
    """The worker's blocks of rows from the first unconsumed row, each in the order it is taken.

    Shuffled, a block is a window, its rows gathered in the permuted order
    (:func:`~sparktrain.data.blocks.shuffled`). In order, each decoded chunk is a block of its
    own. Batches are views of a block, or joined copies where they straddle two blocks.

    With ``ahead``, a thread decodes up to that many chunks ahead of the rows taken: pyarrow
    lets go of the GIL while it decodes, so decoding overlaps the placing of rows and the
    consumer's work. The thread stops when the pass ends, breaks or fails, and an error it meets
    is raised here, at the rows it would have read.
    """
    pool = ThreadWorkers(lambda _: _decoded(stream), 1, prefetch=ahead) if ahead else None
    decoded = iter(pool) if pool is not None else _decoded(stream)
    buffers = Buffers()
    start_window, offset = divmod(stream.skip, stream.window)
    try:
        for number, lo, hi in _windows(stream):
            skip, read = (offset if number == start_window else 0), hi - lo
            chunks = _next(decoded, read)
            if not stream.shuffle:  # in order: the decoded chunks themselves, sliced (no copy)
                for chunk in chunks:
                    length = rows_in(chunk)
                    if length > skip:
                        yield View({k: v[skip:] for k, v in chunk.items()} if skip else chunk)
                    skip = max(0, skip - length)
                continue
            taking = order.window_permutation(
                read,
                seed=stream.seed, epoch=stream.epoch, rank=stream.rank, worker=stream.worker,
                window=number, leg=stream.leg,
            )  # fmt: skip
            yield shuffled(chunks, taking[skip:], read, buffers)
    finally:
        if pool is not None:  # the pass ended, broke or failed: the thread stops
            pool.close()


def batches(stream: Stream, *, ahead: int = 0) -> Iterator[dict[str, Any]]:
    """The worker's batches (or rows, without a batch size), from the first not yet consumed.

    ``ahead``: chunks a thread decodes ahead (:func:`windows`).
    """
    size = stream.batch_size
    pending: list[dict[str, Any]] = []  # the start of the next batch, joined once when full
    have = 0
    for take in windows(stream, ahead=ahead):
        if size is None:
            for start in range(0, len(take), 1024):
                part = take(start, start + 1024)
                columns = list(part.items())
                for i in range(rows_in(part)):
                    yield {k: v[i] for k, v in columns}
            continue
        position = 0
        if pending:
            need = min(size - have, len(take))
            pending.append(take(0, need))
            have, position = have + need, need
            if have < size:
                continue
            yield concat(pending)
            pending, have = [], 0
        while position + size <= len(take):
            yield take(position, position + size)
            position += size
        if position < len(take):  # the start of the next batch, joined to it when it is full
            pending, have = [take(position, len(take))], len(take) - position
    if pending and not stream.drop_last:
        yield concat(pending)
