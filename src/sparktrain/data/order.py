"""Which rows each rank and DataLoader worker reads, in which order: pure arithmetic on row counts.

For an epoch:

1. The row groups are put in an order drawn from ``(seed, epoch)`` (file order without shuffle),
   and their rows numbered ``0 .. N-1`` in that order.
2. Rank ``r`` of ``W`` takes rows ``r*S .. (r+1)*S - 1``: ``S = N // W`` when the remainder is
   dropped, ``S = ceil(N / W)`` when it is padded (positions past ``N`` wrap to the start). Every
   rank reads whole row groups but for at most two it shares with its neighbours.
3. The share is cut into one contiguous range per DataLoader worker (``k`` of them, the same
   lengths on every rank), so every rank yields the same number of batches.
4. Each worker reads its range a window (the shuffle buffer) at a time and permutes the window's
   rows with a generator seeded from ``(seed, epoch, rank, worker, window)``.
5. A DataLoader takes the workers' batches in turn (worker 0, 1, ..., skipping those that are
   done): :func:`resume_plan` inverts that, so a run resumes at the next unseen batch.

A run resumed at another world size reads what the epoch has left in the same way, with the
remaining positions in place of ``0 .. N-1`` (:mod:`sparktrain.data.remainder`).

Nothing here reads data; the same arguments always give the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from sparktrain.ground.errors import ConfigError

UNEVEN = ("pad", "drop")


@dataclass(frozen=True)
class Piece:
    """Rows ``start .. stop - 1`` of unit ``unit`` (an index into the source's units)."""

    unit: int
    start: int
    stop: int


def rng(*keys: int) -> np.random.Generator:
    """A generator seeded from ``keys`` (the same keys, the same draws, on every machine)."""
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]))


def unit_order(count: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order in which an epoch reads ``count`` units."""
    if not shuffle:
        return np.arange(count)
    return rng(seed, epoch, 0x5EED).permutation(count)


def share_rows(total: int, world_size: int, uneven: str) -> int:
    """Rows per rank: ``total // world_size`` (``drop``) or rounded up (``pad``)."""
    if total < world_size:
        raise ConfigError(
            f"the data has {total} rows but the run has {world_size} ranks; every rank needs "
            "at least one row: use more data or fewer processes."
        )
    return total // world_size if uneven == "drop" else -(-total // world_size)


def worker_range(share: int, workers: int, worker: int) -> tuple[int, int]:
    """The positions ``lo .. hi - 1`` of a rank's share that ``worker`` of ``workers`` reads."""
    return share * worker // workers, share * (worker + 1) // workers


def pieces(order: np.ndarray, unit_rows: Sequence[int], first: int, stop: int) -> list[Piece]:
    """The unit slices holding epoch positions ``first .. stop - 1`` (wrapping past the end)."""
    return spans(order, unit_rows, ((first, stop),))


def spans(
    order: np.ndarray, unit_rows: Sequence[int], runs: Iterable[tuple[int, int]]
) -> list[Piece]:
    """The unit slices holding epoch positions ``first .. stop - 1`` of each of ``runs``."""
    rows = np.asarray(unit_rows, dtype=np.int64)[order]
    ends = np.cumsum(rows)
    total = int(ends[-1])
    out: list[Piece] = []
    for first, stop in runs:
        position = first
        while position < stop:
            inside = position % total
            slot = int(np.searchsorted(ends, inside, side="right"))
            begin = int(ends[slot] - rows[slot])
            take = min(int(ends[slot]) - inside, stop - position)
            unit = int(order[slot])
            if out and out[-1].unit == unit and out[-1].stop == inside - begin:
                out[-1] = Piece(unit, out[-1].start, inside - begin + take)
            else:
                out.append(Piece(unit, inside - begin, inside - begin + take))
            position += take
    return out


def window_permutation(
    length: int, *, seed: int, epoch: int, rank: int, worker: int, window: int, leg: int = 0
) -> np.ndarray:
    """The shuffle of one window's ``length`` rows (``leg``: the epoch's resumptions at a new size).

    The first leg's windows keep the keys they always had, so old checkpoints resume the same.
    """
    if leg:
        return rng(seed, epoch, rank, worker, window, leg).permutation(length)
    return rng(seed, epoch, rank, worker, window).permutation(length)


def items(rows: int, batch_size: int | None, drop_last: bool) -> int:
    """How many batches (or samples, without a batch size) ``rows`` rows give."""
    if batch_size is None:
        return rows
    return rows // batch_size if drop_last else -(-rows // batch_size)


def resume_plan(
    share: int,
    workers: int,
    consumed: int,
    *,
    batch_size: int | None,
    drop_last: bool,
    loader_batch: int | None,
) -> tuple[list[int], int]:
    """Rows each worker's stream already gave after ``consumed`` batches, and whose turn is next.

    ``share`` rows are cut into ``max(workers, 1)`` ranges; ``loader_batch`` is the DataLoader's
    batch size when the dataset yields single rows (``batch_size=None``).
    """
    count = max(workers, 1)
    lengths = [hi - lo for lo, hi in (worker_range(share, count, w) for w in range(count))]
    made = [items(n, batch_size, drop_last) for n in lengths]
    if not consumed:
        return [0] * count, 0
    per_loader = 1 if batch_size is not None else (loader_batch or 1)
    taken, turn = split_consumed(consumed, [-(-n // per_loader) for n in made])
    rows = [min(t * per_loader, n) * (batch_size or 1) for t, n in zip(taken, made, strict=True)]
    return [min(r, n) for r, n in zip(rows, lengths, strict=True)], turn


def leg_batches(
    share: int, workers: int, batch_size: int | None, drop_last: bool, loader_batch: int | None
) -> int:
    """Batches a rank hands out reading its whole ``share`` (a DataLoader's, for single rows)."""
    count = max(workers, 1)
    per_loader = 1 if batch_size is not None else (loader_batch or 1)
    ranges = (worker_range(share, count, w) for w in range(count))
    return sum(-(-items(hi - lo, batch_size, drop_last) // per_loader) for lo, hi in ranges)


def split_consumed(consumed: int, counts: Sequence[int]) -> tuple[list[int], int]:
    """Per-worker batches a DataLoader took after yielding ``consumed``, and whose turn is next.

    The DataLoader takes one batch from each worker in turn and skips the workers that are done,
    so after ``consumed`` batches worker ``w`` gave ``taken[w]``; ``next`` is the worker that
    gives the next batch (``0`` when the epoch is over).
    """
    if consumed > sum(counts):
        raise ConfigError(
            f"the saved data state says {consumed} batches were read, but this epoch has only "
            f"{sum(counts)}; was it saved with another dataset or batch size?"
        )
    taken = [0] * len(counts)
    left = consumed
    while left:
        active = [w for w, c in enumerate(counts) if c > taken[w]]
        rounds = min(counts[w] - taken[w] for w in active)
        if left >= rounds * len(active):
            for w in active:
                taken[w] += rounds
            left -= rounds * len(active)
            continue
        full, extra = divmod(left, len(active))
        for position, w in enumerate(active):
            taken[w] += full + (position < extra)
        left = 0
    active = [w for w, c in enumerate(counts) if c > taken[w]]
    if not active:
        return taken, 0
    last = _last_turn(consumed, counts, taken)
    after = [w for w in active if w > last]
    return taken, (after or active)[0]


def _last_turn(consumed: int, counts: Sequence[int], taken: Sequence[int]) -> int:
    """The worker that gave batch number ``consumed`` (``-1`` before the first)."""
    if consumed == 0:
        return -1
    level = max(taken)
    # The last turn went to the highest worker at the deepest level still reached.
    at_level = [w for w, t in enumerate(taken) if t == level]
    return at_level[-1]
