"""A window's rows in memory: views of decoded chunks, and batches gathered out of them.

The reader (:mod:`sparktrain.data.reader`) cuts its batches out of these blocks: a chunk read in
order is a :class:`View` (batches are views of it), a shuffled window is a :class:`Shuffled`
(batches are gathered out of its chunks into :class:`Buffers`, reused once nothing holds them).
"""

from __future__ import annotations

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


class Window:
    """One window of rows joined, in buffers reused from window to window (single rows only).

    Rows are gathered out of it (copies), so no tensor handed out points into a buffer, and
    reusing the buffers costs no new memory: the window is the same few MB all epoch long.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, Any] = {}

    def fill(self, chunks: list[dict[str, Any]]) -> dict[str, Any]:
        """The chunks' rows, one after the other (tensors in the reused buffers, or lists)."""
        import torch

        if not chunks:
            return {}
        total = sum(rows_in(c) for c in chunks)
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
                out[name] = [row for v in values for row in v]
                continue
            buffer = self.buffers.get(name)
            if (
                buffer is None
                or buffer.shape[1:] != first.shape[1:]
                or buffer.dtype != first.dtype
                or len(buffer) < total
            ):
                buffer = self.buffers[name] = torch.empty(
                    (total, *first.shape[1:]), dtype=first.dtype
                )
            torch.cat(values, out=buffer[:total]) if len(values) > 1 else buffer[:total].copy_(
                first
            )
            out[name] = buffer[:total]
        return out


class Buffers:
    """Batch buffers, written again once nothing outside holds any part of them.

    A shuffled batch is gathered into one of these, and the caller gets a view of it. A buffer is
    written again only when torch counts no other holder of its memory: no batch, no view of
    one, no numpy array or DLPack capsule made from one (torch's storage use count, an internal
    that torch's own CUDA-graph trees rely on). Memory written again is warm (in the CPU's
    cache, its pages mapped), which new memory is not: a batch gathered into new memory cost
    about twice the copy itself, measured here. Without that count every batch is new memory.

    A buffer moved to shared memory is never written again: torch's own DataLoader workers (and
    ``torch.multiprocessing`` queues) hand a tensor over by moving its memory to ``/dev/shm``
    and sending the file, so the other process reads the very memory the buffer is.
    """

    KEEP = 4  # buffers kept per column: a consumer holding more batches gets new memory

    def __init__(self) -> None:
        import torch

        self.kept: dict[str, list[Any]] = {}
        self.count = getattr(torch._C, "_storage_Use_Count", None)

    def take(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """A tensor of ``shape`` and ``dtype`` that nothing else holds."""
        import torch

        kept = self.kept.setdefault(name, [])
        for buffer in kept:
            fits = buffer.shape[1:] == shape[1:] and buffer.dtype == dtype
            if fits and len(buffer) >= shape[0] and self._free(buffer):
                if not buffer.untyped_storage().is_shared():
                    return buffer[: shape[0]]
                kept.remove(buffer)  # given away (below): never written again
                break
        buffer = torch.empty(shape, dtype=dtype)
        if self.count is not None:
            if len(kept) >= self.KEEP:
                kept.pop(0)
            kept.append(buffer)
        return buffer[: shape[0]]  # a view: its holder counts (the same tensor object would not)

    def _free(self, buffer: Any) -> bool:
        # ``buffer`` holds its storage once, and the ``untyped_storage()`` asked for here once
        return self.count is not None and self.count(buffer.untyped_storage()._cdata) <= 2


class View:
    """A block read in order: rows ``a .. b - 1`` are views of it."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self.rows, self.length = rows, rows_in(rows)

    def __len__(self) -> int:
        return self.length

    def __call__(self, start: int, stop: int, *, exact: bool = False) -> dict[str, Any]:
        """Rows ``start .. stop - 1``, as views (``exact``: the same)."""
        return {k: v[start:stop] for k, v in self.rows.items()}


class Shuffled:
    """A shuffled window: its decoded chunks and the order its rows are taken in.

    A batch (``exact=False``) is the rows ``order[a:b]`` gathered straight out of the chunks
    into a reused buffer (:class:`Buffers`), in the order they lie in the window: one copy a
    row, into warm memory. Which rows make a batch is the order's; only their order inside the
    batch is the window's, which no loss or metric over a batch sees. Single rows
    (``exact=True``, a dataset without a batch size) keep the order itself: the chunks are
    joined into the window's buffers once, and the rows gathered out of them.
    """

    def __init__(
        self, chunks: list[dict[str, Any]], order_of: np.ndarray, buffers: Buffers, window: Window
    ) -> None:
        import torch

        self.chunks, self.order_of, self.buffers, self.window = chunks, order_of, buffers, window
        self.starts = np.cumsum([0, *(rows_in(c) for c in chunks)])
        self.joined: dict[str, Any] | None = None
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

    def __call__(self, start: int, stop: int, *, exact: bool = False) -> dict[str, Any]:
        """The rows ``order[start:stop]``: a batch, or (``exact``) in the order itself."""
        index = self.order_of[start:stop]
        if exact:
            if self.joined is None:
                self.joined = self.window.fill(self.chunks)
            return gather(self.joined, index)
        return self._gathered(np.sort(index))

    def _gathered(self, index: np.ndarray) -> dict[str, Any]:
        import torch

        starts = self.starts
        cuts = np.searchsorted(index, starts)
        picks = [
            (number, torch.from_numpy(index[cuts[number] : cuts[number + 1]] - starts[number]))
            for number in range(len(self.chunks))
            if cuts[number + 1] > cuts[number]
        ]
        out: dict[str, Any] = {}
        for name, values, alike in self.columns:
            if not alike:
                owner = np.searchsorted(starts, index, side="right") - 1
                out[name] = [values[c][i - starts[c]] for c, i in zip(owner, index, strict=True)]
                continue
            first = values[0]
            batch = self.buffers.take(name, (len(index), *first.shape[1:]), first.dtype)
            for number, picked in picks:
                torch.index_select(
                    values[number], 0, picked, out=batch[cuts[number] : cuts[number + 1]]
                )
            out[name] = batch
        return out


def gather(rows: dict[str, Any], index: np.ndarray) -> dict[str, Any]:
    """The rows at ``index``, copied out of a joined window."""
    import torch

    picked = torch.from_numpy(index)
    return {
        k: v.index_select(0, picked) if isinstance(v, torch.Tensor) else [v[i] for i in index]
        for k, v in rows.items()
    }
