"""``prepare_data_loader``: each rank its share of the data, a new order every epoch.

The loader is rebuilt with a ``DistributedSampler`` (shuffling when the original shuffled) and
wrapped so that every ``for batch in loader`` is a new epoch: ``set_epoch`` is called for you,
the step users most often forget (every epoch then sees the data in the same order).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class EpochLoader:
    """A ``DataLoader`` whose every iteration is a new epoch of its ``DistributedSampler``."""

    def __init__(self, loader: Any, sampler: Any) -> None:
        """Wrap ``loader``, whose sampler is ``sampler``."""
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def prepare_data_loader(loader: Any, *, seed: int = 0, drop_last: bool = False) -> EpochLoader:
    """Shard ``loader``'s dataset over the ranks; ``set_epoch`` is called each epoch.

    After ``prepare_model(..., tp=N)`` the shares go to the data-parallel groups: the ``tp``
    ranks of a group get the same batches.

    Args:
        loader: A ``torch.utils.data.DataLoader`` over a map-style dataset.
        seed: Seed of the shuffle (the same on every rank).
        drop_last: Drop the tail instead of padding every rank to the same length.
    """
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    from sparktrain.strategies.mesh import data_share

    shuffle = isinstance(loader.sampler, RandomSampler)
    share = data_share()  # under tp, the ranks of a tensor-parallel group read the same batches
    placement = {} if share is None else {"num_replicas": share[0], "rank": share[1]}
    sampler: Any = DistributedSampler(
        loader.dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, **placement
    )
    rebuilt = DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
    )
    return EpochLoader(rebuilt, sampler)
