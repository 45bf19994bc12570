"""A ``StreamingDataset`` read by torch's own DataLoader workers: whose, and what they counted.

A dataset iterated inside torch's DataLoader workers is a copy in each worker; the rank's own
copy never sees the batches, so its ``state_dict()`` cannot count them. Three cases:

- **``ds.loader(workers="torch")``**: the loader counts in the rank (it marks the dataset
  *managed* while it forks its workers).
- **torchdata's ``StatefulDataLoader``**: it asks each worker's copy for its ``state_dict()``
  (first before the worker's first batch, which is how it is told apart) and gives each worker
  its state back on resumption. In a worker, the state is the rank's state as the pass began
  plus this worker's place in its stream (:class:`WorkerPlace`), and ``load_state_dict`` puts the
  worker back there.
- **A plain ``DataLoader(ds, num_workers=k)``**: nobody counts. A worker marks it in a byte of
  memory shared with the rank (an anonymous mapping made before the fork), and the rank's
  ``state_dict()`` then refuses with the way out, rather than return a state that would start
  the epoch over.
"""

from __future__ import annotations

import mmap
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerPlace:
    """Where one of torch's DataLoader workers is in its stream (``StatefulDataLoader``).

    Attributes:
        worker: The worker's id.
        workers: How many workers the loader had.
        yielded: Batches (or rows) this worker yielded in the pass.
    """

    worker: int
    workers: int
    yielded: int

    def as_dict(self) -> dict[str, int]:
        """For a state dict."""
        return asdict(self)


class SharedFlag:
    """A byte shared with the processes forked after it was made (a pickle makes a fresh one)."""

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, 1)  # MAP_SHARED | MAP_ANONYMOUS: inherited across fork

    def set(self) -> None:
        """Raise the flag (in any process forked from the maker)."""
        self.memory[0] = 1

    def clear(self) -> None:
        """Lower it."""
        self.memory[0] = 0

    def __bool__(self) -> bool:
        return bool(self.memory[0])

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


UNCOUNTED = (
    "this dataset was read by the workers of a plain torch DataLoader, whose batches the rank "
    "cannot count: its state_dict() would start the epoch over. Iterate ds.loader(num_workers=k) "
    "(or torchdata's StatefulDataLoader, and save the loader's state_dict()) instead."
)
