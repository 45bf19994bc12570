"""A window's rows in memory: views of decoded chunks, and batches gathered out of them.

The reader (:mod:`sparktrain.data.reader`) cuts its batches out of these blocks: a chunk read in
order is a :class:`View` (batches are views of it), a shuffled window is a :class:`Shuffled`
(batches are gathered out of its chunks into :class:`Buffers`, reused once nothing holds them).
"""

from __future__ import annotations

import sys
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
    """Batch buffers, written again once nothing outside holds any part of them.

    A shuffled batch is gathered into one of these, and the caller gets a view of it. A buffer is
    written again only when torch counts no other holder of its memory: no batch, no view of
    one, no numpy array, DLPack capsule or storage object made from one (torch's storage use
    count, an internal that torch's own CUDA-graph trees rely on, and Python's count of the
    storage object). Memory written again is warm (in the CPU's cache, its pages mapped), which
    new memory is not. Without torch's count every batch is new memory.

    A buffer moved to shared memory is never written again: torch's own DataLoader workers (and
    ``torch.multiprocessing`` queues) hand a tensor over by moving its memory to ``/dev/shm``
    and sending the file, so the other process reads the very memory the buffer is.
    """

    KEEP = 4  # buffers kept per column: a consumer holding more batches gets new memory

    def __init__(self) -> None:
        import torch

        self.kept: dict[Any, list[Any]] = {}
        self.count: Any = getattr(torch._C, "_storage_Use_Count", None)
        self.alone = self._holders(torch.empty(1)) if self.count is not None else (0, 0)

    def take(self, key: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """A tensor of ``shape`` and ``dtype`` that nothing else holds (``key``: its use)."""
        import torch

        kept = self.kept.setdefault(key, [])
        kept[:] = [b for b in kept if not b.untyped_storage().is_shared()]  # given away (above)
        for buffer in kept:
            fits = buffer.shape[1:] == shape[1:] and buffer.dtype == dtype
            if fits and len(buffer) >= shape[0] and self._unheld(buffer):
                return buffer[: shape[0]]
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


class Shuffled:
    """A shuffled window: its decoded chunks and the order its rows are taken in.

    A batch, the rows ``order[a:b]``, is gathered straight out of the chunks (no window buffer
    joining them first): each chunk's rows of the batch, in the order they lie in the window,
    into a reused scratch buffer (one copy a row, into warm memory), then that scratch into the
    batch's own reused buffer in the order itself (a second copy, of a batch that is in the
    CPU's cache). Both buffers come from :class:`Buffers`. Rows from a single chunk skip the
    scratch.
    """

    def __init__(
        self, chunks: list[dict[str, Any]], order_of: np.ndarray, buffers: Buffers
    ) -> None:
        import torch

        self.chunks, self.order_of, self.buffers = chunks, order_of, buffers
        self.starts = np.cumsum([0, *(rows_in(c) for c in chunks)])
        self.columns: list[tuple[str, list[Any], bool]] = []  # name, values, all alike tensors
        for name in chunks[0] if chunks else ():
            values = [c[name] for c in chunks]
            first = values[0]
            alike = all(
                isinstance(v, torch.Tensor)
                and v.shape[1:] == first.shape[1:]
                and v.dtype == first.dtype
                for v in values
            )  # else lists, or lists of numbers whose width changed between chunks
            self.columns.append((name, values, alike))

    def __len__(self) -> int:
        return len(self.order_of)

    def __call__(self, start: int, stop: int) -> dict[str, Any]:
        """The rows ``order[start:stop]``, in that order."""
        import torch

        index = self.order_of[start:stop]
        starts = self.starts
        ranks = np.argsort(index, kind="stable")
        ordered = index[ranks]  # the batch's rows in the window's order
        cuts = np.searchsorted(ordered, starts)
        picks = [
            (number, torch.from_numpy(ordered[cuts[number] : cuts[number + 1]] - starts[number]))
            for number in range(len(self.chunks))
            if cuts[number + 1] > cuts[number]
        ]
        places = np.empty_like(ranks)
        places[ranks] = np.arange(len(ranks))  # where each row of the batch lies in ``ordered``
        back = torch.from_numpy(places)
        owner = None
        out: dict[str, Any] = {}
        for name, values, alike in self.columns:
            if not alike:
                if owner is None:
                    owner = np.searchsorted(starts, index, side="right") - 1
                out[name] = [values[c][i - starts[c]] for c, i in zip(owner, index, strict=True)]
                continue
            shape, dtype = (len(index), *values[0].shape[1:]), values[0].dtype
            batch = self.buffers.take(name, shape, dtype)
            if len(picks) == 1:  # one chunk: gathered in the order itself
                number = picks[0][0]
                picked = torch.from_numpy(index - starts[number])
                torch.index_select(values[number], 0, picked, out=batch)
            else:
                scratch = self.buffers.take((name, "scratch"), shape, dtype)
                for number, picked in picks:
                    torch.index_select(
                        values[number], 0, picked, out=scratch[cuts[number] : cuts[number + 1]]
                    )
                torch.index_select(scratch, 0, back, out=batch)
            out[name] = batch
        return out
