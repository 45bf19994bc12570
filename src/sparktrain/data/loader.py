"""``StreamingLoader``: a ``DataLoader`` over a :class:`StreamingDataset` that counts batches.

DataLoader workers each read their own part of the rank's share, and the DataLoader takes
their batches in turn. Only the caller's process sees which batches were handed out, so this
loader counts them and tells the dataset: ``dataset.state_dict()`` is then exact, and a resumed
run's workers skip exactly what was consumed. A pass that ends moves the dataset to the next
epoch. ``persistent_workers`` is refused: persistent workers would never see a new epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from sparktrain.errors import ConfigError

if TYPE_CHECKING:
    from sparktrain.data.dataset import StreamingDataset


class StreamingLoader(DataLoader[Any]):
    """A ``DataLoader`` whose batches are the dataset's (``batch_size=None`` unless it yields rows).

    Args:
        dataset: The dataset to read.
        num_workers: DataLoader worker processes (each reads its own part of the share).
        **options: Other ``DataLoader`` options (``pin_memory``, ``prefetch_factor``,
            ``collate_fn``; ``batch_size`` only when the dataset yields single rows).
    """

    def __init__(self, dataset: StreamingDataset, num_workers: int = 0, **options: Any) -> None:
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
        if dataset.batch_size is not None:
            options["batch_size"] = None
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"num_workers={num_workers!r} must be a whole number >= 0.")
        super().__init__(dataset, num_workers=num_workers, **options)
        self.streaming = dataset

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        per = 1 if self.streaming.batch_size is not None else (self.batch_size or 1)
        return sum(-(-n // per) for n in self.streaming.worker_items(self.num_workers))

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """The epoch's batches, from the dataset's resume point; counts them as they go."""
        data = self.streaming
        if self.num_workers == 0:
            yield from super().__iter__()
            return
        batches = super().__iter__()  # the workers start here, from the resume point
        data._begin(self.num_workers, self.batch_size if data.batch_size is None else None)
        for batch in batches:
            data._count()
            yield batch
        data._end()
