"""What an epoch has left after earlier legs read part of it: resuming at another world size.

An elastic run that shrinks or grows mid-epoch reads the epoch in *legs*: stretches at one world
size and number of DataLoader workers. A leg reads a list of epoch positions (the first leg:
``0 .. N-1``; a later one: what the earlier legs left) exactly as :mod:`sparktrain.data.order`
reads ``0 .. N-1``:

1. Rank ``r`` of ``W`` takes entries ``r*S .. (r+1)*S - 1`` of the list: ``S = M // W``
   (``drop``: the last ``M mod W`` entries wait for a later leg, or are left out when no leg
   follows) or ``ceil(M / W)`` (``pad``: entries past ``M`` wrap to the list's start).
2. The share is cut into one range per worker, each read a window at a time, a shuffled
   window's rows permuted with a generator seeded from ``(seed, epoch, rank, worker, window,
   leg)`` (the first leg keeps the keys it always had).

Every rank of a leg hands out the same number of batches, and a checkpoint is saved at a step
boundary, so a leg's one count of consumed batches (the same on every rank) fixes the rows all
of its ranks read: a window's rows that were read are the first ones of its permutation. What a
leg leaves is the list minus those rows, kept as sorted runs of positions (the unread tails of
the workers' ranges, and the scattered rows of the windows they were reading). A leg that handed
out all its batches ends the epoch: nothing is carried over, not even rows it dropped.

Nothing here reads data; the same arguments always give the same answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from sparktrain.data import order
from sparktrain.ground.errors import ConfigError

Positions = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Leg:
    """A stretch of an epoch read at one world size: how many batches each rank handed out.

    Attributes:
        world_size: The ranks that read it.
        workers: The DataLoader workers of each rank (``0``: none).
        consumed: Batches each rank handed out (the same on every rank).
        loader_batch: The DataLoader's batch size when the dataset yields single rows.
    """

    world_size: int
    workers: int
    consumed: int
    loader_batch: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The leg as saved in ``state_dict()["legs"]``."""
        return {
            "world_size": self.world_size,
            "workers": self.workers,
            "consumed": self.consumed,
            "loader_batch": self.loader_batch,
        }

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any], what: str = "leg") -> Leg:
        """A leg read back from a saved state (``what`` names it in errors)."""
        try:
            leg = cls(
                int(saved["world_size"]),
                int(saved["workers"]),
                int(saved["consumed"]),
                None if saved.get("loader_batch") is None else int(saved["loader_batch"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"the saved data state's {what} {dict(saved)!r} is malformed ({exc!r}); pass the "
                "dict that state_dict() returned, unchanged."
            ) from exc
        if leg.world_size < 1 or leg.workers < 0 or leg.consumed < 0:
            raise ConfigError(
                f"the saved data state's {what} {leg.as_dict()!r} needs world_size >= 1, "
                "workers >= 0 and consumed >= 0; pass the dict that state_dict() returned."
            )
        return leg


@dataclass(frozen=True)
class Plan:
    """The dataset's settings that decide which rows a leg reads (they must not change)."""

    rows: int
    seed: int
    epoch: int
    shuffle: bool
    window: int
    batch_size: int | None
    drop_last: bool
    uneven: str


class Runs:
    """Epoch positions ``starts[i] .. stops[i] - 1`` for each ``i``, one run after the other."""

    __slots__ = ("ends", "starts", "stops")

    def __init__(self, starts: npt.ArrayLike, stops: npt.ArrayLike) -> None:
        self.starts: Positions = np.asarray(starts, dtype=np.int64).reshape(-1)
        self.stops: Positions = np.asarray(stops, dtype=np.int64).reshape(-1)
        self.ends: Positions = np.cumsum(self.stops - self.starts)

    @classmethod
    def span(cls, start: int, stop: int) -> Runs:
        """Positions ``start .. stop - 1``."""
        return cls([start], [stop]) if stop > start else cls([], [])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __repr__(self) -> str:
        return f"Runs({len(self.starts)} runs, {len(self)} positions)"

    def pairs(self) -> list[tuple[int, int]]:
        """The runs as ``(start, stop)`` pairs."""
        return list(zip(self.starts.tolist(), self.stops.tolist(), strict=True))

    def positions(self) -> Positions:
        """Every position, in order (for tests and small remainders)."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.pairs()])

    def _cut(self, lo: int, hi: int) -> tuple[Positions, Positions]:
        """The runs of entries ``lo .. hi - 1`` (``0 <= lo < hi <= len(self)``)."""
        first = int(np.searchsorted(self.ends, lo, side="right"))
        last = int(np.searchsorted(self.ends, hi - 1, side="right"))
        starts, stops = self.starts[first : last + 1].copy(), self.stops[first : last + 1].copy()
        starts[0] = self.stops[first] - (int(self.ends[first]) - lo)
        stops[-1] -= int(self.ends[last]) - hi
        return starts, stops

    def take(self, lo: int, hi: int) -> Runs:
        """Entries ``lo .. hi - 1``; past the end they wrap to the start again (padding)."""
        total = len(self)
        if hi > lo and not total:
            raise ConfigError(f"entries {lo}..{hi - 1} of no remaining rows: nothing to read.")
        starts: list[Positions] = []
        stops: list[Positions] = []
        while lo < hi:
            inside = lo % total
            count = min(total - inside, hi - lo)
            a, b = self._cut(inside, inside + count)
            starts.append(a)
            stops.append(b)
            lo += count
        if not starts:
            return Runs([], [])
        return Runs(np.concatenate(starts), np.concatenate(stops))

    def at(self, entries: Positions) -> Positions:
        """The positions of ``entries`` (wrapping past the end)."""
        entries = entries % len(self)
        slot = np.searchsorted(self.ends, entries, side="right")
        return self.stops[slot] - (self.ends[slot] - entries)

    def minus(self, other: Runs) -> Runs:
        """The positions of these sorted, disjoint runs that ``other`` (any runs) does not hold.

        One sweep over the runs' ends: a position stays where these runs cover it and none of
        ``other``'s do. The result is sorted, disjoint and merged.
        """
        if not len(self) or not len(other):
            return self
        n, m = len(self.starts), len(other.starts)
        points = np.concatenate([self.starts, self.stops, other.starts, other.stops])
        mine = np.concatenate([np.ones(n), -np.ones(n), np.zeros(2 * m)]).astype(np.int64)
        theirs = np.concatenate([np.zeros(2 * n), np.ones(m), -np.ones(m)]).astype(np.int64)
        sort = np.argsort(points, kind="stable")
        points, mine, theirs = points[sort], np.cumsum(mine[sort]), np.cumsum(theirs[sort])
        last = np.flatnonzero(np.diff(points, append=points[-1] + 1))  # a point's last event
        at = points[last]
        keep = ((mine[last] > 0) & (theirs[last] == 0))[:-1].astype(np.int8)  # at[i]..at[i+1]
        edges = np.diff(np.concatenate([[0], keep, [0]]))
        return Runs(at[np.flatnonzero(edges == 1)], at[np.flatnonzero(edges == -1)])


def share(remaining: int, world_size: int, uneven: str) -> int:
    """Entries per rank of a later leg: ``remaining // world_size``, or rounded up (``pad``).

    Unlike the first leg, fewer rows than ranks is no error: padded, ranks repeat rows; dropped,
    the leg reads nothing and the epoch ends.
    """
    return remaining // world_size if uneven == "drop" else -(-remaining // world_size)


def leg_share(plan: Plan, left: Runs, number: int, world_size: int) -> int:
    """Entries per rank in leg ``number`` (``0``: the epoch's first) reading ``left``."""
    if number == 0:
        return order.share_rows(plan.rows, world_size, plan.uneven)
    return share(len(left), world_size, plan.uneven)


def read_by(plan: Plan, left: Runs, number: int, leg: Leg) -> Runs:
    """The positions all of leg ``number``'s ranks read before each handed out ``consumed``.

    Overlapping runs where padding read a row twice; :meth:`Runs.minus` takes them as they are.
    """
    size = leg_share(plan, left, number, leg.world_size)
    count = max(leg.workers, 1)
    skips, _ = order.resume_plan(
        size,
        leg.workers,
        leg.consumed,
        batch_size=plan.batch_size,
        drop_last=plan.drop_last,
        loader_batch=leg.loader_batch,
    )
    starts: list[Positions] = []
    stops: list[Positions] = []
    scattered: list[Positions] = []
    for worker in range(count):
        lo, hi = order.worker_range(size, count, worker)
        skip = skips[worker]
        whole = skip - skip % plan.window if plan.shuffle else skip  # windows read through
        part, length = skip - whole, min(plan.window, hi - lo - whole)
        for rank in range(leg.world_size):
            first = rank * size + lo
            if whole:
                runs = left.take(first, first + whole)
                starts.append(runs.starts)
                stops.append(runs.stops)
            if part:  # the window being read: the first rows of its permutation
                taking = order.window_permutation(
                    length, seed=plan.seed, epoch=plan.epoch, rank=rank, worker=worker,
                    window=whole // plan.window, leg=number,
                )  # fmt: skip
                scattered.append(left.at(first + whole + taking[:part].astype(np.int64)))
    if scattered:
        rows = np.concatenate(scattered)
        starts.append(rows)
        stops.append(rows + 1)
    if not starts:
        return Runs([], [])
    return Runs(np.concatenate(starts), np.concatenate(stops))


def remaining(plan: Plan, legs: Sequence[Leg]) -> Runs:
    """The epoch positions no leg of ``legs`` (the epoch's earlier legs, in turn) has read.

    A leg that handed out every batch of its share ends the epoch: nothing remains. A saved
    count larger than that is an error (another dataset or batch size).
    """
    left = Runs.span(0, plan.rows)
    for number, leg in enumerate(legs):
        size = leg_share(plan, left, number, leg.world_size)
        total = order.leg_batches(
            size, leg.workers, plan.batch_size, plan.drop_last, leg.loader_batch
        )
        if leg.consumed > total:
            raise ConfigError(
                f"the saved data state says leg {number} (world_size={leg.world_size}, "
                f"num_workers={leg.workers}) handed out {leg.consumed} batches, but it had "
                f"only {total}; was it saved with another dataset or batch size?"
            )
        if leg.consumed == total:
            return Runs([], [])
        left = left.minus(read_by(plan, left, number, leg))
    return left
