"""A window's rows in memory: views of decoded chunks, or of a shuffled window's buffer.

The reader (:mod:`sparktrain.data.reader`) cuts its batches out of these blocks, each a
:class:`View` (batches are views of it): a chunk read in order, or a shuffled window whose rows
:func:`shuffled` gathered in the order they are taken into :class:`Buffers`, reused once nothing
holds them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np


def concat(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocks of rows joined into one (a batch that straddles two blocks)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for name in parts[0]:
        values = [p[name] for p in parts]
        if all(isinstance(v, torch.Tensor) and v.shape[1:] == values[0].shape[1:] for v in values):
            out[name] = torch.cat(values)
        else:  # lists, or lists of numbers whose width changed between groups
            out[name] = [row for v in values for row in v]
    return out


def rows_in(batch: dict[str, Any]) -> int:
    """How many rows a block (a dict of columns) holds."""
    return len(next(iter(batch.values())))


class Buffers:
    """Window buffers, written again once nothing outside holds any part of them.

    A shuffled window is gathered into one of these, and batches are views of it. A buffer is
    written again only when torch counts no other holder of its memory: no batch, no view of
    one, no numpy array, DLPack capsule or storage object made from one (torch's storage use
    count, an internal that torch's own CUDA-graph trees rely on, and Python's count of the
    storage object). Memory written again is warm (in the CPU's cache, its pages mapped), which
    new memory is not. Without torch's count every window is new memory.

    A buffer moved to shared memory is never written again: torch's own DataLoader workers (and
    ``torch.multiprocessing`` queues) hand a tensor over by moving its memory to ``/dev/shm``
    and sending the file, so the other process reads the very memory the buffer is.
    """

    KEEP = 4  # buffers kept per column: a consumer holding batches of more windows gets new memory

    def __init__(self) -> None:
        import torch

        self.kept: dict[Any, list[Any]] = {}
        self.count: Any = getattr(torch._C, "_storage_Use_Count", None)
        self.alone = self._holders(torch.empty(1)) if self.count is not None else (0, 0)

    def take(self, key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """A tensor of ``shape`` and ``dtype`` that nothing else holds (``key``: its use)."""
        import torch

        kept = self.kept.setdefault(key, [])
        for buffer in kept:
            fits = buffer.shape[1:] == shape[1:] and buffer.dtype == dtype
            unheld = fits and len(buffer) >= shape[0] and self._unheld(buffer)
            # asked after: a batch being moved to shared memory is held until it is moved
            if unheld and not buffer.untyped_storage().is_shared():
                return buffer[: shape[0]]
        kept[:] = [b for b in kept if not b.untyped_storage().is_shared()]  # given away (above)
        buffer = torch.empty(shape, dtype=dtype)
        if self.count is not None:
            if len(kept) >= self.KEEP:
                kept.pop(0)
            kept.append(buffer)
        return buffer[: shape[0]]  # a view: its holder counts (the same tensor object would not)

    def _unheld(self, buffer: Any) -> bool:
        held = self._holders(buffer)
        return held[0] <= self.alone[0] and held[1] <= self.alone[1]

    def _holders(self, buffer: Any) -> tuple[int, int]:
        """Who holds ``buffer``'s memory: torch's count, and Python's of its storage object.

        A tensor or view counts in the first; a storage object kept by itself
        (``batch.untyped_storage()``, ``batch.storage()``) only in the second. Both are compared
        with a new tensor's, so what this call itself holds cancels out.
        """
        storage = buffer.untyped_storage()  # only asked where ``count`` is (``kept`` is empty else)
        return self.count(storage._cdata), sys.getrefcount(storage)


class View:
    """A block read in order: rows ``a .. b - 1`` are views of it."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self.rows, self.length = rows, rows_in(rows)

    def __len__(self) -> int:
        return self.length

    def __call__(self, start: int, stop: int) -> dict[str, Any]:
        """Rows ``start .. stop - 1``, as views."""
        return {k: v[start:stop] for k, v in self.rows.items()}


def shuffled(
    chunks: Iterable[dict[str, Any]], taking: np.ndarray, read: int, buffers: Buffers
) -> View:
    """A shuffled window as one block: its rows in the order they are taken (``taking``).

    Each chunk's rows of a tensor column are written to their places in a reused buffer as soon
    as the chunk is decoded (one copy a row, out of the CPU's cache into warm memory; the chunk
    is then let go), and every batch is a view of the buffer: a batch costs no copy and no
    bookkeeping. A batch that is kept keeps its window's buffer (``.clone()`` it to keep it
    alone). Other columns (ragged lists, text, tensors whose width or type changes between
    chunks) are lists of the rows in the same order.

    Args:
        chunks: The window's ``read`` rows, decoded, in the order they are read.
        taking: The rows taken, as positions among the rows read, in the order taken (a
            resumed window's first rows are not taken).
        read: How many rows ``chunks`` holds.
        buffers: Where the window's buffers come from.
    """
    import torch

    place = np.full(read, -1, dtype=np.int64)  # where each row read goes, or -1
    place[taking] = np.arange(len(taking))
    rows: dict[str, Any] = {}
    start = 0
    for chunk in chunks:
        where = place[start : start + rows_in(chunk)]
        for name, value in chunk.items():
            out = rows.get(name)
            if out is None and isinstance(value, torch.Tensor):
                out = rows[name] = buffers.take(name, (len(taking), *value.shape[1:]), value.dtype)
            if isinstance(out, torch.Tensor):
                if _alike(out, value):
                    _place(out, value, where)
                    continue
                done = place[:start][place[:start] >= 0]  # rows placed so far: a list from here
                buffer, out = out, [None] * len(taking)
                for at in done:
                    out[at] = buffer[at].clone()
                rows[name] = out
            out = rows.setdefault(name, [None] * len(taking))
            for i in np.flatnonzero(where >= 0):
                out[where[i]] = value[i]
        start += rows_in(chunk)
    return View(rows) if rows else View({"": []})  # (an empty window: nothing to take)


def _alike(out: Any, value: Any) -> bool:
    import torch

    return (
        isinstance(value, torch.Tensor)
        and value.shape[1:] == out.shape[1:]
        and value.dtype == out.dtype
    )


def _place(out: Any, rows: Any, where: np.ndarray) -> None:
    """Write ``rows[i]`` to ``out[where[i]]`` (rows whose place is -1 are not taken)."""
    import torch

    if where.min(initial=0) < 0:  # a resumed window: its first rows were taken before
        keep = where >= 0
        rows, where = rows[torch.from_numpy(keep)], where[keep]
    # torch's copy, not numpy's row assignment: with numpy's in workers="threads" threads, the
    # rank's own torch ops on the batches took 3x as long on 2 cores (equal with one intra-op
    # thread in the rank; the cause is not the GIL, which both let go of)
    target, source = _wide(out), _wide(rows)
    if target.shape[1:] != source.shape[1:] or target.dtype != source.dtype:  # (not aligned alike)
        target, source = out, rows
    target.index_copy_(0, torch.from_numpy(where), source)


def _wide(rows: Any) -> Any:
    """``rows`` (contiguous) as rows of the widest element that divides a row and its address.

    torch's copy by index costs per element, not per byte: a row of 784 float32 copied as 196
    complex128 took a third of the time here, and a row of bytes (an image's) many times more.
    """
    import torch

    if rows.dim() < 2 or not rows.is_contiguous() or rows.numel() == 0:
        return rows  # (rows of no elements: nothing to widen)
    width = rows[0].numel() * rows.element_size()
    for size, kind in ((16, torch.complex128), (8, torch.int64), (4, torch.int32)):
        if width % size == 0 and rows.data_ptr() % size == 0:
            try:
                return rows.reshape(len(rows), -1).view(kind)
            except RuntimeError:  # a storage offset torch will not view so
                return rows
    return rows
