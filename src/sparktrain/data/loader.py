"""``StreamingLoader``: a ``DataLoader`` over a :class:`StreamingDataset` that counts batches.

Workers each read their own part of the rank's share, and the loader takes their batches in
turn. Only the rank's process sees which batches were handed out, so this loader counts them
and tells the dataset: ``dataset.state_dict()`` is then exact, and a resumed run's workers skip
exactly what was consumed. A pass that ends moves the dataset to the next epoch.

How workers hand their batches over (``workers=``):

- ``"processes"`` (the default): worker processes write each batch into a slot of shared
  memory that is reused, and the rank reads it there without a copy (:mod:`~sparktrain.data.
  workers`, :mod:`~sparktrain.data.slots`). torch's own hand-off allocates, maps and passes a
  new shared-memory file for every batch, which cost two thirds of the throughput here.
- ``"threads"``: worker threads in the rank (:mod:`~sparktrain.data.threads`): no second process,
  no shared memory; pyarrow and torch release the GIL, Python code in a ``transform`` does not,
  so only processes spread a transform's Python over cores.
- ``"torch"``: torch's own DataLoader workers, for options only they have
  (``multiprocessing_context``, ``timeout``...).

docs/data.md ("Workers") has the measurements and when to pick which. ``persistent_workers`` is
refused: persistent workers would never see a new epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal

from torch.utils.data import DataLoader, default_collate

from sparktrain.data.columns import row_bytes
from sparktrain.data.workers import ProcessWorkers, check_workers
from sparktrain.ground.errors import ConfigError

if TYPE_CHECKING:  # circle: a type only; the dataset makes its loader (StreamingDataset.loader)
    from sparktrain.data.dataset import StreamingDataset

Handoff = Literal["processes", "threads", "torch"]
HANDOFFS: tuple[Handoff, ...] = ("processes", "threads", "torch")
#: Options that torch's own workers take and ours do not.
_TORCH_ONLY = ("multiprocessing_context", "timeout", "generator", "pin_memory_device", "in_order")


class StreamingLoader(DataLoader[Any]):
    """A ``DataLoader`` whose batches are the dataset's (``batch_size=None`` unless it yields rows).

    Args:
        dataset: The dataset to read.
        num_workers: Workers (each reads its own part of the share); 0 reads in the rank.
        workers: How workers hand batches over: ``"processes"``, ``"threads"`` or ``"torch"``
            (module doc).
        **options: Other ``DataLoader`` options: ``pin_memory``, ``prefetch_factor`` (batches
            each worker may hold ready, 2 by default), ``worker_init_fn``, ``collate_fn`` and
            ``batch_size``/``drop_last`` (only when the dataset yields single rows).
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        *,
        workers: Handoff = "processes",
        **options: Any,
    ) -> None:
        if options.get("persistent_workers"):
            raise ConfigError(
                "persistent_workers=True would keep every epoch's first order; "
                "StreamingLoader starts its workers each epoch."
            )
        if dataset.batch_size is not None and options.get("batch_size") is not None:
            raise ConfigError(
                f"the dataset already yields batches of {dataset.batch_size}; leave batch_size "
                "out of loader(), or build the dataset with batch_size=None."
            )
        if workers not in HANDOFFS:
            raise ConfigError(f"workers={workers!r} must be one of {', '.join(HANDOFFS)}.")
        count = check_workers(num_workers)
        ours = workers != "torch" and count > 0
        given = sorted(o for o in _TORCH_ONLY if o in options)
        if ours and given:
            raise ConfigError(
                f"{', '.join(given)} are options of torch's own workers; pass workers='torch' "
                f"to use them, or leave them out (workers={workers!r})."
            )
        if dataset.batch_size is not None:
            options["batch_size"] = None
        self.handoff: Handoff = workers
        self.prefetch = int(options.pop("prefetch_factor", None) or 2) if ours else 2
        self.pin = bool(options.pop("pin_memory", False)) if ours else False
        self.init_fn: Callable[[int], Any] | None = (
            options.pop("worker_init_fn", None) if ours else None
        )
        super().__init__(dataset, num_workers=0 if ours else count, **options)
        self.num_workers = count  # what users and Lightning read
        self.streaming = dataset

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        per = 1 if self.streaming.batch_size is not None else (self.batch_size or 1)
        items = self.streaming.worker_items(self.num_workers)
        if self.drop_last and per > 1:
            return sum(n // per for n in items)
        return sum(-(-n // per) for n in items)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """The epoch's batches, from the dataset's resume point; counts them as they go."""
        data = self.streaming
        if self.num_workers == 0:
            yield from super().__iter__()
            return
        rows = self.batch_size if data.batch_size is None else None
        data.stream(0, self.num_workers)  # a bad resume (another num_workers) fails here
        batches: Iterator[Any]
        if self.handoff == "torch":
            self._check_shm()
            with data.managed():  # torch's workers are forked here
                batches = super().__iter__()
        else:
            batches = self._ours(rows)
        data._begin(self.num_workers, rows)
        for batch in batches:
            data._count()
            yield batch
        data._end()

    def _check_shm(self) -> None:
        """Refuse a torch hand-off that would fill ``/dev/shm``: torch then waits for ever."""
        data = self.streaming
        row = row_bytes(data.source.schema, data.columns)
        free = shm_free()
        if row is None or free is None:
            return
        per = row * (data.batch_size or self.batch_size or 1)
        flight = self.num_workers * ((self.prefetch_factor or 2) + 1)
        if per * flight <= free:
            return
        mb = 1 << 20
        raise ConfigError(
            f"workers='torch' hands every batch over through /dev/shm, which has "
            f"{free / mb:.0f} MB free here; a batch is {per / mb:.0f} MB and up to {flight} are "
            f"in flight ({self.num_workers} workers x (prefetch_factor + 1)), "
            f"{per * flight / mb:.0f} MB: torch would wait for ever once /dev/shm is full. Use "
            "workers='processes' (the default; it needs no /dev/shm), fewer workers or smaller "
            "batches, or give /dev/shm more room (docker run --shm-size=8g; on Kubernetes an "
            "emptyDir with medium: Memory at /dev/shm)."
        )

    def _ours(self, rows: int | None) -> Iterator[Any]:
        """Batches from our own workers (processes or threads), taken in turn."""
        collate = self.collate_fn if self.collate_fn is not None else default_collate
        data, workers, drop = self.streaming, self.num_workers, self.drop_last

        def produce(number: int) -> Iterator[Any]:  # in worker ``number``
            items = data._produce(data.stream(number, workers))
            return items if rows is None else _collated(items, rows, collate, drop)

        if self.handoff == "threads":
            from sparktrain.data.threads import ThreadWorkers

            pool: Any = ThreadWorkers(produce, self.num_workers, prefetch=self.prefetch)
            return _pinned(iter(pool)) if self.pin else iter(pool)
        return iter(
            ProcessWorkers(
                produce, self.num_workers, prefetch=self.prefetch, pin_memory=self.pin,
                init=self.init_fn,
            )
        )  # fmt: skip


def shm_free(path: str = "/dev/shm") -> int | None:
    """Bytes free in ``/dev/shm``, or ``None`` where there is none."""
    import os

    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _collated(
    rows: Iterator[Any], size: int, collate: Callable[[list[Any]], Any], drop_last: bool
) -> Iterator[Any]:
    """``rows`` collated ``size`` at a time (a dataset of single rows under a ``batch_size``)."""
    group: list[Any] = []
    for row in rows:
        group.append(row)
        if len(group) == size:
            yield collate(group)
            group = []
    if group and not drop_last:
        yield collate(group)


def _pinned(batches: Iterator[Any]) -> Iterator[Any]:
    """Each batch in page-locked memory (one copy), where CUDA is there to use it."""
    import torch
    from torch.utils.data._utils.pin_memory import pin_memory

    if not torch.cuda.is_available():
        yield from batches
        return
    for batch in batches:
        yield pin_memory(batch)  # type: ignore[no-untyped-call]
