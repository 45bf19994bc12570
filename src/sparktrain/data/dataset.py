"""``StreamingDataset``: a rank's share of Parquet, Delta or DataFrame rows, streamed as batches.

Every rank of a run builds the same dataset (pass it to the training function, or build it
inside); each finds its rank and world size from ``torch.distributed`` or the launch's
environment, and reads only its share. Iterate it directly, or through :meth:`loader` for
DataLoader workers; both count what was yielded so that :meth:`state_dict` resumes mid-epoch,
at the same world size or at another (:mod:`sparktrain.data.remainder`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypedDict

from torch.utils.data import IterableDataset, get_worker_info

from sparktrain.contract import env
from sparktrain.data import order, remainder
from sparktrain.data import state as state_module
from sparktrain.data.columns import check_schema
from sparktrain.data.reader import Stream, batches
from sparktrain.data.sources import Source
from sparktrain.data.state import Resume
from sparktrain.data.threads import rank_threads
from sparktrain.data.torch_workers import UNCOUNTED, SharedFlag, WorkerPlace
from sparktrain.ground.errors import ConfigError


def _group() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return env.contract_rank(), env.contract_world_size()


def _positive(name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number.")


class _Order(TypedDict):
    """A dataset's settings that the order of its rows depends on (a stream's and a leg's)."""

    seed: int
    shuffle: bool
    window: int
    batch_size: int | None
    drop_last: bool


class StreamingDataset(IterableDataset[Any]):
    """Batches (dicts of column name to tensor) of this rank's share, streamed from ``source``.

    Build one with :func:`sparktrain.data.from_parquet`, :func:`~sparktrain.data.from_delta`
    or :func:`~sparktrain.data.from_dataframe`; their options are described here.

    Args:
        source: The row groups to read.
        batch_size: Rows per batch; ``None`` yields single rows (for a ``DataLoader`` that
            batches, such as the Hugging Face ``Trainer``'s).
        columns: The columns to read, in order (all by default).
        shuffle: Shuffle row groups each epoch, and rows inside each window.
        seed: The shuffle's seed; every rank must use the same one.
        shuffle_buffer: Rows per shuffle window (memory: this many rows as tensors). The default
            keeps a window of 784-float rows (6 MB) in the CPU cache; larger windows mix more
            and read slower (docs/data.md, "Measured").
        uneven: When the rows do not divide among the ranks: ``"pad"`` repeats rows from the
            epoch's start, ``"drop"`` leaves the last ones out. Either way every rank yields the
            same number of batches. After a resume at another world size the rest of the epoch
            is divided the same way: ``"pad"`` repeats rows of the rest (a row read by padding
            counts as read, and is not read again), ``"drop"`` carries the rows the earlier
            world size had left out (and the short batches ``drop_last`` left out) over to the
            new one, which leaves out the last ``rest mod world_size`` of them (when the earlier
            size had handed out all its batches, the epoch is over and nothing is carried).
        drop_last: Leave out each worker's last, short batch.
        transform: Called on every batch (in the DataLoader worker) and its result yielded:
            decode images, tokenise text (string and binary columns come as lists).
        read_ahead: Chunks of rows (1,024 each) a thread decodes ahead of each reader (the
            rank's, or each DataLoader worker's), overlapping pyarrow's decoding with the rest
            of the work; ``0``: no thread. Iterated in the process, the thread needs a core:
            while the pass runs, a rank whose torch threads fill every core uses one fewer (on
            2 cores, 1 instead of 2), as with worker processes. Where each step is heavy CPU
            work on few cores that costs more than it gives: pass ``0`` there (docs/data.md,
            "Reading ahead").
        rank, world_size: Override the rank and group size found from the run.
    """

    def __init__(
        self,
        source: Source,
        *,
        batch_size: int | None = 256,
        columns: Sequence[str] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 2048,
        uneven: str = "pad",
        drop_last: bool = False,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        read_ahead: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        _positive("batch_size", batch_size, allow_none=True)
        _positive("shuffle_buffer", shuffle_buffer)
        if uneven not in order.UNEVEN:
            raise ConfigError(f"uneven={uneven!r} must be one of {order.UNEVEN}.")
        if not isinstance(read_ahead, int) or isinstance(read_ahead, bool) or read_ahead < 0:
            raise ConfigError(
                f"read_ahead={read_ahead!r} must be a whole number of chunks >= 0 (0: no thread)."
            )
        if transform is not None and not callable(transform):
            raise ConfigError(f"transform={transform!r} must be a function of a batch dict.")
        self.source = source
        self.columns = tuple(check_schema(source.schema, columns, transform=transform is not None))
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.shuffle_buffer = shuffle_buffer
        self.uneven = uneven
        self.drop_last = bool(drop_last)
        self.transform = transform
        self.read_ahead = read_ahead
        self._fixed = (rank, world_size)
        self._resume = Resume()
        self._pass = Resume()  # the current pass: batches handed out, and how
        self._legs: tuple[remainder.Leg, ...] = ()  # this epoch's earlier world sizes
        self._left: tuple[int, tuple[remainder.Leg, ...], remainder.Runs] | None = None
        # Under torch's own DataLoader workers (torch_workers.py):
        self._uncounted = SharedFlag()  # a plain DataLoader's workers read this pass
        self._managed = False  # ds.loader(workers="torch") counts in the rank
        self._stateful = False  # in a StatefulDataLoader's worker: it keeps the worker's place
        self._yielded = 0  # that worker's batches (or rows) of the pass
        self._skip = 0  # where its place says the worker resumes

    # -- the group ------------------------------------------------------------------------
    def group(self) -> tuple[int, int]:
        """This process's rank and the number of ranks sharing the data."""
        rank, world = _group()
        rank = self._fixed[0] if self._fixed[0] is not None else rank
        world = self._fixed[1] if self._fixed[1] is not None else world
        if not 0 <= rank < world:
            raise ConfigError(f"rank={rank} must be in 0..{world - 1} (world_size={world}).")
        return rank, world

    def share(self) -> int:
        """Rows this rank reads per epoch."""
        return order.share_rows(self.source.rows, self.group()[1], self.uneven)

    def worker_items(self, workers: int) -> list[int]:
        """Batches (or rows) each of ``workers`` streams yields per epoch (one for none)."""
        share, count = self.share(), max(workers, 1)
        return [
            order.items(hi - lo, self.batch_size, self.drop_last)
            for lo, hi in (order.worker_range(share, count, w) for w in range(count))
        ]

    def __len__(self) -> int:
        """Batches (or rows) this rank yields per epoch when iterated without workers."""
        return self.worker_items(0)[0]

    # -- the epoch and resumption ------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch the next pass reads."""
        return self._resume.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch``'s order next (a pass that ends moves on to the next by itself)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}): the epoch must be a whole number >= 0.")
        if epoch != self._resume.epoch:
            self._resume, self._pass, self._legs = Resume(epoch=epoch), Resume(), ()
            self._uncounted.clear()

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: save it in a checkpoint; :meth:`load_state_dict` resumes there.

        ``epoch``; ``consumed``, ``workers``, ``loader_batch`` and ``world_size``: the batches
        each rank handed out at the current world size, and how; ``legs``: the same for each
        earlier world size of this epoch (an elastic run's resumptions), oldest first; and the
        settings the order depends on. Every rank's state is the same at a step boundary: any
        one of them resumes every rank, at this world size or at another, so save one (rank
        0's) rather than one per rank. Inside a worker of torchdata's ``StatefulDataLoader`` the
        state also holds that worker's place (``worker``), which the loader saves for it.

        Raises:
            ConfigError: A plain ``DataLoader``'s workers read this pass: nobody counted it.
        """
        info = get_worker_info()
        if info is not None:  # torchdata's StatefulDataLoader asks each worker
            self._stateful = True
            place = WorkerPlace(info.id, info.num_workers, self._yielded)
            return {**state_module.saved(self), "worker": place.as_dict()}
        if self._uncounted:
            raise ConfigError(UNCOUNTED)
        return state_module.saved(self)

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Resume at the next batch the saved run had not yet yielded, at any world size.

        At the saved world size the pass goes on where the saved one stopped (with the same
        ``num_workers``). At another, the ranks share what the saved run's ranks had not read
        (computed from this state alone) and read it to the end of the epoch, with any
        ``num_workers``; the next epoch is a whole one at the new size. ``state`` may also be a
        list of every rank's states, as all-gathered: any one of them resumes every rank.
        """
        if isinstance(state, Sequence):
            state = state_module.one_of(state)
        info = get_worker_info()
        place = state.get("worker")
        if info is not None and place is not None:  # a StatefulDataLoader's worker, resumed
            self._stateful = True
            same = (place["worker"], place["workers"]) == (info.id, info.num_workers)
            self._skip = int(place["yielded"]) if same else 0
        self._uncounted.clear()
        resume, legs = state_module.restore(self, state)
        left = self._remaining(resume.epoch, legs) if legs else None  # checks the counts first
        self._resume, self._pass, self._legs, self._left = resume, Resume(), legs, left

    # -- counting (by the process that hands the batches out) ------------------------------
    def _begin(self, workers: int, loader_batch: int | None) -> None:
        """A new pass starts at the resume point (an abandoned pass leaves it where it was)."""
        self._pass = Resume(self._resume.epoch, 0, workers, loader_batch)
        self._uncounted.clear()

    def _count(self) -> None:
        self._pass = replace(self._pass, consumed=self._pass.consumed + 1)

    def _end(self) -> None:
        """The pass read the epoch to its end: the next one reads the next epoch."""
        self._resume, self._pass = Resume(epoch=self._resume.epoch + 1), Resume()
        self._legs = ()

    def _remaining(
        self, epoch: int, legs: tuple[remainder.Leg, ...]
    ) -> tuple[int, tuple[remainder.Leg, ...], remainder.Runs]:
        """What ``legs`` of ``epoch`` left, with the epoch and legs it was computed from."""
        plan = remainder.Plan(
            rows=self.source.rows, epoch=epoch, uneven=self.uneven, **self._order()
        )
        return epoch, legs, remainder.remaining(plan, legs)

    def _order(self) -> _Order:
        """The settings the order of the rows depends on."""
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "window": self.shuffle_buffer,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def _runs(self) -> remainder.Runs:
        """The epoch positions this epoch's earlier legs left (computed once)."""
        left = self._left
        if left is None or left[:2] != (self.epoch, self._legs):
            left = self._left = self._remaining(self.epoch, self._legs)
        return left[2]

    # -- iteration -------------------------------------------------------------------------
    def stream(self, slot: int, workers: int) -> Stream:
        """The stream that DataLoader worker ``slot`` of ``workers`` reads (``0, 0``: none)."""
        rank, world = self.group()
        resume, count = self._resume, max(workers, 1)
        if resume.consumed and resume.workers != workers:
            raise ConfigError(
                f"the saved data state was read with num_workers={resume.workers}; "
                f"resume with the same, not {workers} (or at another world size, where "
                "any number of workers resumes)."
            )
        leg, runs = len(self._legs), None
        if leg:  # resumed at another world size: share what the earlier legs left
            left = self._runs()
            share = remainder.share(len(left), world, self.uneven)
        else:
            share = self.share()
        skips, turn = order.resume_plan(
            share,
            workers,
            resume.consumed,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            loader_batch=resume.loader_batch,
        )
        logical = (turn + slot) % count
        lo, hi = order.worker_range(share, count, logical)
        first, stop = rank * share + lo, rank * share + hi
        if leg:
            runs, first, stop = left.take(first, stop), 0, hi - lo
        return Stream(
            source=self.source,
            columns=self.columns,
            epoch=resume.epoch,
            rank=rank,
            worker=logical,
            first=first,
            stop=stop,
            skip=skips[logical],
            runs=runs,
            leg=leg,
            **self._order(),
        )

    def __iter__(self) -> Iterator[Any]:
        """This rank's batches for the current epoch (this worker's, inside a DataLoader)."""
        info = get_worker_info()
        if info is not None:  # one of torch's DataLoader workers (torch_workers.py)
            yield from self._in_torch_worker(info.id, info.num_workers)
            return
        stream = self.stream(0, 0)
        self._begin(0, None)
        with rank_threads(1) if self.read_ahead else contextlib.nullcontext():
            for item in self._produce(stream):
                self._count()
                yield item
        self._end()

    def _in_torch_worker(self, worker: int, workers: int) -> Iterator[Any]:
        """Worker ``worker``'s batches; counted by the rank, by a StatefulDataLoader, or nobody."""
        if not (self._managed or self._stateful):
            self._uncounted.set()  # a plain DataLoader: the rank's state_dict() refuses
        stream = self.stream(worker, workers)
        if self._skip:  # a StatefulDataLoader's worker resumes at its place
            rows = self._skip * (self.batch_size or 1)
            stream = replace(stream, skip=min(stream.skip + rows, stream.stop - stream.first))
        self._yielded = self._skip
        for item in self._produce(stream):
            self._yielded += 1
            yield _own_shared(item)

    @contextlib.contextmanager
    def managed(self) -> Iterator[None]:
        """While torch's DataLoader forks its workers for ``ds.loader(workers="torch")``."""
        self._managed = True
        try:
            yield
        finally:
            self._managed = False

    def _produce(self, stream: Stream) -> Iterator[Any]:
        transform = self.transform
        for batch in batches(stream, ahead=self.read_ahead):
            yield transform(batch) if transform is not None else batch

    def loader(self, num_workers: int = 0, **options: Any) -> Any:
        """A DataLoader over this dataset that keeps :meth:`state_dict` exact (``loader.py``)."""
        from sparktrain.data.loader import StreamingLoader

        return StreamingLoader(self, num_workers=num_workers, **options)


def _own_shared(item: Any) -> Any:
    """``item`` with each tensor that is a view of a larger buffer copied to shared memory.

    torch's worker queue hands a tensor over by moving its whole storage to ``/dev/shm``; a
    shuffled batch is a view of its window's buffer, so without this every batch in flight
    would hold a whole window there. A tensor of shared memory of its own goes as it is.
    """
    import torch

    if isinstance(item, dict):
        return {k: _own_shared(v) for k, v in item.items()}
    if isinstance(item, (tuple, list)) and not hasattr(item, "_fields"):
        return type(item)(_own_shared(v) for v in item)
    if isinstance(item, torch.Tensor) and item.untyped_storage().nbytes() > item.nbytes:
        own = torch.empty(item.shape, dtype=item.dtype).share_memory_()  # type: ignore[no-untyped-call]
        return own.copy_(item)
    return item
